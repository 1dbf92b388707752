#!/usr/bin/env bash
# Re-make the golden plans (tests/golden/plans) from the committed profiles. With --profiles, first
# re-measure the profiles of tests/golden/models.txt on this machine (times vary from run to run, so
# review `git diff --stat tests/golden` before committing). Usage: scripts/update_golden.sh [--profiles]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_plan.sh
if [ "${1:-}" = "--profiles" ]; then
  estimate=$(python3 -c 'import json; print(",".join(json.load(open("profiles/devices.json"))["devices"]))')
  while read -r name spec; do
    echo "== profile $name ($spec)"
    plan profile "$spec" -o "tests/golden/profiles/$name.json" --estimate "$estimate" --json >/dev/null
  done < <(grep -v '^[[:space:]]*\(#\|$\)' tests/golden/models.txt)
fi
while read -r name profile cluster method schedule microbatches rest; do
  echo "== plan $name"
  # shellcheck disable=SC2086  # $rest holds extra options, split on purpose
  plan partition "tests/golden/profiles/$profile.json" --cluster "$cluster" --method "$method" \
    --schedule "$schedule" --microbatches "$microbatches" $rest -o "tests/golden/plans/$name.json" --json >/dev/null
done < <(golden_cases)
echo "update_golden: wrote $(golden_cases | wc -l) plans to tests/golden/plans; review with scripts/check_golden.sh and git diff"
