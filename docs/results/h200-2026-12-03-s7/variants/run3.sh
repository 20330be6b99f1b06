#!/bin/bash
# Session 7 GPU batch 3: final kernel (slot reset) timed next to session 6's.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/r3
R=$OUT/r3
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 dir=$2; shift 2
  local o=/tmp/b-$name
  if [ -n "$dir" ]; then export TPSPEC_LL_SOURCE_DIR=$dir; else unset TPSPEC_LL_SOURCE_DIR; fi
  timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$?"
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
unset TPSPEC_LL_SOURCE_DIR
timeout 100 python3 launch/ll_kernel_check.py > $R/check.txt 2>&1; echo "check rc=$?"; tail -1 $R/check.txt
bench tp1-final "" $T1
for i in 1 2 3; do bench tp2-final-$i "" --tp 2 $TN; bench tp2-head-$i tmp_gpu/v_head --tp 2 $TN; done
bench tp4-final "" --tp 4 $TN
bench tp4-head tmp_gpu/v_head --tp 4 $TN
bench tp8-final "" --tp 8 $TN
bench tp8-head tmp_gpu/v_head --tp 8 $TN
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf r3.tgz r3 && rm -rf r3
