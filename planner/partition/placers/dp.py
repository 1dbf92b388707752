"""``--method dp``: an exact dynamic program over contiguous block splits and device classes.

It minimises the shared objective ``sum_k L_k + (m - 1) * max_k L_k`` (``planner.partition.model.objective``)
over every split of the blocks into contiguous stages and every choice of device per stage, subject to
memory under the schedule; on one replica pipeline of a hybrid plan each stage also adds its sync tail ``E_k``
to the sum (not to the latency a bound limits), so the cuts are chosen with the all-reduce in view.

- For a *fixed* bound ``T`` on every stage latency, minimising ``sum_k L_k`` is a shortest path over
  cut points (PipeDream, Narayanan et al., SOSP 2019; Alpa's stage DP, Zheng et al., OSDI 2022). On a
  mixed cluster the state also counts how many devices of each class the stages from here to the end
  use (Metis, Um et al., USENIX ATC 2024, search over device-type counts), so it stays polynomial in
  the blocks and in the devices per class; identical devices are the one-class case. The count also
  gives each stage its number of stages-to-end, which the 1F1B memory rule needs.
- ``max_k L_k`` is handled as Alpa does, by enumerating ``T`` over the candidate stage latencies, but
  without Alpa's approximation: walking ``T`` down, each DP answer with largest latency ``M`` also answers
  every ``T`` in ``[M, T]``; and since every plan under ``T`` sums to at least the answer's sum ``S``, a plan
  can beat the best objective ``V`` only if its largest latency is below ``(V - S) / (m - 1)``. So the next
  ``T`` to try is the largest candidate below both, and the walk stops when nothing fits under ``T``. Bounds
  a little above a lower bound on ``T`` are probed first, in growing steps, until a plan fits: it gives the
  walk its first ``V`` (on many micro-batches the optimum's largest latency sits just above the least bound
  that fits). The walk then starts below ``(V - S_0) / (m - 1)``, ``S_0`` a lower bound on any plan's sum
  (every block on its fastest class), not at the loosest bound, whose DP is the costliest. The result is
  exact: gpt2_small on mixed-3type-2host at m = 8 solves 19 bounds instead of 76 for the same plan, and
  ``tests/test_differential.py`` checks the walk against the walk that skips nothing.

Complexity per ``T``: O(B^2 * C^2 * prod_c (n_c + 1)) for B blocks and C classes of n_c devices,
vectorised over the count states, classes and stops with numpy (``_BoundedDP``).
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


class _BoundedDP:
    """The DP under one latency bound, solved for many bounds over the same tables.

    What does not depend on the bound is laid out once, in the order the DP reads it. The table of answers is
    kept per state ``u'`` of the stages after a cut, and a stage on class ``c`` before them makes the state
    ``u' + unit(c)``: so every class adds its stage to the same slice of the table (a broadcast, not a gather per
    class), the least over (next class, stop) is taken along the last, contiguous axis, and only the (class,
    state) answers are mapped back to ``u``. On 300-op models the count of numpy calls per start, not their
    arithmetic, is most of what a bound costs."""

    def __init__(self, lat: StageLatencies, space: _Space, nblocks: int, limit: int) -> None:
        self.lat, self.space, self.nblocks = lat, space, nblocks
        self.mid = np.ascontiguousarray(lat.mid.transpose(2, 0, 1, 3))  # (start, class, next class, stop)
        most = int(space.total.max())
        self.room = np.ascontiguousarray(np.minimum(lat.room, most + 1).transpose(1, 0, 2))  # (start, class, stop)
        # a stage that fits before ``r`` stages to the end (itself included) and ``limit`` at most (the feasibility
        # rule's stage count): ``penalty[u', r]`` is inf when ``u'`` after it makes too many; the pad state too
        after = np.append(space.total, most + 1)[:, None] + 1
        self.penalty = np.where((after > np.arange(most + 2)[None, :]) | (after > limit), np.inf, 0.0)
        # a replica pipeline's sync tails: in the sum a stage adds, never in the latency the bound limits
        self.tail = None if lat.tail is None else np.ascontiguousarray(lat.tail.transpose(1, 0, 2))  # start, cls, stop

    def solve(self, bound: float) -> tuple[float, list[tuple[int, int, int]]] | None:
        """Least ``sum_k L_k`` with every ``L_k <= bound`` and at most ``limit`` stages: (sum, stages as
        (start, stop, class)) or None."""
        lat, space, nblocks = self.lat, self.space, self.nblocks
        ncls, size = lat.last.shape[0], space.size
        best = np.full((size + 1, ncls, nblocks + 1), np.inf)  # best[u, d, e]: from block e on, on class d; u = size: pad
        choice = np.full((nblocks, ncls, size), -1, dtype=np.int64)  # the pick (``_next``) that won; -1: the last stage
        rows = np.full((nblocks, ncls, size), np.inf)  # rows[b]: the best from b on, first as the last stage
        fit_c, fit_b = np.nonzero(lat.last[:, :nblocks] <= bound)
        rows[fit_b, fit_c, np.asarray(space.unit)[fit_c]] = lat.last[fit_c, fit_b] + (
            0.0 if self.tail is None else self.tail[fit_b, fit_c, nblocks])
        stops = np.arange(nblocks + 1)
        reach = np.where((self.mid <= bound).any(axis=(1, 2)), stops[None, :], -1).max(axis=1)  # last stop per start
        spans = reach - stops
        for b in range(nblocks - 1, -1, -1):
            row, span = rows[b], int(spans[b])
            if span > 0:
                # every class at once while the candidates stay few; one class at a time otherwise (the same sums)
                whole = ncls * ncls * span * (size + 1) <= _CANDIDATES
                for cs in (slice(None),) if whole else [slice(c, c + 1) for c in range(ncls)]:
                    value, pick = self._next(best, b, span, cs, bound)
                    better = value < row[cs]  # ties to the last stage
                    row[cs] = np.where(better, value, row[cs])
                    choice[b, cs] = np.where(better, pick, -1)
            best[:size, :, b] = row.T
        flat = best[:size, :, 0].T
        if not np.isfinite(flat).any():
            return None
        c, u = np.unravel_index(int(np.argmin(flat)), flat.shape)
        total = float(flat[c, u])
        stages, b = [], 0
        while b < nblocks:
            pick = int(choice[b, c, u])
            e, d = (nblocks, -1) if pick < 0 else (b + 1 + pick % int(spans[b]), pick // int(spans[b]))
            stages.append((b, e, int(c)))
            u, b, c = int(space.minus[c][u]), e, d
        return total, stages

    def _next(self, best: np.ndarray, b: int, span: int, cs: slice, bound: float) -> tuple[np.ndarray, np.ndarray]:
        """For a middle stage from block ``b`` on each class of ``cs``, per state ``u`` (its stage included): the
        least sum over every (next class, stop) within ``span`` stops, and its pick (``next class * span + stop - b
        - 1``: ties to the lower class, then the earlier stop)."""
        stops = slice(b + 1, b + 1 + span)
        mids = self.mid[b, cs, :, stops]  # (class, next class, stop)
        sums = mids if self.tail is None else mids + self.tail[b, cs, None, stops]
        cand = best[None, :, :, stops] + np.where(mids > bound, np.inf, sums)[:, None]  # (class, u', next class, stop)
        cand += self.penalty[:, self.room[b, cs, stops]].transpose(1, 0, 2)[:, :, None, :]
        flat = cand.reshape(cand.shape[0], cand.shape[1], -1)
        pick = flat.argmin(axis=2)
        classes, after = np.arange(flat.shape[0])[:, None], self.space.minus[cs]  # u -> u' (the pad: no class-c device)
        pick = pick[classes, after]
        return flat[classes, after, pick], pick


_CANDIDATES = 1 << 22
"""Most candidate sums (classes x next classes x stops x states) one vectorised step of the DP builds."""


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
    bounded, tried = _BoundedDP(lat, space, nblocks, limit), 0

    def solve(index: int) -> tuple[float, float, list[tuple[int, int, int]]] | None:
        """(sum, largest latency, stages) of the least sum under the ``index``-th candidate bound, or None."""
        nonlocal tried
        tried += 1
        answer = bounded.solve(ordered[index])
        return None if answer is None else (answer[0], max(_stage_latencies(lat, answer[1])), answer[1])

    if m == 1 or not ordered:  # the objective is the sum alone: the least sum under the loosest bound
        top = solve(len(ordered) - 1) if ordered else None
        if top is None:
            raise InfeasibleError(no_fit_message(problem, "dp"))
        return top[0], top[2], tried
    least, first = _first_incumbent(solve, ordered, _latency_floor(tab, nblocks), m)
    if first is None:
        raise InfeasibleError(no_fit_message(problem, "dp"))
    # the walk starts from a floor on any plan's sum, below the bounds that cannot beat the first plan (not at the
    # loosest bound, whose DP costs most)
    best, total, largest = first, _sum_floor(tab, nblocks), math.inf
    while True:
        # every plan under this bound sums to at least ``total``, so one whose largest latency is ``x`` or more
        # costs at least ``total + (m - 1) x``: only a largest latency below ``cutoff`` can beat the best
        cutoff = (best[0] - total) / (m - 1) * (1 + 1e-12)
        below = bisect.bisect_left(ordered, min(largest, cutoff)) - 1  # the largest candidate below both
        if below < least:
            return best[0], best[1], tried
        answer = solve(below)
        if answer is None:  # below the least bound under which anything fits
            return best[0], best[1], tried
        total, largest, stages = answer
        if total + (m - 1) * largest < best[0]:
            best = (total + (m - 1) * largest, stages)


def _first_incumbent(solve: Callable[[int], tuple[float, float, list[tuple[int, int, int]]] | None],
                     ordered: list[float], floor: float, m: int
                     ) -> tuple[int, tuple[float, list[tuple[int, int, int]]] | None]:
    """The walk's first incumbent: the bounds ``floor (1 + 2^k / 50)``, k = 0, 1, .., are solved until a plan fits
    under one (on many micro-batches the optimum's largest latency sits just above the least bound that fits, so
    its plan is close), so that the walk's cut-off skips straight to the bounds that can win (gpt2_small over
    mixed-3type-2host, m = 8: 76 bounds solved without it). Returns the index of the least candidate that may fit
    (those below a probe that found nothing cannot) and the plan met (None: nothing fits under any bound)."""
    low, step, jump = bisect.bisect_left(ordered, floor), 1.0 / 50, 0
    while low < len(ordered):  # ``jump`` (0, 1, 3, 7, ..) keeps the probes few where the floor is 0 or tiny
        index = min(max(bisect.bisect_left(ordered, floor * (1 + step)), low + jump), len(ordered) - 1)
        answer = solve(index)
        if answer is not None:
            return low, (answer[0] + (m - 1) * answer[1], answer[2])
        low, step, jump = index + 1, step * 2, 2 * jump + 1
    return low, None


def _sum_floor(tab: ClassTables, nblocks: int) -> float:
    """A lower bound on the latency sum of any plan: every block on its fastest class, one stage's passes, no cut."""
    return float(_fastest_blocks(tab, nblocks).sum() + tab.pass_pair_s) * (1 - _ROUNDING)


