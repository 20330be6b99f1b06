#!/bin/bash
# Session 15 GPU batch J. Kernel: main's csrc (de3c3f1) for every variant; host variants in tmp_gpu/hosts:
#   base: main de3c3f1.
#   c512: sampled calls get 512-column chunks in the _columns kernels (two columns a thread) when a row has at most
#         64 of them and the call at most two blocks an SM (3-8 rows x 16K); 256-column chunks as on main.
#   cbx:  256-column chunks up to two blocks an SM (1-4 rows x 16K), then 512-column chunks up to two blocks an SM
#         with no limit on chunks a row (8 x 16K, 1-2 x 64K).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/j
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
hostdir() { echo $REPO/tmp_gpu/hosts/$1; }
export TPSPEC_LL_SOURCE_DIR=$REPO/csrc/ll_exchange  # the host copies carry no csrc/
for v in base c512 cbx; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import torch, tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, L.plan_chunks(r, c, 2, 132, True), L.fused_kernel_name(torch.bfloat16, L.plan_chunks(r, c, 2, 132, True)[0], True)[15:]) for r in (1, 2, 3, 4, 8, 16) for c in (16384, 65536)])") >> $R/date.txt 2>&1
done
nvidia-cuda-mps-control -d; sleep 1
SH=3x16384,4x16384,8x16384,1x65536,2x65536,5x12289,2x32768,7x4104
for v in c512 cbx; do
  s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD timeout 90 python3 $REPO/launch/ll_kernel_check.py --shapes $SH) > $R/check-$v.txt 2>&1
  echo "check $v rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-$v.txt)"
done
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,2,3,4,8,16 --widths 16384,65536 --ag-iters 2 --timeout 70"
for i in 1 2 3; do for v in base c512 cbx; do bench tp1-$v-$i $v $B; done; done
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60"
for i in 1 2; do [ $(( $(date +%s) - T0 )) -lt 330 ] && bench tp8-base-$i base --tp 8 $TN; done
if [ $(( $(date +%s) - T0 )) -lt 430 ]; then
  s=$(date +%s)
  (cd $(hostdir cbx) && PYTHONPATH=$PWD timeout 130 python3 -m pytest -v -p no:cacheprovider $REPO/tests/test_ll_gpu.py) > $R/ll-gpu-cbx.txt 2>&1
  echo "ll gpu tests (cbx) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-cbx.txt | tail -2
fi
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf j.tgz j && rm -rf j
