#!/bin/bash
# Session 18, batch D: ranks sharing a GPU plan for their share of its SMs (the tree: sms_per_rank) against main's
# host (f944ec0, tmp_gpu/hosts/head: every rank plans for the whole GPU). Every rank on the one H200, TP=8 / 4 / 2,
# 1-256 rows x 16K, alternating; LL GPU tests on the tree (the wave test asserts the share).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/d; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
H=$REPO/tmp_gpu/hosts/head
md5sum tpspec/exchange/ll.py $H/tpspec/exchange/ll.py csrc/ll_exchange/ll_exchange.cu $H/csrc/ll_exchange/ll_exchange.cu >> $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name tree|head tp
  local s=$(date +%s) d=$REPO
  [ $2 = head ] && d=$H
  (cd $d && PYTHONPATH=$d timeout 150 python3 -m tpspec bench exchange --out /tmp/b-$1 --tp $3 --rows 1,8,64,256 \
     --widths 16384 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1)
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "ll_fused +graph" $R/$1.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
bench tp8-head head 8; bench tp8-tree tree 8; bench tp4-tree tree 4; bench tp4-head head 4
bench tp2-head head 2; bench tp2-tree tree 2; bench tp8-tree2 tree 8; bench tp8-head2 head 8
s=$(date +%s); timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1
echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; tail -1 $R/ll-gpu.txt
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf d.tgz d && rm -rf d
