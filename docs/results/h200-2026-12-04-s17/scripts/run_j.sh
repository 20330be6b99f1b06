#!/bin/bash
# Session 17, batch J: clD (the working tree: the plain and _columns fused kernels carry __cluster_dims__(8), the
# host pads their grids to whole clusters with blocks that return at once; the _one_tile twins unchanged) against
# main (80c044b, tmp_gpu/hosts/head): exactness, TP=1 at 1-256 rows twice alternating, TP=2 once each, LL GPU tests.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/j; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
H=$REPO/tmp_gpu/hosts/head
md5sum csrc/ll_exchange/ll_exchange.cu $H/csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py $H/tpspec/exchange/ll.py >> $R/date.txt
s=$(date +%s); PYTHONPATH=$REPO timeout 120 python3 launch/ll_kernel_check.py > $R/check-clD.txt 2>&1
echo "check clD rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-clD.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name tree|head tp rows widths
  local s=$(date +%s) d=$REPO
  [ $2 = head ] && d=$H
  (cd $d && TPSPEC_LL_SOURCE_DIR=$d/csrc/ll_exchange PYTHONPATH=$d timeout 100 python3 -m tpspec bench exchange \
     --out /tmp/b-$1 --tp $3 --rows $4 --widths $5 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1)
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "local_fused +graph" $R/$1.txt | awk '{printf "%s/%sx%s=%s ", substr($5,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
bench head-1 head 1 1,8,64,128,256 16384,65536; bench clD-1 tree 1 1,8,64,128,256 16384,65536
bench clD-2 tree 1 1,8,64,128,256 16384,65536; bench head-2 head 1 1,8,64,128,256 16384,65536
bench tp2-head head 2 1,8,64,256 16384; bench tp2-clD tree 2 1,8,64,256 16384
s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed|PASSED|FAILED" $R/ll-gpu.txt | tail -12
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf j.tgz j && rm -rf j
