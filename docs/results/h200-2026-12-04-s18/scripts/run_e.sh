#!/bin/bash
# Session 18, batch E: sampled grids of 8 or 16 blocks an SM (tmp_gpu/hosts/b8, b16: the tree with
# SAMPLED_BLOCKS_PER_SM = 8 / 16, so two or four waves of smaller chunks) against the tree's 4, at TP=1
# (8-256 rows x 16K, 64K) alternating, then TP=8 / TP=2 on the one GPU; ll_kernel_check on b8.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD; R=$OUT/e; mkdir -p /tmp/mps /tmp/mpslog $R; date -u > $R/date.txt; T0=$(date +%s)
md5sum tpspec/exchange/ll.py tmp_gpu/hosts/*/tpspec/exchange/ll.py >> $R/date.txt
s=$(date +%s); (cd tmp_gpu/hosts/b8 && PYTHONPATH=$PWD timeout 120 python3 launch/ll_kernel_check.py > $R/check-b8.txt 2>&1)
echo "check b8 rc=$? $(( $(date +%s) - s )) s: $(tail -1 $R/check-b8.txt)"
nvidia-cuda-mps-control -d; sleep 1
bench() {  # name tree|b8|b16 tp rows widths
  local s=$(date +%s) d=$REPO
  [ $2 != tree ] && d=$REPO/tmp_gpu/hosts/$2
  (cd $d && PYTHONPATH=$d timeout 150 python3 -m tpspec bench exchange --out /tmp/b-$1 --tp $3 --rows $4 \
     --widths $5 --ag-iters 2 --timeout 70 > $R/$1.txt 2>&1)
  echo "== $1 rc=$? $(( $(date +%s) - s )) s"
  grep -E "$6 +graph" $R/$1.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
  cp /tmp/b-$1/exchange.json $R/$1.json 2>/dev/null
}
ROWS=8,64,128,256; W=16384,65536
bench tree-1 tree 1 $ROWS $W local_fused; bench b8-1 b8 1 $ROWS $W local_fused; bench b16-1 b16 1 $ROWS $W local_fused
bench tree-2 tree 1 $ROWS $W local_fused; bench b8-2 b8 1 $ROWS $W local_fused; bench b16-2 b16 1 $ROWS $W local_fused
bench tp8-b8 b8 8 1,8,64,256 16384 ll_fused; bench tp2-b8 b8 2 1,8,64,256 16384 ll_fused
echo quit | nvidia-cuda-mps-control; date -u >> $R/date.txt; echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf e.tgz e && rm -rf e
