#!/bin/bash
# Session 9 GPU batch E: greedy loop with the next group's loads issued before ranking (v_pipe) vs
# the session 9 kernel (v_s9), TP=1 alternating; checks and the GPU tests on v_pipe.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
R=$OUT/e
mkdir -p /tmp/mps /tmp/mpslog $R
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
bench() {
  local name=$1 dir=$2; shift 2
  local o=/tmp/b-$name
  TPSPEC_LL_SOURCE_DIR=$dir timeout 120 python3 -m tpspec bench exchange --out $o "$@" > $R/$name.txt 2>&1
  echo "== $name rc=$?"; grep -E "local_fused +graph|local_read_floor" $R/$name.txt | awk '{printf "%s/%s/%s/%s=%s  ", $5,$2,$3,$4,$7} END {print ""}'
  grep -i "streaming" $R/$name.txt | head -2
  cp $o/exchange.json $R/$name.json 2>/dev/null; cp $o/exchange.png $R/$name.png 2>/dev/null
}
T1="--tp 1 --rows 1,8,64,256 --widths 16384,65536 --ag-iters 2 --timeout 80"
for i in 1 2; do bench tp1-pipe-$i tmp_gpu/v_pipe $T1; bench tp1-s9-$i tmp_gpu/v_s9 $T1; done
export TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_pipe
timeout 100 python3 launch/ll_kernel_check.py > $R/check-pipe.txt 2>&1; echo "check rc=$?"; tail -1 $R/check-pipe.txt
s=$(date +%s)
timeout 200 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu-pipe.txt 2>&1; echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "passed|failed" $R/ll-gpu-pipe.txt | tail -2
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-pipe.txt 2>&1; echo "other gpu tests rc=$?"; tail -1 $R/other-pipe.txt
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf e.tgz e && rm -rf e
