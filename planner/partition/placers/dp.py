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
  ``M`` also answers every ``T`` in ``[M, T]``, so the next ``T`` to try is the largest candidate below
  ``M``. The walk stops when no plan fits under ``T`` or when the best sum found so far plus
  ``(m - 1)`` times a lower bound on ``T`` cannot beat the best step time. The result is exact.

Complexity per ``T``: O(B^2 * C^2 * prod_c (n_c + 1)) for B blocks and C classes of n_c devices,
vectorised over the count states with numpy.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Collection, Mapping

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
    ncls = lat.last.shape[0]
    inf_col = np.full((nblocks + 1, ncls, 1), np.inf)
    best = np.concatenate([np.full((nblocks + 1, ncls, space.size), np.inf), inf_col], axis=2)
    choice_e = np.full((nblocks, ncls, space.size), -1, dtype=np.int64)
    choice_d = np.full((nblocks, ncls, space.size), -1, dtype=np.int64)
    for b in range(nblocks - 1, -1, -1):
        for c in range(ncls):
            row = np.full(space.size, np.inf)
            if lat.last[c, b] <= bound:
                row[space.unit[c]] = lat.last[c, b]
                choice_e[b, c, space.unit[c]] = nblocks
            for d in range(ncls):
                stops = np.nonzero(lat.mid[c, d, b, b + 1:nblocks] <= bound)[0] + b + 1
                if stops.size == 0:
                    continue
                cand = best[stops, d][:, space.minus[c]] + lat.mid[c, d, b, stops][:, None]
                cand = np.where(space.total[None, :] > lat.room[c, b, stops][:, None], np.inf, cand)
                pick = np.argmin(cand, axis=0)
                value = cand[pick, np.arange(space.size)]
                better = value < row
                row = np.where(better, value, row)
                choice_e[b, c] = np.where(better, stops[pick], choice_e[b, c])
                choice_d[b, c] = np.where(better, d, choice_d[b, c])
            best[b, c, :space.size] = np.where(too_many, np.inf, row)
    flat = best[0, :, :space.size]
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
    candidates = np.unique(np.concatenate([lat.mid[np.isfinite(lat.mid)], lat.last[np.isfinite(lat.last)]]))
    floor, ordered = _latency_floor(tab, nblocks), candidates.tolist()
    best: tuple[float, list[tuple[int, int, int]]] | None = None
    bound, tried = float(candidates[-1]) if candidates.size else np.inf, 0
    while candidates.size:
        answer = _solve_bounded(lat, space, nblocks, bound, limit)
        tried += 1
        if answer is None:
            break
        total, stages = answer
        largest = max(_stage_latencies(lat, stages))
        value = total + (m - 1) * largest
        if best is None or value < best[0]:
            best = (value, stages)
        below = bisect.bisect_left(ordered, largest) - 1  # the largest candidate below this plan's maximum
        if below < 0 or total + (m - 1) * max(floor, float(candidates[0])) >= best[0]:
            break
        bound = float(candidates[below])
    if best is None:
        raise InfeasibleError(no_fit_message(problem, "dp"))
    return best[0], best[1], tried


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


