#!/bin/bash
# Session 7 GPU batch 1: slot reset + adaptive greedy unroll.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/r1
R=$OUT/r1
date -u > $R/date.txt
nvidia-cuda-mps-control -d
bench() {  # name variant_dir args...
  local name=$1 dir=$2; shift 2
  local o=/tmp/b-$name
  if [ -n "$dir" ]; then
    TPSPEC_LL_SOURCE_DIR=$dir timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  else
    timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  fi
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
  echo "== $name rc=$?"; grep -E "local stage|max_keys  graph|local_fused|ll_argmax_tokens  graph" $R/$name.txt | head -40
}
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
TN="--rows 1,8,64,256 --widths 16384 --ag-iters 2 --iters 50 --timeout 80"
timeout 120 python3 launch/ll_kernel_check.py > $R/check.txt 2>&1; echo "check rc=$?"; tail -3 $R/check.txt
bench tp1-new "" $T1
bench tp1-reset tmp_gpu/v_reset $T1
bench tp1-head tmp_gpu/v_head $T1
bench tp2-new "" --tp 2 $TN
bench tp2-head tmp_gpu/v_head --tp 2 $TN
bench tp2-new-b "" --tp 2 $TN
bench tp2-head-b tmp_gpu/v_head --tp 2 $TN
bench tp4-new "" --tp 4 $TN
bench tp8-new "" --tp 8 $TN
echo quit | nvidia-cuda-mps-control; sleep 1
TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_head timeout 120 python3 -m pytest -q -x tests/test_ll_gpu.py -k epoch_cycle > $R/epoch-test-head.txt 2>&1; echo "epoch test on head kernel rc=$? (expect failure)"; tail -5 $R/epoch-test-head.txt
timeout 240 python3 -m pytest -q tests/test_ll_gpu.py tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/gpu-tests.txt 2>&1; echo "gpu tests rc=$?"; tail -3 $R/gpu-tests.txt
date -u >> $R/date.txt
cd $OUT && tar czf r1.tgz r1 && rm -rf r1
