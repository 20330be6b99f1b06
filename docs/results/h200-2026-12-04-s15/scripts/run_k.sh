#!/bin/bash
# Session 15 GPU batch K. Kernel: main's csrc (unchanged since de3c3f1) for both variants.
#   base: main de3c3f1's host (tmp_gpu/hosts/base).
#   c2:   the working tree: plan_chunks gives sampled calls two columns a thread in the _columns kernels (512-column
#         chunks) when a column a thread does not fit at most a block an SM and 64 chunks a row (3-4 x 16K, 1-2 x 32K).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/k
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
hostdir() { case $1 in base) echo $REPO/tmp_gpu/hosts/base;; *) echo $REPO;; esac; }
export TPSPEC_LL_SOURCE_DIR=$REPO/csrc/ll_exchange  # the host copy carries no csrc/
for v in base c2; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import torch, tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, L.plan_chunks(r, c, 2, 132, True), L.fused_kernel_name(torch.bfloat16, L.plan_chunks(r, c, 2, 132, True)[0], True)[15:]) for r in (1, 2, 3, 4, 5, 8) for c in (16384, 32768, 65536)])") >> $R/date.txt 2>&1
done
nvidia-cuda-mps-control -d; sleep 1
s=$(date +%s)
PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py > $R/check-c2.txt 2>&1
echo "check (c2, default shapes) rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-c2.txt)"
s=$(date +%s)
PYTHONPATH=$REPO timeout 90 python3 launch/ll_kernel_check.py --shapes 3x16384,4x16384,1x32768,2x32768,1x16640,2x20000,4x12289,3x8200 > $R/check-c2-shapes.txt 2>&1
echo "check (c2, changed shapes) rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-c2-shapes.txt)"
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
B="--tp 1 --rows 1,2,3,4,5,8 --widths 16384,32768,65536 --ag-iters 2 --timeout 70"
for i in 1 2 3; do for v in base c2; do bench tp1-$v-$i $v $B; done; done
s=$(date +%s)
timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-c2.txt 2>&1
echo "ll gpu tests (c2) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-c2.txt | tail -2
s=$(date +%s)
timeout 70 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-c2.txt 2>&1
echo "model/runtime/check gpu tests (c2) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-c2.txt | tail -2
[ $(( $(date +%s) - T0 )) -lt 420 ] && bench tp1-c2-default c2 --tp 1 --ag-iters 2 --timeout 70
TN="--rows 1,3,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60"
for n in 2 4; do [ $(( $(date +%s) - T0 )) -lt 480 ] && bench tp$n-c2 c2 --tp $n $TN; done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf k.tgz k && rm -rf k
