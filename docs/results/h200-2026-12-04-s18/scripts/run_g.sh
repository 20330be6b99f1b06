#!/bin/bash
# Session 18, batch G: nored (tmp_gpu/src/nored: a warp publishes its bound to s_low without waiting for the old
# value and keeps its own for pass 2) against head (988d743's kernel source = f944ec0's), one host (the tree's):
# ll_kernel_check on nored; TP=1 at 1-256 rows alternating twice.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/g; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/src/*/ll_exchange.cu >> $R/date.txt
s=$(date +%s); TPSPEC_LL_SOURCE_DIR=$REPO/tmp_gpu/src/nored PYTHONPATH=$REPO timeout 120 \
  python3 launch/ll_kernel_check.py > $R/check-nored.txt 2>&1
echo "check nored rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-nored.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name variant
  local s=$(date +%s)
  TPSPEC_LL_SOURCE_DIR=$REPO/tmp_gpu/src/$2 PYTHONPATH=$REPO timeout 100 python3 -m tpspec bench exchange \
     --out /tmp/b-$1 --tp 1 --rows 1,8,64,128,256 --widths 16384,65536 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$1.txt | grep gumbel | awk '{printf "%sx%s=%s ", $2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
bench head-1 head; bench nored-1 nored; bench nored-2 nored; bench head-2 head
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf g.tgz g && rm -rf g
