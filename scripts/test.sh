#!/usr/bin/env bash
# Set up (scripts/setup.sh), run the test suite, then re-plan the bundled models and check the
# result against the committed golden plans (a planner regression fails here).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/versions.sh
.venv/bin/python -m pytest -q "$@"
bash scripts/check_golden.sh
