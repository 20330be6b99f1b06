#!/usr/bin/env bash
# Run `tpspec generate` under torchrun: every process is one TP rank, rank 0 prints.
#
#   launch/torchrun.sh                              # 2 ranks on this host, tiny model, CPU
#   NPROC=8 launch/torchrun.sh --model /ckpt/llama --device cuda --speculative-config '{"method": "draft_model", "model": "/ckpt/draft"}'
#
# Several nodes (one TP group spanning them; the exchange falls back to all-gather across nodes):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC=8 launch/torchrun.sh --device cuda ...
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 MASTER_PORT=29500 NPROC=8 launch/torchrun.sh --device cuda ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
NPROC=${NPROC:-2}
export NCCL_NVLS_ENABLE=0  # never NVLink multicast (NVLS): the LL exchange and NCCL here do without it
if [ "${NNODES:-1}" -gt 1 ]; then
    exec "$PY" -m torch.distributed.run --nnodes "$NNODES" --node-rank "${NODE_RANK:?set NODE_RANK}" \
        --master-addr "${MASTER_ADDR:?set MASTER_ADDR}" --master-port "${MASTER_PORT:-29500}" \
        --nproc-per-node "$NPROC" -m tpspec generate --distributed-executor-backend external_launcher "$@"
fi
exec "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m tpspec generate --distributed-executor-backend external_launcher "$@"
