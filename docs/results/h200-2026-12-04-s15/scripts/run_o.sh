#!/bin/bash
# Session 15 GPU batch O: the final code (main ad0040d) at the shapes: TP=1, TP=2 and TP=8 with the default
# rows {1, 8, 64, 256} x widths {16K, 32K, 64K}; TP=4 at 16K.
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/o
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py tpspec/bench/exchange.py >> $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1; shift
  local o=/tmp/b-$name s=$(date +%s)
  timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "ll_max_keys +graph|ll_argmax_tokens +graph" $R/$name.txt | awk '{printf "%s/%s=%s ", substr($5,4,3),$2,$7} END {print ""}'
  grep -E "(ll|local)_fused +graph" $R/$name.txt | awk '{printf "%s/%s/%sx%s=%s ", substr($5,1,2),substr($4,1,2),$2,$3,$7} END {print ""}'
  grep -E "^note" $R/$name.txt
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
bench tp2 --tp 2 --ag-iters 2 --iters 50 --timeout 90
bench tp1 --tp 1 --ag-iters 2 --timeout 90
[ $(( $(date +%s) - T0 )) -lt 120 ] && bench tp8 --tp 8 --ag-iters 2 --iters 50 --timeout 90
[ $(( $(date +%s) - T0 )) -lt 190 ] && bench tp4 --tp 4 --rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf o.tgz o && rm -rf o
