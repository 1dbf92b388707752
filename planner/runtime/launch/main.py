"""A rank's entry point: the built-in hooks (rebalancing, checkpoints) plus plugins around ``run_rank``.

``rank_main`` is what ``plan run`` calls under torchrun; ``elastic_main`` is the entry point of torch's
elastic launcher (``planner.runtime.launch.elastic``), which turns a ``PlannerError`` into a value and notes any
other error for the launcher (``worker.note_failure``).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from planner.errors import PlannerError
from planner.runtime.launch.config import RunConfig, load_plugins
from planner.runtime.launch.worker import note_failure, run_rank
from planner.runtime.rebalancing.hooks import make_hooks

__all__ = ["rank_main", "elastic_main", "INTERRUPTED_EXIT"]

INTERRUPTED_EXIT = 130
"""A rank's exit code when interrupted (the shell's code for SIGINT)."""

_IMPORT_ENV = dict(os.environ)
"""The environment when this module was imported: in a rank forked from the launcher's fork server
(``elastic.START_METHOD``), the server's, so what differs from it now is what torch's agent set for this rank."""


def rank_main(config: RunConfig) -> dict[str, Any]:
    """Train this rank with the plugins first, then the rebalancing and checkpoint hooks."""
    return run_rank(config, [*load_plugins(config), make_hooks(config)])


def _adopt_environment(launcher: dict[str, str]) -> None:
    """Run under the launcher's environment as it was at ``launch`` (a forked rank holds the fork server's, which
    may be older), keeping what torch's agent set for this rank (rank, world size, rendezvous)."""
    agent = {k: v for k, v in os.environ.items() if _IMPORT_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update({**launcher, **agent})
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # torch sized its pool from the server's environment at import
        torch.set_num_threads(int(threads))


@record
def elastic_main(config: dict[str, Any], environment: dict[str, str] | None = None) -> dict[str, Any]:
    """Entry point for ``torch.distributed.launcher.api.elastic_launch``: errors come back as values.

    A ``PlannerError`` (bad plan, mismatch) is returned as ``{"error": ..., "exit_code": ...}`` so the
    launcher can print one line; anything else propagates and the launcher reports the failed rank.
    ``environment``: the launcher's, which the rank adopts (``_adopt_environment``).
    """
    if environment is not None:
        _adopt_environment(environment)
    # A terminal's Ctrl-C goes to the whole process group: a rank leaves at once and quietly (no traceback
    # from the middle of a collective; checkpoints are sealed last, so one half-written is ignored), and
    # the launcher says what can resume.
    signal.signal(signal.SIGINT, lambda *_: os._exit(INTERRUPTED_EXIT))
    try:
        return rank_main(RunConfig(**config))
    except PlannerError as exc:
        return {"rank": int(os.environ.get("RANK", 0)), "error": str(exc), "exit_code": exc.exit_code,
                "kind": type(exc).__name__}
    except Exception as exc:  # one that ``run_rank`` did not note (it notes before tearing its group down)
        note_failure(exc)
        raise
