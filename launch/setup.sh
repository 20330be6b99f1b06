#!/usr/bin/env bash
# Create .venv (if missing) and install tpspec with its test dependencies.
# CPU machines get the CPU torch wheel; a GPU machine keeps whatever torch it has.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import tpspec, torch; print(f'tpspec {tpspec.__version__} ready (torch {torch.__version__})')"
