#!/usr/bin/env bash
# Submit `tpspec generate` as a Ray job: one actor per TP rank in a placement group.
#
#   RAY_ADDRESS=http://head:8265 launch/ray_submit.sh --tensor-parallel-size 8 --device cuda --model /ckpt/llama
#   launch/ray_submit.sh --tensor-parallel-size 2 --device cpu          # against `ray start --head` on this host
#
# Ray's job CLI runs from this checkout's venv (PYTHON, default .venv/bin/python), which needs
# ray[default]: pip install -e '.[ray]'. The working directory (this repository) is shipped with the
# job; the cluster's Python must have torch and ray (the same extra on every node, or a runtime_env of
# your own).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
# The job CLI needs ray[default] (plain `ray` lacks the HTTP clients it submits with).
if ! "$PY" -c "import ray, aiohttp, requests" 2>/dev/null; then
    echo "launch/ray_submit.sh: Ray's job CLI needs ray[default] in $PY: $PY -m pip install -e '.[ray]'" >&2
    exit 2
fi
exec "$PY" -m ray.scripts.scripts job submit --address "$RAY_ADDRESS" --working-dir . \
    --runtime-env-json '{"env_vars": {"NCCL_NVLS_ENABLE": "0"}}' \
    -- python launch/ray_job.py "$@"
