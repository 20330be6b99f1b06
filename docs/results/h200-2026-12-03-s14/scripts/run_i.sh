#!/bin/bash
# Session 14 GPU batch I. Kernel: wip/columns-twin's (csrc, unchanged) for both.
#   cols: the branch HEAD's host (tmp_gpu/hosts/base).
#   g16:  working tree: greedy_blocks (a block a 16 KiB group while that fits an SM each, at least SMs/2; one an SM
#         up to two groups a block; then two an SM) and greedy chunks of whole groups past a pack a thread.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/i
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
hostdir() { case $1 in cols) echo $REPO/tmp_gpu/hosts/base;; *) echo $REPO;; esac; }
for v in cols g16; do
  (cd $(hostdir $v) && PYTHONPATH=$PWD python3 -c "
import tpspec.exchange.ll as L
print('$v', L.__file__, [(r, c, L.plan_chunks(r, c, 2, 132, False)) for r in (1, 2, 4, 8, 16, 32, 64, 128, 256) for c in (16384, 65536)])") >> $R/date.txt 2>&1
done
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  (cd $(hostdir $v) && PYTHONPATH=$PWD timeout 80 python3 -m tpspec bench exchange --out $o "$@") > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
B="--tp 1 --rows 1,2,4,8,16,32,64,128,256 --widths 16384,65536 --ag-iters 2 --timeout 70"
for i in 1 2; do for v in cols g16; do bench tp1-$v-$i $v $B; done; done
s=$(date +%s)
timeout 130 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-g16.txt 2>&1
echo "ll gpu tests (g16) rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-g16.txt | tail -2
s=$(date +%s)
timeout 60 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-g16.txt 2>&1
echo "model/runtime/check gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/other-g16.txt | tail -2
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60"
for n in 2 4 8; do [ $(( $(date +%s) - T0 )) -lt 300 ] && bench tp$n-g16 g16 --tp $n $TN; done
for v in cols g16; do [ $(( $(date +%s) - T0 )) -lt 330 ] && bench tp1-$v-3 $v $B; done
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf i.tgz i && rm -rf i
