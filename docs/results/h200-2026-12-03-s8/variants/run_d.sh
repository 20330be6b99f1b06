#!/bin/bash
# Session 8 GPU batch D: finer phase stamps (exchange tail, one exact score), exact score out of line.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p $OUT/d
R=$OUT/d
date -u > $R/date.txt
STAMP_SRC=tmp_gpu/v_stamp2 timeout 120 python3 tmp_gpu/stamps.py --graph --small > $R/stamps2-graph.txt 2>&1; echo "stamps2 rc=$?"; grep -v "^ *$" $R/stamps2-graph.txt
bench() {
  local name=$1 dir=$2; shift 2
  local o=/tmp/b-$name
  if [ -n "$dir" ]; then export TPSPEC_LL_SOURCE_DIR=$dir; else unset TPSPEC_LL_SOURCE_DIR; fi
  timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$?"; grep -E "local_fused +graph" $R/$name.txt | awk '{printf "%s/%s/%s=%s  ", $2,$3,$4,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
T1="--tp 1 --rows 1,8,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
for i in 1 2; do bench tp1-final-$i "" $T1; bench tp1-noinline-$i tmp_gpu/v_noinline $T1; done
date -u >> $R/date.txt
cd $OUT && tar czf d.tgz d && rm -rf d
