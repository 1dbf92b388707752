#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the bundled default model and cluster:
# profile the GPT-style decoder, partition it over the cpu-2 cluster (greedy, refined offline),
# show the plan (table, timeline, Perfetto trace), then train with it on 2 gloo ranks with
# dynamic rebalancing. Everything lands in out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
plan=.venv/bin/plan
model=planner.examples.gpt:gpt_small
mkdir -p out
"$plan" profile "$model" --estimate h100-sxm,a100-80g --colocate 2 -o out/profile.json
"$plan" partition out/profile.json --cluster cpu-2 --method greedy --refine \
  --microbatches 8 --schedule 1f1b -o out/plan.json
"$plan" show out/plan.json
"$plan" check out/plan.json
"$plan" run out/plan.json "$model" --steps 40 --round-steps 5 \
  --log out/rounds.jsonl -o out/final-plan.json
