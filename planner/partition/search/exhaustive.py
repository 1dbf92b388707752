"""The exact shape search on small problems: every degree, device grouping, cut and share split, simulated.

The shape search (``hybrid.py``) deals the devices into pipelines in two orders and gives the placer one pipeline
without its all-reduce, so on small clusters it lands within some percent of the best plan, not on it (issue 27).
When the whole space is small, ``exhaustive`` searches all of it instead, in the simulator that ranks every plan:

- every data-parallel degree ``d`` the shape search would try (``hybrid.candidate_degrees``; 1 included);
- every way to choose ``d`` disjoint pipelines of ``s`` devices each, in order, for every stage count ``s`` up to
  ``devices // d`` -- up to symmetry: devices of one *kind* (same host, type, memory and speed factor, and the
  same link to every other device, ``device_kinds``) are interchangeable, so two groupings whose pipelines read the
  same sequences of kinds, replica by replica, simulate alike and only the first is tried;
- every contiguous cut of the blocks into ``s`` stages, every stage on its pipelines' ``i``-th devices;
- every split of the step's micro-batches into ``d`` positive shares;

keeping the fastest plan that passes the feasibility rule (first found on ties). One stage per device: interleaved
and V layouts are the heuristic's to add. So on a small problem the result equals brute force over (degree,
groups, cuts, shares) by construction, and ``tests/test_hybrid.py`` checks it against an independent brute force
on random problems with two device types and two hosts.

Its cost is counted before anything runs: above ``BUDGET`` candidates (or ``MOST_DEVICES`` devices) it declines and
the heuristic stands; it simulates at most ``MOST_SIMULATIONS`` candidates, and says so when it stopped there. It
starts from the heuristic's plan and simulates only candidates whose work bound (``_work_bound``: the pipeline's
fill and drain around its busiest stage's share of the work) is below the best step found so far, so most
candidates cost a few sums. On the bundled models
at op granularity the cuts alone exceed the budget, so it applies to small layer-granularity problems and small
clusters.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Hashable, Sequence

from planner.formats.plan import ASYNC_SCHEDULES, SERVER_SYNCS, ZERO_BUBBLE_SCHEDULES
from planner.partition.model.cost import stage_fwd_bwd_s, step_time_s
from planner.partition.model.feasibility import violations
from planner.partition.model.problem import Partition, Placed, Problem, StageSpec
from planner.partition.search.hybrid import candidate_degrees

__all__ = ["BUDGET", "MOST_DEVICES", "exhaustive", "device_kinds"]

BUDGET = 50_000
"""The most candidates the exact search enumerates (each checked against the work bound, the survivors simulated);
a larger space is left to the heuristic."""
MOST_SIMULATIONS = 2_000
"""The most candidates it simulates: where the work bound prunes little (ranks sharing cores, slow links), it stops
there, keeps the best plan found if it beats the heuristic's, and its record says the search was not complete."""
MOST_DEVICES = 8
"""Clusters above this many devices are left to the heuristic (listing their groupings alone costs too much)."""


def device_kinds(problem: Problem) -> dict[str, Hashable]:
    """Device id -> its kind: devices of one kind can trade places in any plan without changing its simulation.

    Two devices are of one kind when they agree in host, type, memory, speed factor and every other field, and
    each reaches every third device over the same link (pair links included), so that swapping them maps the
    cluster onto itself; the relation is transitive, so the first device of each kind stands for it."""
    cluster = problem.cluster
    kinds: dict[str, Hashable] = {}
    firsts: list[str] = []
    for d in cluster.devices:
        attributes = (d.host, d.type, d.memory_bytes, problem.speed_factors.get(d.id, 1.0),
                      tuple(sorted((k, repr(v)) for k, v in d.extra.items())))
        same = next((f for f in firsts if kinds[f][0] == attributes and all(
            cluster.link(d.id, w.id) == cluster.link(f, w.id) for w in cluster.devices if w.id not in (d.id, f))),
            None)
        if same is None:
            firsts.append(d.id)
            kinds[d.id] = (attributes, d.id)
        else:
            kinds[d.id] = kinds[same]
    return kinds


