"""Import first in every bench script: the repository first on ``sys.path``, this folder last.

Python puts a script's own folder first on ``sys.path``, and this folder holds ``profile.py``, named
like the standard library's ``profile`` module (imported by cProfile, hence by torch's profiler and
torch._dynamo): ``import profile`` must find the standard library. The folder stays reachable at the
end, so scripts can import each other (``from suite import ...``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
sys.path.insert(0, str(REPO))
sys.path.append(str(BENCH))


def slug(name: str) -> str:
    """A row's or setting's name as part of a file name: its words joined by ``-`` (``4x + 3x halfway`` ->
    ``4x-3x-halfway``, ``1f1b (own plan)`` -> ``1f1b-own-plan``)."""
    return "-".join(re.findall(r"[A-Za-z0-9.]+", name))
