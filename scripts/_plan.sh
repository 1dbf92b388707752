# Sourced by the golden scripts: `plan` runs the planner CLI from this checkout.
# Prefers the virtual environment of scripts/setup.sh, then a `plan` on PATH, then the package in place.
plan() {
  if [ -x .venv/bin/plan ]; then
    .venv/bin/plan "$@"
  elif command -v plan >/dev/null 2>&1; then
    command plan "$@"
  else
    python3 -c 'from planner.cli import main; main()' "$@"
  fi
}

# golden_cases: the non-comment lines of tests/golden/cases.txt, one case per line.
golden_cases() {
  grep -v '^[[:space:]]*\(#\|$\)' tests/golden/cases.txt
}
