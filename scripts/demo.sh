#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the bundled default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mkdir -p out
.venv/bin/plan profile planner.examples.gpt:gpt_small -o out/profile.json
