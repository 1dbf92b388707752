#!/usr/bin/env bash
# Create .venv and install planner into it, without pulling CUDA wheels on a CPU machine.
# A torch already importable by python3 is kept (the venv sees system site-packages);
# otherwise torch 2.13.0 is installed (the CPU build where pip is configured for it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv --system-site-packages .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[hf,data,dev]"
# tests/test_export.py builds torchtitan's own ParallelismConfig from `plan export`; torchtitan pins heavy
# dependencies it does not need for that, so it is installed without them (its config file needs only torch).
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps "torchtitan>=0.3,<0.4"

