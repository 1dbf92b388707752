"""Command-line interface: ``plan profile | partition | show | check | diff | run``.

Each command lives in its own module and registers itself on the shared ``app``.
"""

from planner.cli.app import app

# Importing a module registers its commands on ``app``; one line per command module.
from planner.cli import plan_cmds  # noqa: E402,F401
from planner.cli import profile_cmd  # noqa: E402,F401
from planner.cli import run_cmd  # noqa: E402,F401
from planner.cli import curves_cmd  # noqa: E402,F401
from planner.cli import train_cmd  # noqa: E402,F401

__all__ = ["app", "main"]


def main() -> None:
    app()
