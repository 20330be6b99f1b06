#!/bin/bash
# Session 12 GPU batch B: redux (block_max's two warp maxima by two redux.sync each instead of five shuffle
# rounds; tmp_gpu/v_redux) against HEAD's kernel: bit-exact check, TP=1 alternating three times, TP=2
# alternating twice, the LL GPU tests on redux.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/b
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt; git status --short >> $R/date.txt
srcdir() { if [ $1 = head ]; then echo $PWD/csrc/ll_exchange; else echo $PWD/tmp_gpu/v_$1; fi; }
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir redux) timeout 120 python3 launch/ll_kernel_check.py > $R/check-redux.txt 2>&1
echo "check redux rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-redux.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 v=$2; shift 2
  local o=/tmp/b-$name s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$(srcdir $v) timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph|local_read_floor"; case $name in tp[248]*) pat="ll_fused +graph|ll_max_keys +graph|ll_argmax_tokens";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s ", substr($5,1,8),substr($4,1,2),$2,$3,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
for i in 1 2 3; do
  for v in head redux; do bench tp1-$v-$i $v $B; done
done
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
for i in 1 2; do
  for v in head redux; do bench tp2-$v-$i $v --tp 2 $TN; done
done
s=$(date +%s)
TPSPEC_LL_SOURCE_DIR=$(srcdir redux) timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-redux.txt 2>&1
echo "ll gpu tests redux rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-redux.txt | tail -2
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf b.tgz b && rm -rf b
