#!/bin/bash
# Session 18, batch B: the kernel source variants (tmp_gpu/src/X/ll_exchange.cu, one host: the tree's):
#   head  f944ec0's source
#   comb  the tree: the first logits loaded beside the row's inputs (pre) + one epoch load a block and a plain
#         step-counter load (epo)
#   pre   comb without epo;  epo   head with epo only
# ll_kernel_check on comb; TP=1 benches alternating; TP=2 head/comb; LL GPU tests on comb.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/b; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/src/*/ll_exchange.cu >> $R/date.txt
s=$(date +%s); PYTHONPATH=$REPO timeout 120 python3 launch/ll_kernel_check.py > $R/check-comb.txt 2>&1
echo "check comb rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-comb.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name variant tp rows widths
  local s=$(date +%s) src=$REPO/csrc/ll_exchange
  [ $2 != comb ] && src=$REPO/tmp_gpu/src/$2
  TPSPEC_LL_SOURCE_DIR=$src PYTHONPATH=$REPO timeout 100 python3 -m tpspec bench exchange \
     --out /tmp/b-$1 --tp $3 --rows $4 --widths $5 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$1.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
ROWS=1,8,64,128,256; W=16384,65536
bench head-1 head 1 $ROWS $W; bench comb-1 comb 1 $ROWS $W; bench pre-1 pre 1 $ROWS $W; bench epo-1 epo 1 $ROWS $W
bench comb-2 comb 1 $ROWS $W; bench head-2 head 1 $ROWS $W
bench tp2-head head 2 1,8,64,256 16384; bench tp2-comb comb 2 1,8,64,256 16384
s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|PASSED|FAILED" $R/ll-gpu.txt | tail -12
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf b.tgz b && rm -rf b
