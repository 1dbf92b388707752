"""A profiled and partitioned digits MLP on ``cpu-2`` (2 stages, 2 micro-batches): the small real-data plan
several tests train or export."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from planner.cli import app


def digits_plan(directory: Path) -> Path:
    """``profile.json`` and ``plan.json`` of ``planner.examples.digits:digits_mlp`` in ``directory``; the plan."""
    runner = CliRunner()
    for args in (["profile", "planner.examples.digits:digits_mlp", "-o", str(directory / "profile.json"),
                  "--repeats", "1", "--warmup", "0"],
                 ["partition", str(directory / "profile.json"), "--cluster", "cpu-2", "-m", "uniform", "-d", "1", "-n", "2",
                  "-o", str(directory / "plan.json")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
    return directory / "plan.json"
