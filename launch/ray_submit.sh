#!/usr/bin/env bash
# Submit `tpspec generate` as a Ray job: one actor per TP rank in a placement group.
#
#   RAY_ADDRESS=http://head:8265 launch/ray_submit.sh --tensor-parallel-size 8 --device cuda --model /ckpt/llama
#   launch/ray_submit.sh --tensor-parallel-size 2 --device cpu          # against `ray start --head` on this host
#
# The working directory (this repository) is shipped with the job; the cluster's Python must
# have torch and ray (pip install -e ".[ray]" on every node, or a runtime_env of your own).
set -euo pipefail
cd "$(dirname "$0")/.."
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
exec ray job submit --address "$RAY_ADDRESS" --working-dir . \
    --runtime-env-json '{"env_vars": {"NCCL_NVLS_ENABLE": "0"}}' \
    -- python launch/ray_job.py "$@"
