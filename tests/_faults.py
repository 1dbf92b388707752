"""Fault injection for the runtime tests, as a ``RunConfig.plugins`` entry (``tests._faults:hooks``).

Environment variables, each ``RANK:STEP``:
- ``PLANNER_TEST_KILL_AT_STEP``: RANK calls ``os._exit(1)`` at the first round end at or after STEP, once (a
  marker file in the checkpoint directory stops it repeating after torchrun restarts the job);
- ``PLANNER_TEST_HANG_AT_STEP``: RANK stops answering there (it sleeps), so the others must end with a
  clear error instead of hanging;
- ``PLANNER_TEST_HANG_BEFORE_STEP``: the same mid-round, after a round's first step (a round's start is a
  boundary too: the speed probe's barrier), so that its neighbours block inside the next step's transfers (the
  process group's timeout ends those);
- ``PLANNER_TEST_RAISE_AT_STEP``: RANK raises a ``RuntimeError`` (not a ``PlannerError``: a crash) at the first
  round end at or after STEP, and its neighbours' next transfers fail on the closed connection.
Set ``PLANNER_TEST_STALE_BUFFERS=1`` and the tensors torch's pipelining makes from metadata start with what reused
memory may hold (integers far out of any table's range), as they can once a run has used its memory.
Plugins run before the built-in hooks, so a kill at a round end comes before that round's checkpoint.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from planner.runtime.launch.config import RoundEnd, RunConfig, RunHooks


def hooks(config: RunConfig) -> RunHooks:
    if os.environ.get("PLANNER_TEST_STALE_BUFFERS"):
        _stale_buffers()
    return _Faults(config)


def _stale_buffers() -> None:
    import torch
    from torch.distributed.pipelining import _utils

    made = _utils._make_tensor_from_meta

    def stale(meta, device):  # type: ignore[no-untyped-def]
        tensor = made(meta, device)
        if not (tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool):
            tensor.fill_(1 << 30)
        return tensor

    _utils._make_tensor_from_meta = stale


class _Faults(RunHooks):
    def __init__(self, config: RunConfig) -> None:
        self.checkpoint_dir = config.options.get("checkpoint_dir")

    def after_step(self, run, index: int, steps: int) -> None:  # type: ignore[no-untyped-def]
        if index == 0 and steps > 1:
            _hang(run.rank, run.step, "PLANNER_TEST_HANG_BEFORE_STEP")

    def on_round(self, run, stats: RoundEnd) -> None:  # type: ignore[no-untyped-def]
        kill = _rank_step(os.environ.get("PLANNER_TEST_KILL_AT_STEP"))
        if kill and kill[0] == run.rank and run.step >= kill[1]:
            marker = Path(self.checkpoint_dir or ".") / f".killed-rank{run.rank}-step{kill[1]}"
            if not marker.exists():
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(str(run.step))
                os._exit(1)
        _hang(run.rank, run.step, "PLANNER_TEST_HANG_AT_STEP")
        crash = _rank_step(os.environ.get("PLANNER_TEST_RAISE_AT_STEP"))
        if crash and crash[0] == run.rank and run.step >= crash[1]:
            raise RuntimeError(f"injected fault on rank {run.rank} at step {run.step}")


def _hang(rank: int, step: int, variable: str) -> None:
    hang = _rank_step(os.environ.get(variable))
    if hang and hang[0] == rank and step >= hang[1]:
        time.sleep(3600)


def _rank_step(value: str | None) -> tuple[int, int] | None:
    if not value:
        return None
    rank, _, step = value.partition(":")
    return int(rank), int(step)
