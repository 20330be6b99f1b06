#!/bin/bash
# Session 12 GPU batch D: the committed kernels (b386aa7) -- TP=1 twice, TP=4 and TP=8 once, for the figures.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/d
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py >> $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1; shift
  local o=/tmp/b-$name s=$(date +%s)
  timeout 150 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  local pat="local_fused +graph"; case $name in tp[248]*) pat="ll_fused +graph|ll_max_keys +graph|ll_argmax_tokens";; esac
  grep -E "$pat" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s ", substr($5,1,8),substr($4,1,2),$2,$3,$7} END {print ""}'
  grep -E "torch.max alone" $R/$name.txt | awk '{printf "%s=%s ", $3 "x" $5, $(NF-1)} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
B="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 100"
bench tp1-final-1 $B
bench tp1-final-2 $B
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 100"
bench tp4-final --tp 4 $TN
bench tp8-final --tp 8 $TN
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf d.tgz d && rm -rf d
