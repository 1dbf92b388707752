"""``--emulate-slowdown RANK=FACTOR``: make one rank compute FACTOR times slower, to test rebalancing.

A testing aid, off by default. Identical CPUs (or GPUs) cannot show heterogeneity, so the chosen
rank sleeps ``(FACTOR - 1)`` times each compute interval it has just measured, right after it: its
forward and backward passes take FACTOR times as long, and everything downstream waits for it as it
would for a slower device. Sleeping holds no core, so the emulation does not slow the other ranks
sharing the machine (a busy-loop would).
"""

from __future__ import annotations

import math
import time
from typing import Callable, Mapping, Sequence

from planner.errors import UsageError

__all__ = ["parse_slowdowns", "Slowdown"]


def parse_slowdowns(specs: Sequence[str] | str | None, world_size: int | None = None) -> dict[int, float]:
    """``["1=2.0", "3=1.5"]`` or ``"1=2.0,3=1.5"`` -> ``{1: 2.0, 3: 1.5}``; a rank given twice is an error."""
    if not specs:
        return {}
    items = [specs] if isinstance(specs, str) else list(specs)
    out: dict[int, float] = {}
    for item in (part.strip() for spec in items for part in spec.split(",")):
        if not item:
            continue
        rank_text, sep, factor_text = item.partition("=")
        try:
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            rank, factor = -1, math.nan
        if not sep or rank < 0 or not (factor >= 1.0 and math.isfinite(factor)):
            raise UsageError(f"--emulate-slowdown expects RANK=FACTOR with a rank >= 0 and a factor >= 1 "
                             f"(e.g. 1=2.0), found {item!r}")
        if world_size is not None and rank >= world_size:
            raise UsageError(f"--emulate-slowdown names rank {rank}, but the job has {world_size} ranks "
                             f"(0..{world_size - 1}); pick one of those")
        if rank in out:
            raise UsageError(f"--emulate-slowdown gives rank {rank} twice; give each rank once")
        out[rank] = factor
    return out


class Slowdown:
    """Stretch measured compute intervals by ``factor`` (1 = no effect)."""

    def __init__(self, factor: float = 1.0, sleep: Callable[[float], None] = time.sleep) -> None:
        if not (factor >= 1.0 and math.isfinite(factor)):
            raise UsageError(f"a slowdown factor must be a finite number >= 1, found {factor!r}")
        self.factor = factor
        self._sleep = sleep

    @classmethod
    def for_rank(cls, slowdowns: Mapping[int, float], rank: int) -> "Slowdown":
        return cls(slowdowns.get(rank, 1.0))

    def extra_s(self, compute_s: float) -> float:
        """How long to sleep after ``compute_s`` of real compute."""
        return (self.factor - 1.0) * max(compute_s, 0.0)

    def stretch(self, compute_s: float) -> float:
        """Sleep the extra time now; return it."""
        extra = self.extra_s(compute_s)
        if extra > 0:
            self._sleep(extra)
        return extra
