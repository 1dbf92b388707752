#!/usr/bin/env bash
# Re-plan the bundled models from the committed profiles and compare every new plan with its golden
# plan (tests/golden/plans): fails when a plan is invalid or its predicted step time or peak memory
# grew by more than the tolerance (GOLDEN_TOLERANCE, default 2%; peak memory: GOLDEN_MEMORY_TOLERANCE,
# default the same). Deterministic: profiles are
# committed inputs, every placer is deterministic. Usage: scripts/check_golden.sh [CASE_NAME ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_plan.sh
tolerance=${GOLDEN_TOLERANCE:-2%}
memory_tolerance=${GOLDEN_MEMORY_TOLERANCE:-$tolerance}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failed=()
count=0
while read -r name profile cluster method schedule microbatches rest; do
  if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then continue; fi
  count=$((count + 1))
  new="$work/$name.json"
  golden="tests/golden/plans/$name.json"
  echo "== $name"
  # shellcheck disable=SC2086  # $rest holds extra options, split on purpose
  if ! plan partition "tests/golden/profiles/$profile.json" --cluster "$cluster" --method "$method" \
      --schedule "$schedule" --microbatches "$microbatches" $rest -o "$new" --json >/dev/null; then
    failed+=("$name (partition failed)")
    continue
  fi
  if ! plan check "$new" --baseline "$golden" --tolerance "$tolerance" --memory-tolerance "$memory_tolerance"; then
    failed+=("$name")
  fi
done < <(golden_cases)
if [ "$count" -eq 0 ]; then
  echo "check_golden: no case matched: $*" >&2
  exit 2
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "check_golden: ${#failed[@]} of $count golden plan(s) regressed or are invalid: ${failed[*]}" >&2
  echo "If the change is intended, run scripts/update_golden.sh and commit tests/golden/plans." >&2
  exit 1
fi
echo "check_golden: all $count golden plans hold (tolerance $tolerance, memory $memory_tolerance)"
