"""Per-rank compute and wait time over a round, and combining every rank's on every rank.

A rank's round splits into *compute* (its stages' forward and backward passes, the emulated
slowdown included, and the last stage's loss) and *wait* (everything else: blocked on point-to-point receives and sends, and
idle in the schedule). Two parts of the wait are broken out for diagnosis: ``post_s``, time spent
posting sends and receives (``schedules._batch_p2p``; on CPU, gloo copies the bytes here, on the
rank's own core), and ``update_s``, the optimizer step with the gradient averaging before it. Compute is timed by wrapping the pipeline stage's ``forward_one_chunk``,
``backward_one_chunk`` and ``backward_weight_one_chunk``; time blocked on communication by wrapping
``torch.distributed.pipelining.schedules._wait_batch_p2p``, the one place the schedules wait on
their batched sends and receives (a private name: if a torch release drops it, ``recv_s`` reads 0
and ``wait_s`` still holds the whole wait). Wait = wall - compute, so nothing is lost between the
two.

On a GPU the host issues kernels ahead of the device, so a host clock around a pass measures the issuing, and
the device's time lands in whatever waits next (a 1-rank run on an H200 logged up to a third of its step as
wait, its optimizer step aside).
``device_clock`` makes every reading of a CUDA rank's clock wait for its device first, so that compute, the
optimizer step, the wait and the round's wall are the device's (``RankTimer``, ``RankRun`` and the asynchronous
engine read it; the parameter server's and the data-parallel syncs' own diagnostics still read the host clock).
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

from planner.partition.search.rebalance import DeviceRound, RoundStats
from planner.runtime.slowdown import Slowdown

__all__ = ["RankTimer", "compute_cpu_clock", "device_clock", "speed_probe", "SpeedProbe", "PROBE_REPEATS",
           "instrument_stage", "instrument_schedule", "timed_p2p", "ROUND_FIELDS", "round_row", "stats_from",
           "stats_from_rows"]

_COMPUTE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def compute_cpu_clock(device: Any) -> Callable[[], float] | None:
    """The clock the profile timed its ops with, where it differs from the wall clock: ``time.thread_time`` on a CPU
    rank that computes on one intra-op thread (``planner.profile.timer``: ``thread_cpu``), else None. Read beside the
    wall clock around each pass, it leaves out the time the rank's core spent on other threads meanwhile: gloo's own
    threads copying the bytes of the sends and receives the schedule posted, which land on whichever stage computes
    while they run (``DeviceRound.compute_cpu_s``)."""
    if getattr(device, "type", "cpu") != "cpu":
        return None
    import torch

    return time.thread_time if torch.get_num_threads() == 1 else None


def device_clock(device: Any) -> Callable[[], float]:
    """``time.perf_counter`` on the CPU; on a CUDA device, the same after the device has finished its queued work."""
    if getattr(device, "type", "cpu") != "cuda":
        return time.perf_counter
    import torch

    def clock() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return clock


PROBE_REPEATS = 9
"""Timed runs of the speed probe per round; the round keeps the fastest."""


@dataclass(frozen=True)
class SpeedProbe:
    """A fixed kernel every rank times at the start of a round (``speed_probe``)."""

    name: str
    operands: Callable[[], tuple[Any, ...]]
    """Builds the kernel's inputs (outside the timing)."""
    kernel: Callable[..., None]
    """Runs once on the operands (timed)."""


def speed_probe(device: Any) -> SpeedProbe:
    """One product of two square matrices, 384 wide on a CPU (1.2-1.4 ms on one core of this machine) and 2048 on a
    GPU, its inputs drawn from a private generator (the training's random stream is not touched) and built afresh each
    round (nothing held between rounds). Every device of one type runs the same work, so its time differs between them
    by their speed alone: what separates a device's speed from the cost model's error on the ops it holds
    (``planner.partition.search.speed``)."""
    import torch

    size = 384 if getattr(device, "type", "cpu") == "cpu" else 2048

    def operands() -> tuple[Any, ...]:
        generator = torch.Generator(device=device).manual_seed(0)
        return tuple(torch.rand(size, size, generator=generator, device=device) for _ in range(2))

    return SpeedProbe(f"matmul-{size}", operands, torch.mm)


