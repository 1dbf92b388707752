"""Run ``plan`` inside this pytest process, as a subprocess would, so that every job's ranks fork from one warm server.

A ``plan run`` started in a fresh interpreter spends about 10 s of a core before a rank trains: the launcher imports
torch and the runtime, then its fork server (``planner.runtime.launch.elastic.START_METHOD``) imports them again. The
multi-process tests start about fifty such jobs, one after another. Run here instead, the launcher is this pytest
worker, whose fork server starts with the first job and serves every later one; a 2-rank job of 3 steps then takes
about 1.5 s instead of 13. Ranks adopt the launcher's environment and working directory at ``launch``, so a job sees
what it would see as a subprocess (``env`` and ``cwd`` below).

What only a real process shows stays with ``subprocess``: torchrun, a Ctrl-C to the process group, the exit status
of the ``plan`` executable, and a rank's own output (it goes to the fork server's streams, not to the result).
"""

from __future__ import annotations

import contextlib
import subprocess
import traceback
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def plan(*args: Any, cwd: Path | str | None = None, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    """``plan ARGS...`` in this process: exit status, stdout and stderr as ``subprocess.run`` returns them.

    ``env`` is laid over this process's environment for the call (one intra-op thread per process by default, as
    the subprocess tests set); an exception that escapes the command is written to stderr as its traceback, as
    the interpreter would print it.
    """
    from planner.cli import app

    words = [str(a) for a in args]
    with contextlib.chdir(cwd or ROOT):
        result = CliRunner().invoke(app, words, env={"OMP_NUM_THREADS": "1", **(env or {})}, catch_exceptions=True)
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        stderr += "".join(traceback.format_exception(result.exception))
    return subprocess.CompletedProcess(["plan", *words], result.exit_code, result.stdout, stderr)
