#!/usr/bin/env bash
# Create .venv and install planner into it, without pulling CUDA wheels on a CPU machine.
# A torch already importable by python3 is kept (the venv sees system site-packages);
# otherwise torch 2.13.0 is installed (the CPU build where pip is configured for it).
# Nothing is byte-compiled at install (--no-compile): torch and transformers hold thousands of modules that planner
# never imports, and compiling them all took about 20 of the set-up's 60 seconds here. Python compiles a module
# when it is first imported and keeps it (__pycache__); the last lines compile planner and import what its processes
# import from torch and scikit-learn, so that even an environment that turns that cache off (PYTHONDONTWRITEBYTECODE,
# as this project's CI machine does) reads them compiled.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  # The venv uses the pip the system site-packages hold (installing pip into it took 6 s); ensurepip where none.
  "$PYTHON" -m venv --system-site-packages --without-pip .venv
fi
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  .venv/bin/python -m ensurepip --quiet
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  .venv/bin/python -m pip install --quiet --no-compile "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check -e ".[hf,data,dev]"
# tests/test_export.py builds torchtitan's own ParallelismConfig from `plan export`; torchtitan pins heavy
# dependencies it does not need for that, so it is installed without them (its config file needs only torch).
.venv/bin/python -m pip install --quiet --no-compile --disable-pip-version-check --no-deps "torchtitan>=0.3,<0.4"
.venv/bin/python -m compileall -q planner >/dev/null
env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "import torch.distributed.pipelining, torch.distributed.run, sklearn.datasets"
