#!/bin/bash
# Session 15 GPU batch L. The working tree (kernel unchanged since de3c3f1; plan_chunks with two columns a thread in
# the _columns kernels; bench exchange timing graphs by the median replay and recording the bare exchanges' mean).
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
REPO=$PWD
R=$OUT/l
T0=$(date +%s)
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
git log --oneline -1 >> $R/date.txt 2>&1
md5sum csrc/ll_exchange/ll_exchange.cu tpspec/exchange/ll.py tpspec/bench/exchange.py >> $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1; shift
  local o=/tmp/b-$name s=$(date +%s)
  timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s )) s"
  grep -E "ll_max_keys +graph|ll_argmax_tokens +graph" $R/$name.txt | awk '{printf "%s/%s=%s ", substr($5,4,3),$2,$7} END {print ""}'
  grep -E "^note" $R/$name.txt
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 60"
for i in 1 2; do for n in 2 4 8; do bench tp$n-$i --tp $n $TN; done; done
bench tp1-full --tp 1 --rows 1,2,3,4,8,16,32,64,128,256 --widths 16384,32768,65536 --ag-iters 2 --timeout 90
grep -E "local_fused +graph" $R/tp1-full.txt | awk '{printf "%s/%sx%s=%s ", substr($4,1,2),$2,$3,$7} END {print ""}'
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
echo "total $(( $(date +%s) - T0 )) s"
cd $OUT && tar czf l.tgz l && rm -rf l
