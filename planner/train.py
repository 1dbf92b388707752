"""``python -m planner.train MODEL --cluster C [options]``: ``plan train`` for ``torchrun`` (same options).

    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:29500 -m planner.train MODEL --cluster cluster.json

Under torchrun every process is one rank: rank 0 profiles and plans, the others take its files through the
launcher's store, and all train in-process. Run directly, it is ``plan train``.
"""

from __future__ import annotations

import sys


def main() -> None:
    from planner.cli import app

    app(["train", *sys.argv[1:]], prog_name="python -m planner.train")


if __name__ == "__main__":
    main()
