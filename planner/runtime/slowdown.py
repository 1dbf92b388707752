"""``--emulate-slowdown RANK=FACTOR``: make one rank compute FACTOR times slower, to test rebalancing.

Time-varying patterns (the parameter-server modes, which exist to react to change): ``RANK=FACTOR@START`` slows
the rank from its step ``START`` on (a node that slows down mid-run), and ``RANK=FACTOR@START/EVERY`` slows it
in bursts: ``EVERY`` steps slow, ``EVERY`` steps at full speed, and so on from ``START`` (``SlowdownPattern``).

A testing aid, off by default. Identical CPUs (or GPUs) cannot show heterogeneity, so the chosen
rank waits ``(FACTOR - 1)`` times each compute interval it has just measured, right after it: its
forward and backward passes take FACTOR times as long, and everything downstream waits for it as it
would for a slower device. It waits in slices of ``WARM_EVERY_S``, between which ``keep_warm`` touches the
rank's training state, so that its memory stays in use as a slower device's would (``Slowdown``).

How it waits (``Slowdown.busy``): where the host has a core for every rank it runs, busy, holding its core
as a slower device computing would; otherwise asleep, so that it does not take the cores of the ranks it
shares them with. A sleeping rank frees its core for the stretch, and on a host whose cores are shared with
other jobs the fast rank then computes faster whenever the slow one sleeps, so the slowdown the rebalancer saw
was more than FACTOR. Busy, the slowed rank's compute over the other's, the stretch taken out, stays level across
factors (docs/rebalancing.md; *static compute ratio* in docs/bench-run.md).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

from planner.errors import UsageError

if TYPE_CHECKING:  # the options' checks import this module before torch is needed
    import torch

__all__ = ["parse_slowdowns", "parse_slowdown_patterns", "SlowdownPattern", "Slowdown", "touch_pages"]


@dataclass(frozen=True)
class SlowdownPattern:
    """One rank's slowdown over its steps: ``factor`` from step ``start`` on; with ``every`` > 0 in bursts of
    ``every`` slow steps and ``every`` full-speed ones."""

    factor: float
    start: int = 0
    every: int = 0

    @property
    def constant(self) -> bool:
        return self.start == 0 and self.every == 0

    def factor_at(self, step: int) -> float:
        if step < self.start:
            return 1.0
        if self.every and ((step - self.start) // self.every) % 2 == 1:
            return 1.0
        return self.factor

    def text(self) -> str:
        return f"{self.factor:g}" + (f"@{self.start}" if self.start or self.every else "") + \
            (f"/{self.every}" if self.every else "")


def parse_slowdown_patterns(specs: Sequence[str] | str | None, world_size: int | None = None) -> dict[int, SlowdownPattern]:
    """``["1=2.0", "2=3@100/20"]`` or ``"1=2.0,2=3@100"`` -> rank -> pattern; a rank given twice is an error."""
    if not specs:
        return {}
    items = [specs] if isinstance(specs, str) else list(specs)
    out: dict[int, SlowdownPattern] = {}
    for item in (part.strip() for spec in items for part in spec.split(",")):
        if not item:
            continue
        rank_text, sep, rest = item.partition("=")
        factor_text, at, when = rest.partition("@")
        start_text, slash, every_text = when.partition("/")
        try:
            rank, factor = int(rank_text), float(factor_text)
            start = int(start_text) if at else 0
            every = int(every_text) if slash else 0
        except ValueError:
            rank, factor, start, every = -1, math.nan, 0, 0
        if not sep or rank < 0 or not (factor >= 1.0 and math.isfinite(factor)) or start < 0 or every < 0 \
                or (slash and every < 1):
            raise UsageError(f"--emulate-slowdown expects RANK=FACTOR[@START[/EVERY]] with a rank >= 0, a factor >= 1 "
                             f"and steps >= 0 (e.g. 1=2.0, or 1=3@100 from step 100, or 1=3@0/20 in bursts of 20 "
                             f"steps), found {item!r}")
        if world_size is not None and rank >= world_size:
            raise UsageError(f"--emulate-slowdown names rank {rank}, but the job has {world_size} ranks "
                             f"(0..{world_size - 1}); pick one of those")
        if rank in out:
            raise UsageError(f"--emulate-slowdown gives rank {rank} twice; give each rank once")
        out[rank] = SlowdownPattern(factor, start, every)
    return out


def parse_slowdowns(specs: Sequence[str] | str | None, world_size: int | None = None) -> dict[int, float]:
    """``["1=2.0", "3=1.5"]`` or ``"1=2.0,3=1.5"`` -> ``{1: 2.0, 3: 1.5}``: constant factors, what the pipeline
    runtime emulates; a time-varying pattern is refused in one line (``parse_slowdown_patterns`` reads those)."""
    patterns = parse_slowdown_patterns(specs, world_size)
    varying = [f"{rank}={p.text()}" for rank, p in patterns.items() if not p.constant]
    if varying:
        raise UsageError(f"--emulate-slowdown {varying[0]} varies over the run, which the parameter-server sync modes "
                         f"(bsp, asp, ssp, dasp) emulate; this plan runs a pipeline, so pass a constant RANK=FACTOR")
    return {rank: p.factor for rank, p in patterns.items()}


WARM_EVERY_S = 0.005
"""How often a slowed rank re-touches its memory while it waits out its stretch (``Slowdown.keep_warm``)."""


class Slowdown:
    """Stretch measured compute intervals by ``factor`` (1 = no effect).

    ``keep_warm``: called every ``WARM_EVERY_S`` while the stretch is waited out (the rank's training state read once
    per memory page). A slower device keeps computing, so its memory stays in use; a rank that sleeps leaves it
    untouched, and on a host that reclaims idle guest memory the next pass then pays to touch it again
    (docs/bench-machine.md measures it), which made the emulated rank slower than ``factor``."""

    def __init__(self, factor: float = 1.0, sleep: Callable[[float], None] = time.sleep,
                 keep_warm: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 busy: bool = False) -> None:
        if not (factor >= 1.0 and math.isfinite(factor)):
            raise UsageError(f"a slowdown factor must be a finite number >= 1, found {factor!r}")
        self.factor = factor
        self._sleep = sleep
        self.keep_warm = keep_warm
        self._clock = clock
        self.busy = busy
        """Wait the stretch out holding the core (a slower device computing) instead of asleep (module docstring)."""

    @classmethod
    def for_rank(cls, slowdowns: Mapping[int, float], rank: int) -> "Slowdown":
        return cls(slowdowns.get(rank, 1.0))

    def extra_s(self, compute_s: float) -> float:
        """How long to sleep after ``compute_s`` of real compute."""
        return (self.factor - 1.0) * max(compute_s, 0.0)

    def stretch(self, compute_s: float) -> float:
        """Wait the extra time now (touching the rank's memory meanwhile, when ``keep_warm`` is set); return it."""
        extra = self.extra_s(compute_s)
        if extra <= 0:
            return extra
        if self.keep_warm is None and not self.busy:
            self._sleep(extra)
            return extra
        end = self._clock() + extra
        while True:
            if self.keep_warm is not None:
                self.keep_warm()
            left = end - self._clock()
            if left <= 0:
                return extra
            if self.busy:
                until = self._clock() + min(WARM_EVERY_S, left)
                while self._clock() < until:
                    pass
            else:
                self._sleep(min(WARM_EVERY_S, left))


def touch_pages(tensors: Iterable["torch.Tensor"]) -> None:
    """Read one element per 4 KiB page of every contiguous tensor of a page or more: brings its memory back into use
    for a fraction of the cost of reading it whole (smaller tensors cost a call each and hold few pages)."""
    import torch

    with torch.no_grad():
        for t in tensors:
            if t.is_contiguous() and t.numel() * t.element_size() >= 4096 and t.device.type == "cpu":
                t.view(-1)[::max(4096 // t.element_size(), 1)].sum()