class RankTimer:
    """Accumulates compute and blocked time between ``begin_round`` and ``end_round``."""

    def __init__(self, rank: int, device: str, slowdown: Slowdown | None = None,
                 clock: Callable[[], float] = time.perf_counter, cpu_clock: Callable[[], float] | None = None) -> None:
        self.rank, self.device = rank, device
        self.slowdown = slowdown or Slowdown()
        self._clock = clock
        self._cpu_clock = cpu_clock
        """``compute_cpu_clock``: also time each compute interval on the thread's CPU clock (``compute_cpu_s``)."""
        self._depth = 0
        self.probe_s = 0.0
        """The last speed probe's seconds (``probe``), reported with the round that follows it."""
        self.begin_round()

    def begin_round(self) -> None:
        self._start = self._clock()
        self.compute_s = self.compute_cpu_s = self.recv_s = self.emulated_s = self.post_s = self.update_s = 0.0

    def end_round(self) -> DeviceRound:
        """This rank's round, its wait against its own wall time (``stats_from`` measures it against the slowest's)."""
        wall = self._clock() - self._start
        return DeviceRound(self.device, self.compute_s, max(wall - self.compute_s, 0.0), self.recv_s, self.post_s,
                           self.update_s, rank=self.rank, wall_s=wall, emulated_s=self.emulated_s,
                           compute_cpu_s=self.compute_cpu_s, probe_s=self.probe_s)

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Time a compute interval (outermost only) and stretch it by the rank's slowdown."""
        self._depth += 1
        start = self._clock()
        cpu_start = self._cpu_clock() if self._cpu_clock is not None else 0.0
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                real = self._clock() - start
                cpu = self._cpu_clock() - cpu_start if self._cpu_clock is not None else 0.0
                extra = self.slowdown.stretch(real)
                self.compute_s += real + extra
                self.compute_cpu_s += cpu * (real + extra) / real if real > 0 else cpu  # stretched alike
                self.emulated_s += extra

    def probe(self, probe: SpeedProbe, repeats: int = PROBE_REPEATS) -> float:
        """Time ``probe``'s kernel ``repeats`` times back to back (after one untimed run), on the clock the speed fit
        reads (``DeviceRound.fitted_compute_s``), and keep the fastest run in ``probe_s`` (what else runs on the host
        only adds to a run: the fastest is the device's). The runs are one compute interval, stretched by the rank's
        slowdown as a pass is, after the last run: stretched run by run, the slowed rank's waits, which touch its
        training state (``Slowdown.keep_warm``), left each next run a cold cache, and its probe read 2.7-3.9x the other
        rank's for a 3x slowdown. Outside the round's figures: call it before ``begin_round``."""
        operands = probe.operands()
        probe.kernel(*operands)
        times = []
        start = self._clock()
        for _ in range(repeats):
            run_start = self._clock()
            cpu_start = self._cpu_clock() if self._cpu_clock is not None else 0.0
            probe.kernel(*operands)
            times.append(self._cpu_clock() - cpu_start if self._cpu_clock is not None else self._clock() - run_start)
        real = self._clock() - start
        extra = self.slowdown.stretch(real)
        self.probe_s = min(times) * (real + extra) / real if real > 0 else min(times)
        return self.probe_s

    def blocked(self) -> contextlib.AbstractContextManager[None]:
        """Time an interval spent waiting on communication."""
        return self._adding("recv_s")

    def posting(self) -> contextlib.AbstractContextManager[None]:
        """Time an interval spent posting sends and receives."""
        return self._adding("post_s")

    @contextlib.contextmanager
    def _adding(self, field: str) -> Iterator[None]:
        start = self._clock()
        try:
            yield
        finally:
            setattr(self, field, getattr(self, field) + self._clock() - start)

    def add_update(self, seconds: float) -> None:
        """Count ``seconds`` of optimizer step (measured by the training loop)."""
        self.update_s += seconds


