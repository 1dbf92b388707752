"""``--method dp``: an exact dynamic program over contiguous block splits and device classes.

It minimises the shared objective ``sum_k L_k + (m - 1) * max_k L_k`` (``planner.partition.model.objective``)
over every split of the blocks into contiguous stages and every choice of device per stage, subject to
memory under the schedule.

- For a *fixed* bound ``T`` on every stage latency, minimising ``sum_k L_k`` is a shortest path over
  cut points (PipeDream, Narayanan et al., SOSP 2019; Alpa's stage DP, Zheng et al., OSDI 2022). On a
  mixed cluster the state also counts how many devices of each class the stages from here to the end
  use (Metis, Um et al., USENIX ATC 2024, search over device-type counts), so it stays polynomial in
  the blocks and in the devices per class; identical devices are the one-class case. The count also
  gives each stage its number of stages-to-end, which the 1F1B memory rule needs.
- ``max_k L_k`` is handled as Alpa does, by enumerating ``T`` over the candidate stage latencies, but
  without Alpa's approximation: walking ``T`` down from the top, each DP answer with largest latency
  ``M`` also answers every ``T`` in ``[M, T]``; and since every plan under ``T`` sums to at least the
  answer's sum ``S``, a plan can beat the best objective ``V`` only if its largest latency is below
  ``(V - S) / (m - 1)``. So the next ``T`` to try is the largest candidate below both, and the walk stops
  when nothing fits under ``T``. Bounds a little above a lower bound on ``T`` are probed first, in growing
  steps, until a plan fits: it gives the walk its first ``V`` (on many micro-batches the optimum's largest
  latency sits just above the least bound that fits), so the cut-off skips from the top straight to the
  bounds that can win. The result is exact: gpt2_small on mixed-3type-2host at m = 8 solves 20 bounds instead
  of 76 for the same plan, and ``tests/test_differential.py`` checks the walk against the walk that skips
  nothing.

Complexity per ``T``: O(B^2 * C^2 * prod_c (n_c + 1)) for B blocks and C classes of n_c devices,
vectorised over the count states with numpy.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import numpy as np

from planner.errors import InfeasibleError, PlannerError
from planner.partition.model.feasibility import max_stages, no_fit_message
from planner.partition.model.problem import Placed
from planner.partition.model.objective import (
    ClassTables,
    StageLatencies,
    assign_devices,
    class_tables,
    stage_latencies,
    step_time_formula_s,
)
from planner.partition.model.problem import Partition, Problem

__all__ = ["DPResult", "solve_dp", "walk_bounds", "state_count", "check_state_space", "dp_placer", "MAX_STATES"]

MAX_STATES = 1 << 16
"""Largest number of class-count states the DP accepts (``prod_c (n_c + 1)`` times the classes)."""


@dataclass(frozen=True)
class DPResult:
    partition: Partition
    objective_s: float
    """The shared objective of ``partition`` (``step_time_formula_s``)."""
    bounds_tried: int
    """How many latency bounds ``T`` the walk solved a DP for."""


@dataclass(frozen=True)
class _Space:
    """The class-count states: mixed-radix indices of ``U`` (devices used per class, suffix of stages)."""

    counts: tuple[int, ...]
    size: int
    total: np.ndarray
    """Per state: the number of stages (sum of its counts)."""
    minus: np.ndarray
    """``minus[c][u]``: the state ``u`` less one device of class ``c`` (``size``, an always-inf column, if none)."""
    unit: tuple[int, ...]
    """``unit[c]``: the state with one device of class ``c``."""


def _space(counts: tuple[int, ...]) -> _Space:
    strides, size = [], 1
    for n in counts:
        strides.append(size)
        size *= n + 1
    digits = np.array([[(u // s) % (n + 1) for s, n in zip(strides, counts)] for u in range(size)],
                      dtype=np.int64).reshape(size, len(counts))
    idx = np.arange(size)
    minus = np.stack([np.where(digits[:, c] > 0, idx - strides[c], size) for c in range(len(counts))])
    return _Space(counts, size, digits.sum(axis=1), minus, tuple(strides))


def _solve_bounded(lat: StageLatencies, space: _Space, nblocks: int, bound: float, limit: int
                   ) -> tuple[float, list[tuple[int, int, int]]] | None:
    """Least ``sum_k L_k`` with every ``L_k <= bound`` and at most ``limit`` stages: (sum, stages as
    (start, stop, class)) or None."""
    too_many = space.total > limit
    ncls, size = lat.last.shape[0], space.size
    best = np.full((nblocks + 1, ncls, size + 1), np.inf)  # best[e, d, u]: from block e on, on class d, counts u
    choice_e = np.full((nblocks, ncls, size), -1, dtype=np.int64)
    choice_d = np.full((nblocks, ncls, size), -1, dtype=np.int64)
    columns = np.arange(size)
    for b in range(nblocks - 1, -1, -1):
        for c in range(ncls):
            row = np.full(size, np.inf)
            if lat.last[c, b] <= bound:
                row[space.unit[c]] = lat.last[c, b]
                choice_e[b, c, space.unit[c]] = nblocks
            within = lat.mid[c, :, b, b + 1:nblocks] <= bound  # (next class, stop - b - 1)
            reach = np.nonzero(within.any(axis=0))[0]
            if reach.size:  # every (next class, stop) at once; ties to the last stage, then the lower class and stop
                span = int(reach[-1]) + 1
                stops = slice(b + 1, b + 1 + span)
                mids = np.where(within[:, :span], lat.mid[c, :, b, stops], np.inf)
                full = np.where(space.total[None, :] > lat.room[c, b, stops][:, None], np.inf, 0.0)
                after = best[stops][:, :, space.minus[c]].transpose(1, 0, 2)  # the next stages use one class-c less
                cand = (after + mids[:, :, None] + full[None]).reshape(-1, size)
                pick = np.argmin(cand, axis=0)
                value = cand[pick, columns]
                better = value < row
                row = np.where(better, value, row)
                choice_e[b, c] = np.where(better, b + 1 + pick % span, choice_e[b, c])
                choice_d[b, c] = np.where(better, pick // span, choice_d[b, c])
            best[b, c, :size] = np.where(too_many, np.inf, row)
    flat = best[0, :, :size]
    if not np.isfinite(flat).any():
        return None
    c, u = np.unravel_index(int(np.argmin(flat)), flat.shape)
    total = float(flat[c, u])
    stages, b = [], 0
    while b < nblocks:
        e, d = int(choice_e[b, c, u]), int(choice_d[b, c, u])
        stages.append((b, e, int(c)))
        u, b, c = int(space.minus[c][u]), e, d
    return total, stages


def _stage_latencies(lat: StageLatencies, stages: list[tuple[int, int, int]]) -> list[float]:
    out = []
    for k, (b, e, c) in enumerate(stages):
        out.append(float(lat.mid[c, stages[k + 1][2], b, e]) if k + 1 < len(stages) else float(lat.last[c, b]))
    return out


def solve_dp(problem: Problem, *, segments: Collection[tuple[int, int]] | None = None) -> DPResult:
    """Exact minimum of the shared objective; ``segments`` (``(start, stop)`` pairs) limits the stages allowed.

    Raises ``InfeasibleError`` when no split fits in memory, ``PlannerError`` when the class-count state
    space exceeds ``MAX_STATES`` (many devices with per-pair links; use ``--method ilp``).
    """
    tab = class_tables(problem)
    check_state_space(tab)
    lat = stage_latencies(tab, len(problem.blocks), segments)
    value, stages, tried = walk_bounds(problem, tab, lat, len(problem.blocks))
    partition = assign_devices(tab.classes, stages)
    return DPResult(partition, step_time_formula_s(problem, partition), tried)


def state_count(counts: tuple[int, ...]) -> int:
    """How many class-count states the DP tracks for classes of ``counts`` devices: ``C * prod_c (n_c + 1)``."""
    size = 1
    for n in counts:
        size *= n + 1
    return size * len(counts)


def check_state_space(tab: ClassTables) -> None:
    """Raise ``PlannerError`` (before allocating anything) when the state space exceeds ``MAX_STATES``."""
    states = state_count(tab.counts)
    if states > MAX_STATES:
        raise PlannerError(f"the dp method would track {states} device-count states for "
                           f"{len(tab.classes)} device classes (limit {MAX_STATES}); use --method ilp")


def walk_bounds(problem: Problem, tab: ClassTables, lat: StageLatencies, nblocks: int
                ) -> tuple[float, list[tuple[int, int, int]], int]:
    """The exact walk over latency bounds on prebuilt tables: (objective, stages as (start, stop, class), bounds tried).

    ``nblocks`` is the tables' block count (``mapping`` calls it with one "block" per fixed stage).
    Raises ``PlannerError`` when the class-count state space exceeds ``MAX_STATES``, ``InfeasibleError``
    when nothing fits.
    """
    check_state_space(tab)
    space = _space(tab.counts)
    m = problem.microbatches
    limit = max_stages(problem.schedule, m, sum(tab.counts))  # the feasibility rule's stage count
    ordered = np.unique(np.concatenate([lat.mid[np.isfinite(lat.mid)], lat.last[np.isfinite(lat.last)]])).tolist()
    tried = 0

    def solve(index: int) -> tuple[float, float, list[tuple[int, int, int]]] | None:
        """(sum, largest latency, stages) of the least sum under the ``index``-th candidate bound, or None."""
        nonlocal tried
        tried += 1
        answer = _solve_bounded(lat, space, nblocks, ordered[index], limit)
        return None if answer is None else (answer[0], max(_stage_latencies(lat, answer[1])), answer[1])

    top = solve(len(ordered) - 1) if ordered else None
    if top is None:
        raise InfeasibleError(no_fit_message(problem, "dp"))
    least, best = _first_incumbent(solve, ordered, _latency_floor(tab, nblocks), top, m)
    answer = top
    while True:
        total, largest, stages = answer
        if total + (m - 1) * largest < best[0]:
            best = (total + (m - 1) * largest, stages)
        # every plan under this bound sums to at least ``total``, so one whose largest latency is ``x`` or more
        # costs at least ``total + (m - 1) x``: only a largest latency below ``cutoff`` can beat the best
        cutoff = (best[0] - total) / (m - 1) * (1 + 1e-12) if m > 1 else -math.inf
        below = bisect.bisect_left(ordered, min(largest, cutoff)) - 1  # the largest candidate below both
        if below < least:
            return best[0], best[1], tried
        answer = solve(below)
        if answer is None:  # below the least bound under which anything fits
            return best[0], best[1], tried


def _first_incumbent(solve: Callable[[int], tuple[float, float, list[tuple[int, int, int]]] | None],
                     ordered: list[float], floor: float, top: tuple[float, float, list[tuple[int, int, int]]], m: int
                     ) -> tuple[int, tuple[float, list[tuple[int, int, int]]]]:
    """The walk's first incumbent: the bounds ``floor (1 + 2^k / 50)``, k = 0, 1, .., are solved until a plan fits
    under one (on many micro-batches the optimum's largest latency sits just above the least bound that fits, so
    its plan is close), so that the walk's cut-off skips from the top straight to the bounds that can win (gpt2_small
    over mixed-3type-2host, m = 8: 76 bounds solved without it). Returns the index of the least candidate that may
    fit (those below a probe that found nothing cannot) and the best plan met."""
    best, low, step, jump = (top[0] + (m - 1) * top[1], top[2]), bisect.bisect_left(ordered, floor), 1.0 / 50, 0
    while low < len(ordered) - 1:  # ``jump`` (0, 1, 3, 7, ..) keeps the probes few where the floor is 0 or tiny
        index = min(max(bisect.bisect_left(ordered, floor * (1 + step)), low + jump), len(ordered) - 2)
        answer = solve(index)
        if answer is not None:
            value = answer[0] + (m - 1) * answer[1]
            return low, ((value, answer[2]) if value < best[0] else best)
        low, step, jump = index + 1, step * 2, 2 * jump + 1
    return low, best


def _latency_floor(tab: ClassTables, nblocks: int) -> float:
    """A lower bound on the largest stage latency of any plan: no stage is faster than its fastest class."""
    single = np.array([tab.compute_s[:, b, b + 1].min() for b in range(nblocks)])
    devices = sum(tab.counts)
    return float(max(single.max(initial=0.0), single.sum() / devices))


def dp_placer(problem: Problem, *, weights: Mapping[str, float] | None = None, **options: Any) -> Partition:
    """The registered ``dp`` method (weights are the greedy placer's; the DP optimises actual speeds)."""
    if options:
        raise PlannerError(f"the dp method takes no options, found {', '.join(sorted(options))}")
    result = solve_dp(problem)
    return Placed(result.partition, {"solver": {"name": "dp", "result": "optimal", "objective_s": result.objective_s,
                                                "bounds_tried": result.bounds_tried}})


