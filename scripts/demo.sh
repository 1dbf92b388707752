#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the bundled default model and cluster: one plan train
# profiles the GPT-style decoder beside a second training process (as the cpu-2 cluster's two ranks will
# share this host; cached, so a second run skips it), chooses the whole strategy (shape, schedule,
# micro-batches, sync) by simulation, prints it beside the next best candidates, and trains with it on 2 gloo
# ranks with dynamic rebalancing. Everything lands in out/ (docs/train.md); the individual steps are
# plan profile, partition, show, check and run.
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONDONTWRITEBYTECODE  # Python's default: modules compiled once are kept (scripts/setup.sh)
bash scripts/setup.sh
.venv/bin/plan train planner.examples.gpt:gpt_small --cluster cpu-2 --steps 40 -o out
.venv/bin/plan check out/plan.json