def exhaustive(problem: Problem, requested: int | None, incumbent_s: float = math.inf
               ) -> tuple[Partition | None, dict[str, Any]] | None:
    """The fastest feasible one-stage-per-device plan of ``problem`` over the whole space (module docstring) that
    simulates strictly faster than ``incumbent_s`` (``None`` in its place when none does), and the search's record;
    ``None`` when the space exceeds ``BUDGET`` (or ``MOST_DEVICES``), or when ``requested`` is 1: a pure pipeline
    is the exact placers' own (the shape search is what this completes). ``requested``: the data-parallel degree
    asked for (``None``: every degree). The record's ``complete`` is false when it stopped at ``MOST_SIMULATIONS``.

    A candidate is simulated only when its work bound (``_work_bound``), which no simulated step undercuts, is below
    the best step so far."""
    devices = problem.cluster.device_ids
    if len(devices) > MOST_DEVICES or problem.sync in SERVER_SYNCS or requested == 1:
        return None
    degrees = ([] if requested is not None else [1]) + candidate_degrees(len(devices), problem.microbatches,
                                                                        requested)
    n, m = len(problem.blocks), problem.microbatches
    kinds = device_kinds(problem)
    spaces: list[tuple[int, int, list[tuple[tuple[str, ...], ...]], list[tuple[int, ...]]]] = []
    total = 0
    for d in degrees:
        splits = list(_compositions(m, d))
        for s in range(1, min(len(devices) // d, n) + 1):
            total += math.perm(len(devices), d * s) // 8  # listing the groupings
            if total > BUDGET:
                return None
            groups = _groupings(devices, kinds, d, s)
            total += len(groups) * math.comb(n - 1, s - 1) * len(splits)
            if total > BUDGET:
                return None
            spaces.append((d, s, groups, splits))
    tables = problem.tables
    best_s, best, simulated = incumbent_s, None, 0
    for d, s, groups, splits in spaces:
        if simulated >= MOST_SIMULATIONS:
            break
        for cuts in itertools.combinations(range(1, n), s - 1):
            if simulated >= MOST_SIMULATIONS:
                break
            bounds = list(zip((0, *cuts), (*cuts, n)))
            for pipelines in groups:
                passes = [[stage_fwd_bwd_s(tables, pipe[i], a, b) for i, (a, b) in enumerate(bounds)]
                          for pipe in pipelines]
                stages = tuple(StageSpec(a, b, pipelines[0][i], tuple(p[i] for p in pipelines) if d > 1 else ())
                               for i, (a, b) in enumerate(bounds))
                for shares in splits:
                    if max(_work_bound(times, share, problem.schedule) for times, share in zip(passes, shares)) \
                            >= best_s * (1 - 1e-12):
                        continue
                    plan: Partition = Placed(stages, shares=shares) if d > 1 else stages
                    if violations(problem, plan):
                        continue
                    simulated += 1
                    step = step_time_s(problem, plan)
                    if step < best_s * (1 - 1e-12):
                        best_s, best = step, (plan, d, s)
    record: dict[str, Any] = {"candidates": total, "simulated": simulated, "complete": simulated < MOST_SIMULATIONS,
                              "space": "every degree, device grouping (up to interchangeable devices), cut and share "
                                       "split, one stage per device"}
    if best is None:
        return None, record
    plan, d, s = best
    return plan, {**record, "step_time_s": best_s, "degree": d, "stages": s}


def _work_bound(passes: Sequence[tuple[float, float]], share: int, schedule: str) -> float:
    """No simulated step of a replica pipeline with these (forward, backward) seconds per micro-batch per stage and
    ``share`` micro-batches is shorter. Under a flushing schedule stage ``i`` cannot start before the first
    micro-batch's forwards reach it and runs ``share`` forwards and backwards; under GPipe, 1F1B and interleaved
    1F1B the step ends only after its last backward's gradient has gone back through the stages before it (a
    zero-bubble stage's last pass may be a weight gradient, which nothing waits for). An asynchronous step (drains
    amortised over a round) is bounded by the busiest stage's work alone. Transfers, per-pass costs and the sync
    only add to it."""
    if schedule in ASYNC_SCHEDULES:
        return share * max(f + b for f, b in passes)
    drains = schedule not in ZERO_BUBBLE_SCHEDULES
    most, forwards, backwards = 0.0, 0.0, 0.0
    for f, b in passes:
        most = max(most, forwards + share * (f + b) + (backwards if drains else 0.0))
        forwards, backwards = forwards + f, backwards + b
    return most


def _groupings(devices: Sequence[str], kinds: dict[str, Hashable], d: int, s: int) -> list[tuple[tuple[str, ...], ...]]:
    """``d`` disjoint pipelines of ``s`` devices, in order, one per class of groupings that differ only by devices of
    one kind trading places (the same sequence of kind sequences); first in enumeration order. The replicas' order
    is kept: shares are given in it, and each stage's all-reduce ring runs through its devices in it."""
    seen: set[tuple[tuple[Hashable, ...], ...]] = set()
    out = []
    for used in itertools.permutations(devices, d * s):
        pipelines = tuple(used[r * s:(r + 1) * s] for r in range(d))
        key = tuple(tuple(kinds[x] for x in p) for p in pipelines)  # replica order matters: shares, the ring's order
        if key not in seen:
            seen.add(key)
            out.append(pipelines)
    return out


def _compositions(m: int, d: int):  # noqa: ANN202 - a generator of share tuples
    """Every split of ``m`` micro-batches into ``d`` positive shares, in order."""
    for cut in itertools.combinations(range(1, m), d - 1):
        bounds = (0, *cut, m)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(d))
