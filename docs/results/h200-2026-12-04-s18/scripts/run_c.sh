#!/bin/bash
# Session 18, batch C: survivors scored on the spot in the loop tiles (tmp_gpu/src/spot: no list in
# sampled_tile<false>; spot2: also no end-of-span barrier or survivor pass in the plain kernels) against head
# (f944ec0's source), one host (the tree's). ll_kernel_check on spot2; TP=1 at 64-256 rows alternating; LL GPU
# tests on spot2.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/c; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/src/*/ll_exchange.cu >> $R/date.txt
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$REPO/tmp_gpu/src/spot2 PYTHONPATH=$REPO timeout 120 \
  python3 launch/ll_kernel_check.py > $R/check-spot2.txt 2>&1
echo "check spot2 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-spot2.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name variant tp rows widths
  local s=$(date +%s) src=$REPO/tmp_gpu/src/$2
  TPSPEC_LL_SOURCE_DIR=$src PYTHONPATH=$REPO timeout 100 python3 -m tpspec bench exchange \
     --out /tmp/b-$1 --tp $3 --rows $4 --widths $5 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$1.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
ROWS=64,128,256; W=16384,65536
bench head-1 head 1 $ROWS $W; bench spot-1 spot 1 $ROWS $W; bench spot2-1 spot2 1 $ROWS $W
bench head-2 head 1 $ROWS $W; bench spot2-2 spot2 1 $ROWS $W; bench spot-2 spot 1 $ROWS $W
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$REPO/tmp_gpu/src/spot2 timeout 200 python3 -m pytest -v -p no:cacheprovider \
  tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
echo "ll gpu tests (spot2) rc=$? $(( $(date +%s) - s )) s"; tail -1 $R/ll-gpu.txt
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf c.tgz c && rm -rf c
