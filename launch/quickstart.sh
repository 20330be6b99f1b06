#!/usr/bin/env bash
# One command on a fresh machine: install into .venv, then run the main job
# (a tiny Llama the package makes itself, TP=2 over two CPU processes with gloo,
# n-gram speculative decoding). Extra arguments go to `tpspec generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/tpspec generate "$@"
