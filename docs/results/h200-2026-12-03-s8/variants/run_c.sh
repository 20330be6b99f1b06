#!/bin/bash
# Session 8 GPU batch C: phase stamps of the fused kernel (eager and under a graph), the timeout test.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog $OUT/c
R=$OUT/c
date -u > $R/date.txt
timeout 120 python3 tmp_gpu/stamps.py --graph > $R/stamps-graph.txt 2>&1; echo "stamps graph rc=$?"; cat $R/stamps-graph.txt | grep -v "^ *$"
nvidia-cuda-mps-control -d; sleep 1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_ll_gpu.py -k timeout > $R/timeout-test.txt 2>&1; echo "timeout test rc=$?"; tail -1 $R/timeout-test.txt
TPSPEC_LL_SOURCE_DIR=tmp_gpu/v_errpoll timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_ll_gpu.py -k timeout > $R/timeout-test-errpoll.txt 2>&1; echo "timeout test on errpoll rc=$? (must fail)"; grep -E "took|passed|failed" $R/timeout-test-errpoll.txt | cut -c1-200 | head -3
echo quit | nvidia-cuda-mps-control
date -u >> $R/date.txt
cd $OUT && tar czf c.tgz c && rm -rf c
