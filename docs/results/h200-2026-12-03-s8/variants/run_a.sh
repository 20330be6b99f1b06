#!/bin/bash
# Session 8 GPU batch A: correctness of the wrap sweep + shared give-up flag.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/a
R=$OUT/a
date -u > $R/date.txt
nvidia-cuda-mps-control -d; sleep 1
unset TPSPEC_LL_SOURCE_DIR
timeout 150 python3 launch/ll_kernel_check.py > $R/check.txt 2>&1; echo "check rc=$?"; tail -1 $R/check.txt
TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_nosweep timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_ll_gpu.py -k epoch_wrap > $R/epoch-nosweep.txt 2>&1
echo "epoch test with the sweep disabled rc=$? (must fail)"; grep -E "^E |failed|passed" $R/epoch-nosweep.txt | cut -c1-300 | head -6
s=$(date +%s)
timeout 240 python3 -m pytest -v -p no:cacheprovider tests/test_ll_gpu.py > $R/ll-gpu.txt 2>&1; echo "ll gpu tests rc=$? $(( $(date +%s) - s )) s"; grep -E "PASSED|FAILED|ERROR|passed|failed" $R/ll-gpu.txt | cut -c1-200
s=$(date +%s)
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py > $R/other-gpu-tests.txt 2>&1; echo "other gpu tests rc=$? $(( $(date +%s) - s )) s"; tail -1 $R/other-gpu-tests.txt
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf a.tgz a && rm -rf a
