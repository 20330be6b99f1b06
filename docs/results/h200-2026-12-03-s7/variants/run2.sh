#!/bin/bash
# Session 7 GPU batch 2: which LL GPU test is slow or hangs with the slot reset.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/r2
R=$OUT/r2
nvidia-cuda-mps-control -d; sleep 1; ls /tmp/mps > $R/mps-ls.txt
t() {  # name limit_s [env] -k expr
  local name=$1 limit=$2 src=$3 expr=$4 s=$(date +%s)
  ( sleep $((limit - 5)); nvidia-smi > $R/$name-smi.txt 2>&1; ps aux | grep -c "[p]ython" > $R/$name-ps.txt ) &
  local watcher=$!
  if [ -n "$src" ]; then export TPSPEC_LL_SOURCE_DIR=$src; else unset TPSPEC_LL_SOURCE_DIR; fi
  timeout $limit python3 -m pytest -v -x -p no:cacheprovider tests/test_ll_gpu.py -k "$expr" > $R/$name.txt 2>&1
  local rc=$?
  kill $watcher 2>/dev/null
  pkill -f multiprocessing.spawn 2>/dev/null
  LAST_RC=$rc
  echo "== $name rc=$rc $(( $(date +%s) - s )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed|Error" $R/$name.txt | head -8
}
t graph-new 100 "" "graph"
[ $LAST_RC -ne 0 ] && t graph-head 100 tmp_gpu/v_head "graph"
t stress-new 90 "" "stress"
[ $LAST_RC -ne 0 ] && t stress-head 90 tmp_gpu/v_head "stress"
t rest-new 150 "" "equals or timeout or epoch"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-gpu-tests.txt 2>&1; echo "other gpu tests rc=$?"; tail -2 $R/other-gpu-tests.txt
echo quit | nvidia-cuda-mps-control
cd $OUT && tar czf r2.tgz r2 && rm -rf r2
