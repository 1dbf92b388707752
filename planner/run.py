"""``python -m planner.run PLAN MODEL [options]``: ``plan run`` for ``torchrun`` (same options).

    torchrun --nproc-per-node 2 -m planner.run plan.json planner.examples.gpt:gpt_small --steps 20

Under torchrun every process is one rank and trains in-process; run directly, it launches the ranks
itself like ``plan run``.
"""

from __future__ import annotations

import sys


def main() -> None:
    from planner.cli import app

    app(["run", *sys.argv[1:]], prog_name="python -m planner.run")


if __name__ == "__main__":
    main()
