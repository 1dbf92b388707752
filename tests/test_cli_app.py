"""The CLI boundary: usage errors are one line with exit code 2, never a box or a traceback; JSON output whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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


# A process whose stdout is unbuffered (python -u) and whose pipe writes signals interrupt, as ``plan run``'s were.
_INTERRUPTED_WRITER = """
import importlib, signal
signal.signal(signal.SIGALRM, lambda *_: None)
signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
importlib.import_module("planner.cli.app").emit_json({"x": "y" * 300000})
signal.setitimer(signal.ITIMER_REAL, 0)
"""


@pytest.mark.timeout(60)
def test_json_output_reaches_a_slow_reader_whole_under_unbuffered_stdout() -> None:
    """The bug: ``plan run --json`` printed the first 64 KiB of a larger summary, exit code 0, when its reader was
    slower than the pipe filled and ``PYTHONUNBUFFERED`` was set (the text layer dropped a partial write's rest)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_WRITER], stdout=subprocess.PIPE, env=env)
    time.sleep(0.5)  # the pipe (64 KiB) fills, and the writer's timer keeps interrupting it
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == 0
    assert json.loads(out) == {"x": "y" * 300000}
