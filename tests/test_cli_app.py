"""The CLI boundary: usage errors are one line with exit code 2, never a box or a traceback."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from planner.cli import app


@pytest.mark.parametrize(
    "args, expected",
    [
        (["partition"], "Missing argument 'profile'"),
        (["partition", "p.json"], "Missing option '--cluster'"),
        (["no-such-command"], "No such command 'no-such-command'"),
        (["profile", "--no-such-flag"], "No such option: --no-such-flag"),
    ],
)
def test_usage_errors_are_one_line(args: list[str], expected: str) -> None:
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and expected in lines[0]
    assert "--help" in lines[0] and "Traceback" not in result.output


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for name in ("profile", "partition", "show", "check", "diff", "run"):
        assert name in result.output
