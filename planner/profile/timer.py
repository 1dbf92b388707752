"""Timing of short calls: median over repeats after warm-up, with the timer's own overhead removed.

On CUDA each call is bracketed by a pair of CUDA events with a synchronisation after each repeat
(written for GPUs but not exercised on the CPU-only machine this was developed on). On CPU the
clock is ``time.thread_time`` (CPU time of the calling thread, user + system) when PyTorch runs
single-threaded, because all the work then happens on the calling thread and a thread-CPU clock does
not count the time other processes hold the core (a shared machine otherwise inflates long calls
more than short ones); with several intra-op threads it is wall time (``time.perf_counter``). The
overhead is the median time of an empty call, measured the same way, and is subtracted from every
median (clamped at zero).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import sys
import time
from typing import Any, Callable

import torch

Setup = Callable[[], Any]
Body = Callable[[Any], Any]


class Timer:
    """Times ``body(setup())``: ``setup`` runs outside the timed region before every repeat."""

    def __init__(self, device: torch.device, repeats: int, warmup: int, clock: str | None = None) -> None:
        if repeats < 1 or warmup < 0:
            raise ValueError(f"repeats must be >= 1 and warmup >= 0, found {repeats} and {warmup}")
        self.device = device
        self.clock = clock or default_clock(device)
        self._now = time.thread_time if self.clock == "thread_cpu" else time.perf_counter
        self.repeats = repeats
        self.warmup = warmup
        self.overhead_s = 0.0
        self.overhead_s = self._median(lambda: None, lambda _: None, max(repeats, 50), 5)

    def time(self, body: Body, setup: Setup = lambda: None) -> float:
        """Median seconds of ``body`` minus the empty-call overhead (never negative)."""
        return max(0.0, self._median(setup, body, self.repeats, self.warmup) - self.overhead_s)

    def time_turns(self, calls: list[tuple[Body, Setup]], rounds: int) -> list[float]:
        """Median seconds of each ``(body, setup)`` less the overhead, the calls taking turns: ``warmup`` rounds,
        then ``rounds`` timed ones, each running every call once. Figures compared with each other (a difference
        of two long calls) then share the machine's drift instead of taking it apart."""
        for _ in range(self.warmup):
            for body, setup in calls:
                body(setup())
        samples = [[self._once(setup, body) for body, setup in calls] for _ in range(rounds)]
        return [max(0.0, statistics.median(column) - self.overhead_s) for column in zip(*samples)]

    def _median(self, setup: Setup, body: Body, repeats: int, warmup: int) -> float:
        for _ in range(warmup):
            body(setup())
        samples = [self._once(setup, body) for _ in range(repeats)]
        return statistics.median(samples)

    def _once(self, setup: Setup, body: Body) -> float:
        state = setup()
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            body(state)
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1e3
        begin = self._now()
        body(state)
        return self._now() - begin


def default_clock(device: torch.device) -> str:
    """``cuda_events`` on GPUs; ``thread_cpu`` on a single-threaded CPU; ``wall`` otherwise."""
    if device.type == "cuda":
        return "cuda_events"
    return "thread_cpu" if torch.get_num_threads() == 1 else "wall"


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h


def steady_cpu_allocator() -> str:
    """Make glibc malloc keep and reuse freed memory (no mmap'd chunks, no trimming), as PyTorch's
    CUDA caching allocator does on a GPU; returns a label for the profile.

    By default glibc serves large blocks with fresh ``mmap`` pages and returns them on ``free``, so
    every allocation of a large activation page-faults anew. Whether that happens depends on glibc's
    adaptive thresholds and on what else is alive, which made per-op and whole-model times disagree
    by up to 45% for the same model. Steady-state training reuses its memory, so we measure that.
    The setting lasts for the rest of the process; elsewhere than Linux/glibc nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return "default"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    except (OSError, AttributeError):
        return "default"
    return "glibc: no mmap, no trim" if ok else "default"
