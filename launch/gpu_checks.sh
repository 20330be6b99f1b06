#!/usr/bin/env bash
# Every GPU test, the exchange benchmark and the generate benchmark in one go, on one machine (what we run on the
# lent H200). Starts MPS first: rank processes sharing a GPU must run concurrently.
# Usage: bash launch/gpu_checks.sh OUT_DIR [TEST_TIMEOUT_S] [BENCH_TPS]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-out}; test_timeout=${2:-300}; bench_tps=${3:-"2 8"}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
mkdir -p /tmp/mps /tmp/mpslog
nvidia-cuda-mps-control -d 2>/dev/null || true
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
timeout "$test_timeout" python3 -m pytest -q -rfE -p no:cacheprovider --timeout 200 \
    tests/test_ll_gpu.py tests/test_model_gpu.py tests/test_runtime_gpu.py tests/test_check_gpu.py \
    2>&1 | tee "$out/pytest.txt"
for tp in $bench_tps; do
    timeout 110 python3 -m tpspec bench exchange --tp "$tp" --out "$out/bench-tp$tp" --ag-iters 5 \
        --timeout 100 2>&1 | tee "$out/bench-tp$tp.txt"
done
for tp in 1 2; do
    timeout 150 python3 -m tpspec bench generate --device cuda --tp "$tp" --out "$out/generate-tp$tp" \
        --timeout 140 2>&1 | tee "$out/generate-tp$tp.txt"
done
echo quit | nvidia-cuda-mps-control 2>/dev/null || true