def instrument_stage(stage: Any, timer: RankTimer) -> None:
    """Wrap the stage's compute methods so that they run under ``timer.compute()`` (once per stage:
    calling it again, e.g. every round, leaves a stage already timed as it is)."""
    if getattr(stage, "_planner_timed", False):
        return
    for name in _COMPUTE_METHODS:
        method = getattr(stage, name, None)
        if method is not None:
            setattr(stage, name, _timed(method, timer))
    stage._planner_timed = True


def instrument_schedule(schedule: Any, timer: RankTimer) -> None:
    """Count the schedule's loss computation (``_maybe_compute_loss``, private: skipped if a torch release
    drops it) as compute: the cost model charges the default loss to the last stage's passes."""
    method = getattr(schedule, "_maybe_compute_loss", None)
    if method is not None and not getattr(schedule, "_planner_timed", False):
        schedule._maybe_compute_loss = _timed(method, timer)
        schedule._planner_timed = True


def _timed(method: Callable[..., Any], timer: RankTimer) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with timer.compute():
            return method(*args, **kwargs)

    return run


@contextlib.contextmanager
def timed_p2p(timer: RankTimer) -> Iterator[None]:
    """While active, time in the schedules' p2p waits counts as ``timer.recv_s`` and time posting
    them as ``timer.post_s`` (each skipped if a torch release renames its private function)."""
    from torch.distributed.pipelining import schedules

    wrappers = {"_wait_batch_p2p": timer.blocked, "_batch_p2p": timer.posting}
    originals = {name: getattr(schedules, name) for name in wrappers if hasattr(schedules, name)}
    for name, original in originals.items():
        setattr(schedules, name, _wrapped(original, wrappers[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(schedules, name, original)


def _wrapped(original: Callable[..., Any], context: Callable[[], Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        with context():
            return original(*args, **kwargs)

    return call


def stats_from(rounds: list[DeviceRound], *, round_index: int, first_step: int, steps: int) -> RoundStats:
    """Combine every rank's round into ``RoundStats`` (device order = rank order; the round's wall
    time is the slowest rank's, and each rank's wait is measured against that wall)."""
    rounds = sorted(rounds, key=lambda r: r.rank)
    wall = max((r.wall_s for r in rounds), default=0.0)
    devices = tuple(replace(r, wait_s=max(wall - r.compute_s, 0.0)) for r in rounds)
    return RoundStats(round=round_index, first_step=first_step, steps=steps, wall_s=wall, devices=devices)


ROUND_FIELDS = ("compute_s", "wait_s", "recv_s", "post_s", "update_s", "wall_s", "emulated_s", "compute_cpu_s",
                "probe_s")
"""A ``DeviceRound``'s numbers, in the order ``round_row`` packs them (its device and rank are known on every rank)."""


def round_row(mine: DeviceRound) -> tuple[float, ...]:
    """This rank's round as the numbers it adds to the round-end exchange (``worker.exchange_rows``)."""
    return tuple(float(getattr(mine, name)) for name in ROUND_FIELDS)


def stats_from_rows(rows: Sequence[Sequence[float]], devices: Sequence[str], *, round_index: int, first_step: int,
                    steps: int) -> RoundStats:
    """``stats_from`` every rank's ``round_row`` (by rank; ``devices``: each rank's device)."""
    rounds = [DeviceRound(devices[rank], **dict(zip(ROUND_FIELDS, row)), rank=rank) for rank, row in enumerate(rows)]
    return stats_from(rounds, round_index=round_index, first_step=first_step, steps=steps)
