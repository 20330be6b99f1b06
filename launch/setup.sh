#!/usr/bin/env bash
# Create .venv (if missing) and install tpspec with its test dependencies.
# Torch comes from the pip index (set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu for the
# small CPU build); a venv that already has torch keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# pip, minus the noise of index locations this machine's pip config names but lacks; failures still fail.
pip_quiet() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }

if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    pip_quiet "torch==2.13.0"
fi
pip_quiet -e ".[dev]"
.venv/bin/python -c "import tpspec, torch; print(f'tpspec {tpspec.__version__} ready (torch {torch.__version__})')"
