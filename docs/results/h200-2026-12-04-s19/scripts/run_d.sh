#!/bin/bash
# Session 19, batch D: the final tree (pruned quads up to 2 a thread, sampled calls at 2 blocks an SM unless
# 4 fit one tile, the floor kernel's word a warp) against head (6be8eac's host and source).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/d; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum csrc/ll_exchange/ll_exchange.cu tmp_gpu/src/*/ll_exchange.cu tpspec/exchange/ll.py tpspec/bench/exchange.py >> $R/date.txt
XS=5x16384,8x16384,16x16384,32x16384,64x16384,128x16384,2x65536,8x32768,8x65536,16x65536,32x65536
s=$(date +%s); PYTHONPATH=$REPO timeout 100 python3 launch/ll_kernel_check.py > $R/check.txt 2>&1
echo "check rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check.txt)"
s=$(date +%s); PYTHONPATH=$REPO timeout 100 python3 launch/ll_kernel_check.py --shapes $XS > $R/checkx.txt 2>&1
echo "checkx rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/checkx.txt)"
s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/ll-gpu.txt)"
s=$(date +%s); timeout 120 python3 -m pytest -v -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-gpu.txt 2>&1
echo "other gpu tests rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/other-gpu.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name host tp rows widths
  local s=$(date +%s) dir=$REPO src=$REPO/csrc/ll_exchange
  [ $2 != tree ] && dir=$REPO/tmp_gpu/hosts/$2 && src=$REPO/tmp_gpu/src/$2
  (cd $dir && TPSPEC_LL_SOURCE_DIR=$src PYTHONPATH=$dir timeout 100 python3 -m tpspec bench exchange \
     --out /tmp/b-$1 --tp $3 --rows $4 --widths $5 --ag-iters 2 --timeout 80 > $R/$1.txt 2>&1)
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph|ll_fused +graph" $R/$1.txt | awk '{printf "%s/%s/%sx%s=%s ", substr($5,1,8),substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null; cp /tmp/b-$1/*.png $R/$1.png 2>/dev/null
}
ROWS=1,8,32,64,128,256; W=16384,32768,65536
bench tp1-tree tree 1 $ROWS $W
bench tp2 tree 2 1,8,64,256 16384; bench tp8 tree 8 1,8,64,256 16384
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt
cd $OUT && tar czf d.tgz d && rm -rf d; echo "total $(( $(date +%s) - T0 )) s"
