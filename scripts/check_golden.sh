#!/usr/bin/env bash
# Re-plan the bundled models from the committed profiles and compare every new plan with its golden
# plan (tests/golden/plans): fails when a plan is invalid or its predicted step time or peak memory
# grew by more than the tolerance (GOLDEN_TOLERANCE, default 2%; peak memory: GOLDEN_MEMORY_TOLERANCE,
# default the same). Deterministic: profiles are
# committed inputs, every placer is deterministic. The cases run GOLDEN_JOBS at a time (default: the
# machine's cores); each case's output is printed whole, in case order. Usage: scripts/check_golden.sh [CASE_NAME ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_plan.sh
tolerance=${GOLDEN_TOLERANCE:-2%}
memory_tolerance=${GOLDEN_MEMORY_TOLERANCE:-$tolerance}
jobs=${GOLDEN_JOBS:-$(nproc 2>/dev/null || echo 2)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# check_case NAME PROFILE CLUSTER METHOD SCHEDULE MICROBATCHES [OPTIONS...]: writes $work/NAME.log and,
# when the case fails, $work/NAME.failed holding why.
check_case() {
  local name=$1 profile=$2 cluster=$3 method=$4 schedule=$5 microbatches=$6
  shift 6
  local new="$work/$name.json" golden="tests/golden/plans/$name.json"
  {
    echo "== $name"
    if ! plan partition "tests/golden/profiles/$profile.json" --cluster "$cluster" --method "$method" \
        --schedule "$schedule" --microbatches "$microbatches" "$@" -o "$new" --json >/dev/null; then
      echo "$name (partition failed)" > "$work/$name.failed"
    elif ! plan check "$new" --baseline "$golden" --tolerance "$tolerance" --memory-tolerance "$memory_tolerance"; then
      echo "$name" > "$work/$name.failed"
    fi
  } > "$work/$name.log" 2>&1
}

names=()
running=0
while read -r name rest; do
  if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  names+=("$name")
  # shellcheck disable=SC2086  # $rest holds the case's fields and extra options, split on purpose
  check_case "$name" $rest &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then
    wait -n || true
    running=$((running - 1))
  fi
done < <(golden_cases)
wait
if [ ${#names[@]} -eq 0 ]; then
  echo "check_golden: no case matched: $*" >&2
  exit 2
fi
failed=()
for name in "${names[@]}"; do
  cat "$work/$name.log"
  if [ -f "$work/$name.failed" ]; then
    failed+=("$(cat "$work/$name.failed")")
  fi
done
count=${#names[@]}
if [ ${#failed[@]} -gt 0 ]; then
  echo "check_golden: ${#failed[@]} of $count golden plan(s) regressed or are invalid: ${failed[*]}" >&2
  echo "If the change is intended, run scripts/update_golden.sh and commit tests/golden/plans." >&2
  exit 1
fi
echo "check_golden: all $count golden plans hold (tolerance $tolerance, memory $memory_tolerance)"
