#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite, then guard the committed golden plans.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m pytest -q "$@"
