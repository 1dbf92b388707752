"""The parameter server's decisions as pure functions (docs/sync.md): which workers may go on (``ssp``), how an
asynchronous update is scaled, and seed 002's rule that moves workers between the synchronous group and
asynchronous participation (``dasp``).

Plain data in and out: no torch, no clock, so the rule is tested on recorded traces.

**dasp's rule.** The server keeps, per worker, its state (``sync`` or ``async``), an exponential moving average
of its iteration time (the compute the worker reports with each push: its speed, without the time it waited
for the server), and the staleness of its applied updates. After every round it compares each worker's
average with the fastest worker's:

- a ``sync`` worker slower than ``slow_factor`` times the fastest for ``patience`` rounds in a row leaves the
  group: the group would otherwise wait for it every step;
- an ``async`` worker within ``rejoin_factor`` times the fastest for ``patience`` rounds in a row rejoins: its
  updates would otherwise arrive stale for no gain.

``rejoin_factor < slow_factor`` is the hysteresis that keeps a worker near the threshold from flapping. The
fastest worker is always within both factors of itself, so the group is never empty; with equal speeds no
worker ever leaves, and dasp runs exactly as bsp.

How it relates to its neighbours (docs/sync.md): DSSP (Zhao et al., ICDCS 2019) keeps one stale-synchronous
group and moves its staleness threshold between a lower and an upper bound from the workers' iteration
intervals; ADSP (Hu et al., AAAI 2020) lets no worker wait and instead tunes each worker's commit rate. dasp
moves workers, not a threshold: similar workers wait for each other (no stale gradients among them), a
straggler neither blocks them nor is blocked, and its updates are scaled down by their staleness
(``async_scale``, after Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from planner.errors import UsageError

__all__ = ["SYNC", "ASYNC", "ASYNC_UPDATES", "DaspRule", "WorkerState", "next_states", "may_proceed", "async_scale"]

SYNC = "sync"
ASYNC = "async"


ASYNC_UPDATES = ("fold", "apply")
"""dasp: an asynchronous gradient folded into the synchronous group's next update (the default), so the straggler's
samples widen a combined step instead of making a small stale one, or an update of its own on arrival (Zhang et
al.'s staleness-aware ASGD) (docs/sync.md)."""


@dataclass(frozen=True)
class DaspRule:
    """dasp's knobs (``plan run --dasp-*``; docs/sync.md lists them with their defaults)."""

    slow_factor: float = 1.5
    """A synchronous worker slower than this many times the fastest leaves the group."""
    rejoin_factor: float = 1.2
    """An asynchronous worker within this many times the fastest rejoins."""
    patience: int = 2
    """Rounds in a row a condition must hold before the state changes."""
    smoothing: float = 0.5
    """Weight of the newest round in the iteration-time average (1: the last round alone)."""
    async_update: str = "fold"
    """How an asynchronous worker's gradient enters the model: ``fold``, into the group's next combined update,
    weighted by its share x ``async_scale``; ``apply``, an update of its own on arrival (learning rate x
    ``async_scale``) (``ASYNC_UPDATES``). ``fold`` is the default because on the text model, where staleness hurts,
    ``apply`` left one seed in three on the loss plateau with a 2x straggler (docs/sync.md)."""

    def __post_init__(self) -> None:
        if self.async_update not in ASYNC_UPDATES:
            raise UsageError(f"--dasp-async-update must be one of {', '.join(ASYNC_UPDATES)}, found "
                             f"{self.async_update!r}")
        if not 1.0 <= self.rejoin_factor <= self.slow_factor:
            raise UsageError(f"dasp needs 1 <= rejoin factor <= slow factor, found {self.rejoin_factor} and "
                             f"{self.slow_factor}; pass for example --dasp-slow-factor 1.5 --dasp-rejoin-factor 1.2")
        if self.patience < 1:
            raise UsageError(f"--dasp-patience must be at least 1 round, found {self.patience}")
        if not 0.0 < self.smoothing <= 1.0:
            raise UsageError(f"dasp's smoothing must be in (0, 1], found {self.smoothing}")


@dataclass(frozen=True)
class WorkerState:
    """What the server knows about one worker between rounds."""

    state: str = SYNC
    iteration_s: float | None = None
    """The moving average of its iteration time (``None`` until it reported one)."""
    streak: int = 0
    """Rounds in a row the condition for changing its state has held."""


def next_states(states: Sequence[WorkerState], measured_s: Sequence[float | None],
                rule: DaspRule = DaspRule()) -> tuple[WorkerState, ...]:
    """The workers' states after a round in which worker ``w`` measured ``measured_s[w]`` seconds per iteration
    (``None``: it finished no iteration this round; its average stays)."""
    averaged = []
    for old, new in zip(states, measured_s):
        if new is None:
            averaged.append(old.iteration_s)
        elif old.iteration_s is None:
            averaged.append(new)
        else:
            averaged.append(rule.smoothing * new + (1.0 - rule.smoothing) * old.iteration_s)
    known = [t for t in averaged if t is not None]
    fastest = min(known) if known else None
    out = []
    for old, avg in zip(states, averaged):
        if fastest is None or avg is None:
            out.append(replace(old, iteration_s=avg, streak=0))
            continue
        ratio = avg / fastest if fastest > 0 else 1.0
        wants_change = ratio > rule.slow_factor if old.state == SYNC else ratio <= rule.rejoin_factor
        streak = old.streak + 1 if wants_change else 0
        if streak >= rule.patience:
            out.append(WorkerState(ASYNC if old.state == SYNC else SYNC, avg, 0))
        else:
            out.append(WorkerState(old.state, avg, streak))
    return tuple(out)


def may_proceed(clock: int, clocks: Sequence[int], staleness: int) -> bool:
    """ssp (Ho et al., NeurIPS 2013): a worker that has pushed ``clock`` updates may compute its next one only while
    it is at most ``staleness`` updates ahead of the slowest worker (``clocks``: every worker's pushes)."""
    return clock - min(clocks) <= staleness


def async_scale(staleness: int) -> float:
    """The learning-rate factor of an asynchronous update computed ``staleness`` global updates ago: ``1 /
    staleness`` (1 when fresh), the staleness-aware rule of Zhang et al. (IJCAI 2016)."""
    return 1.0 / max(1, staleness)
