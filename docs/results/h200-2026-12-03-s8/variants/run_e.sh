#!/bin/bash
# Session 8 GPU batch E: chunk reduction with shifts (v_reduce): timings and the full GPU suite on it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/e
R=$OUT/e
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 dir=$2; shift 2
  local o=/tmp/b-$name
  if [ -n "$dir" ]; then export TPSPEC_LL_SOURCE_DIR=$dir; else unset TPSPEC_LL_SOURCE_DIR; fi
  timeout 100 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$?"; grep -E "local_fused +graph|ll_fused +graph" $R/$name.txt | awk '{printf "%s/%s/%s/%s=%s  ", $2,$3,$4,$5,$7} END {print ""}'
  cp $o/exchange.json $R/$name.json 2>/dev/null
}
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
for i in 1 2; do bench tp1-final-$i "" $T1; bench tp1-reduce-$i tmp_gpu/v_reduce $T1; done
bench tp2-final "" --tp 2 $TN; bench tp2-reduce tmp_gpu/v_reduce --tp 2 $TN
export TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_reduce
timeout 100 python3 launch/ll_kernel_check.py > $R/check-reduce.txt 2>&1; echo "check rc=$?"; tail -1 $R/check-reduce.txt
s=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-reduce.txt 2>&1; echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $R/ll-gpu-reduce.txt | cut -c1-120
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-reduce.txt 2>&1; echo "other gpu tests rc=$?"; tail -1 $R/other-reduce.txt
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf e.tgz e && rm -rf e
