#!/usr/bin/env bash
# Print the resolved versions of the dependencies whose drift has broken the suite before, so the
# next drift is visible in the CI log. Usage: scripts/versions.sh (after scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python - <<'PY'
from importlib.metadata import PackageNotFoundError, version
import platform
print(f"python {platform.python_version()}")
for name in ("torch", "pulp", "highspy", "networkx", "numpy", "typer", "rich", "matplotlib", "transformers", "scikit-learn", "torchtitan", "pytest"):
    try:
        print(f"{name} {version(name)}")
    except PackageNotFoundError:
        print(f"{name} (not installed)")
PY
