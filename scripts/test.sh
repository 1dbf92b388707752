#!/usr/bin/env bash
# Set up (scripts/setup.sh), print the resolved dependency versions, run the test suite, check that the
# README's figures match the benchmark reports and the examples in docs/ still print what the commands print, then re-plan the bundled models and check the result
# against the committed golden plans (a planner regression fails here).
set -euo pipefail
cd "$(dirname "$0")/.."
# Python's default: modules are compiled once and kept (an environment may turn that off; the suite starts many
# processes, each of which would compile what it imports again).
unset PYTHONDONTWRITEBYTECODE
bash scripts/setup.sh
bash scripts/versions.sh
# Two workers (pytest-xdist); the multi-process tests run one after another on one of them (tests/conftest.py).
.venv/bin/python -m pytest -q -n 2 --dist loadgroup --durations=15 "$@"
.venv/bin/python scripts/readme_figures.py --check
# The docs' examples (one process) are checked beside the golden plans (one case per core): 31 s -> 26 s here.
examples_log=$(mktemp)
trap 'rm -f "$examples_log"' EXIT
.venv/bin/python scripts/docs_examples.py --check > "$examples_log" 2>&1 &
examples=$!
golden=0
bash scripts/check_golden.sh || golden=$?
examples_status=0
wait "$examples" || examples_status=$?
cat "$examples_log"
[ "$examples_status" -eq 0 ] && [ "$golden" -eq 0 ]