_ROUNDING = 1e-9
"""Taken off the floors: a sum of per-block times and the prefix-sum difference a stage's latency is computed as
differ in the last bits, so a floor could otherwise pass the one plan that meets it (a whole model on one device)."""


def _fastest_blocks(tab: ClassTables, nblocks: int) -> np.ndarray:
    """Each block's compute on its fastest class."""
    return np.diagonal(tab.compute_s[:, :nblocks + 1, :nblocks + 1], offset=1, axis1=1, axis2=2).min(axis=0) \
        if tab.compute_s.shape[0] else np.zeros(nblocks)


def _latency_floor(tab: ClassTables, nblocks: int) -> float:
    """A lower bound on the largest stage latency of any plan: no stage is faster than its fastest class."""
    single = _fastest_blocks(tab, nblocks)
    devices = sum(tab.counts)
    return float(max(single.max(initial=0.0), single.sum() / devices)) * (1 - _ROUNDING)


def dp_placer(problem: Problem, *, weights: Mapping[str, float] | None = None, **options: Any) -> Partition:
    """The registered ``dp`` method (weights are the greedy placer's; the DP optimises actual speeds)."""
    if options:
        raise PlannerError(f"the dp method takes no options, found {', '.join(sorted(options))}")
    result = solve_dp(problem)
    return Placed(result.partition, {"solver": {"name": "dp", "result": "optimal", "objective_s": result.objective_s,
                                                "bounds_tried": result.bounds_tried}})


