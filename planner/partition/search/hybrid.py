"""The shape of a plan: how many replica pipelines (the data-parallel degree d), over which devices.

For each candidate degree ``d`` (``--data-parallel auto``: every d from 2 to the device count with at least one
micro-batch per replica, on clusters above 16 devices only those that divide the device count; ``--data-parallel
N``: only N), the devices are dealt into ``d`` pipelines of ``k = devices // d`` devices in two ways, from two
orders (the cluster file's, and ``host_speed_order``: by host, the fastest first; the pipelines already tried are
skipped; on clusters above 16 devices only the second, which keeps 64 devices of 3 types under 10 s), and the cost
model keeps whichever is faster:

- ``pipeline-local``: pipeline ``r`` takes devices ``r k .. r k + k - 1`` (consecutive devices, usually one
  host, carry one pipeline: fast point-to-point links, slower syncs);
- ``stage-local``: stage slot ``i`` takes devices ``i d .. i d + d - 1`` (consecutive devices replicate one
  stage: fast syncs, pipeline transfers across hosts).

The placer then splits the model for one pipeline -- a sub-problem on that pipeline's devices with its
share of the micro-batches -- once per distinct kind of pipeline (by device types), and every replica runs
the same cuts on its own devices (a stage has one node list). Under ``interleaved-1f1b``, ``zbv``, ``dualpipev`` and
``zb-planned`` the replicas may also run that pipeline's several-chunks-per-device version (round-robin, or in a V),
when it simulates faster for one replica; both go on to the whole simulation. The shares of the step's micro-batches are
even, or proportional to each pipeline's throughput (its slowest stage per micro-batch; 3:1 when one
pipeline is three times faster), whichever the simulator finds faster. Every candidate is simulated whole
(``cost.evaluate``: replica pipelines, then the stages' all-reduce) and must pass the feasibility rule; the
fastest wins, the pure pipeline (d = 1) included, ties going to fewer replicas. The candidates and their
simulated step times are recorded in the plan under ``shape``.

On clusters of up to 16 devices in several device classes (type, host, memory, speed, links), the groupings by
class counts are searched too (``search/groups.py``, Metis's idea): every way to give the ``d`` pipelines their
devices by how many of each class each takes, screened with the greedy placer alone (placed once per sequence of
classes), the fastest ``CLASS_GROUPINGS_KEPT`` over every degree then placed and simulated like the dealings
(``grouping: class-counts``).

The finalists then see the sync (``_finished``): the fastest replicated candidate of each degree and layout within
``FINALIST_WINDOW`` of the fastest, and the fastest of each layout placed again with its replicas' all-reduce in the
placer's view (``_sub_problem(sync_in_view=True)``, ``Problem.replica_sync``), each with its cuts polished whole
(``finish``: ``partition``'s ``polish.polish_cuts``, every replica pipeline and each stage's all-reduce simulated);
the fastest result wins. What this search is not: the placer does not see the sync while it screens the groupings
(the finalists do); the class-count groupings reach the placer only through the greedy screen, and which device of a
class goes where follows ``host_speed_order`` (docs/placers.md, "Hybrid shapes"); on small problems
``exhaustive.py`` searches every grouping for dp and ilp.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from planner.errors import InfeasibleError, PlannerError, UsageError
from planner.formats.plan import GENERATED_ORDER_SCHEDULES
from planner.partition.model.cost import replica_sync_rates, stage_compute_s, step_time_s
from planner.partition.model.feasibility import violations
from planner.partition.model.objective import device_classes
from planner.partition.model.problem import (Partition, Placed, Problem, StageSpec, degree_of, even_shares,
                                             facts_of, host_speed_order, replica_of, with_facts)
from planner.partition.search.groups import (GROUPINGS, PlaceFn, class_groupings, per_class_sequence,
                                              pipelines_of, screened_first)
from planner.partition.search.interleave import chunked, interleave

__all__ = ["parse_degree", "candidate_degrees", "proportional_shares", "hybrid_search"]


def parse_degree(value: str | int) -> int | None:
    """``--data-parallel``: ``auto`` (``None``) or a positive degree."""
    if isinstance(value, int) or str(value).isdigit():
        degree = int(value)
        if degree >= 1:
            return degree
    elif str(value) == "auto":
        return None
    raise UsageError(f"--data-parallel must be 'auto' or a positive whole number, found {value!r}")


EVERY_DEGREE_UP_TO = 16
"""Clusters of at most this many devices try every degree; larger ones only the degrees that divide their device
count (so every device has a pipeline): on 64 devices of 3 types the same plan as every degree, 5x sooner
(docs/bench-scale.md)."""


def candidate_degrees(num_devices: int, microbatches: int, requested: int | None) -> list[int]:
    """Degrees above 1 to try: ``requested`` alone, else every d with a device and a micro-batch per replica (on
    clusters above ``EVERY_DEGREE_UP_TO`` devices, only those d that divide the device count)."""
    if requested is not None:
        if requested > num_devices:
            raise InfeasibleError(f"--data-parallel {requested} needs at least {requested} devices, the cluster has "
                                  f"{num_devices}; pass a degree up to {num_devices}, or auto")
        if requested > microbatches:
            raise InfeasibleError(f"--data-parallel {requested} needs at least one micro-batch per replica, the step "
                                  f"has {microbatches}; pass --microbatches {requested} or more, or a smaller degree")
        return [requested] if requested > 1 else []
    return [d for d in range(2, min(num_devices, microbatches) + 1)
            if num_devices <= EVERY_DEGREE_UP_TO or num_devices % d == 0]


def proportional_shares(speeds: Sequence[float], microbatches: int, least: int) -> tuple[int, ...] | None:
    """``microbatches`` split in proportion to ``speeds`` (largest remainders, ties to the first), each share at
    least ``least``; ``None`` when the step has too few micro-batches for that."""
    d = len(speeds)
    if microbatches < least * d:
        return None
    total = sum(speeds)
    spare = microbatches - least * d
    exact = [spare * s / total for s in speeds]
    shares = [least + int(x) for x in exact]
    order = sorted(range(d), key=lambda r: (-(exact[r] - int(exact[r])), r))
    for r in order[:microbatches - sum(shares)]:
        shares[r] += 1
    return tuple(shares)


def hybrid_search(problem: Problem, place: PlaceFn, weights: Mapping[str, float], requested: int | None,
                  pure: Partition | None, class_counts: bool = True,
                  finish: Callable[[Partition], Partition] | None = None,
                  place_in_view: PlaceFn | None = None) -> Partition:
    """The fastest feasible shape (see the module docstring); ``pure`` is the degree-1 plan (``None``: it did not
    fit, or ``--data-parallel`` asked for replicas); ``class_counts=False`` leaves out the groupings by class counts.
    ``finish`` (the whole plan's cut polish) turns the replicated finalists (``_finished``) into their final plans,
    never slower, and ``place_in_view`` places the fastest of each layout again with its all-reduce in view; the
    fastest finished plan, or the pure pipeline, wins. On clusters above ``EVERY_DEGREE_UP_TO`` devices neither runs.
    Raises ``InfeasibleError`` when no candidate fits."""
    devices = list(problem.cluster.device_ids)
    tried: list[dict[str, Any]] = []
    best: tuple[float, int, Partition] | None = None
    if pure is not None:
        pure_s = step_time_s(problem, pure)
        tried.append({"degree": 1, "grouping": None, "stages": len(pure), "step_time_s": pure_s})
        best = (pure_s, 0, pure)
    orders = {"host-speed": host_speed_order(problem)}  # large clusters: one order, as they try fewer degrees
    if len(devices) <= EVERY_DEGREE_UP_TO:
        orders = {"file": devices, **orders}
    classes = device_classes(problem) if len(devices) <= EVERY_DEGREE_UP_TO else ()  # beyond: two dealings only
    place = per_class_sequence(place, classes)  # groupings share pipelines of the same classes
    counted: list[tuple[dict[str, Any], list[list[str]]]] = []
    for degree in candidate_degrees(len(devices), problem.microbatches, requested):
        seen: set[tuple[tuple[str, ...], ...]] = set()
        dealt = [({"degree": degree, "grouping": grouping, **({"order": order} if order != "file" else {})},
                  pipelines_of(listed, degree, grouping)) for order, listed in orders.items() for grouping in GROUPINGS]
        if class_counts:
            counted += class_groupings(problem, weights, classes, degree, dealt, _best_for)
        for record, pipelines in dealt:
            key = tuple(sorted(tuple(p) for p in pipelines))
            if key not in seen:
                seen.add(key)
                best = _try(problem, place, weights, record, pipelines, tried, best)
    for record, pipelines in screened_first(counted):
        best = _try(problem, place, weights, record, pipelines, tried, best)
    if len(devices) > EVERY_DEGREE_UP_TO:  # 64 devices of 3 types: 0.25% faster for 100 s (docs/placers.md)
        finish = place_in_view = None
    best = _finished(problem, finish, place_in_view, weights, tried, best)
    if best is None:
        asked = f"--data-parallel {requested}" if requested is not None else "any data-parallel degree"
        raise InfeasibleError(f"no shape with {asked} fits on the {len(devices)} devices of {problem.cluster.name!r} "
                              f"({len(tried)} tried: every replica pipeline holds the whole model on "
                              f"{len(devices) // max(requested or 1, 1)} device(s)); use fewer replicas (--data-parallel "
                              f"auto or a smaller degree), devices with more memory, or fewer micro-batches in flight")
    step, index, chosen = best
    shape = {"data_parallel": "auto" if requested is None else requested, "chosen": tried[index],
             "candidates": tried}
    return with_facts(chosen, {"shape": shape})


FINALIST_WINDOW = 0.10
"""The fastest replicated candidate of each degree and layout is finished (its cuts polished whole) when it is within
this fraction of the fastest: on the bundled models a degree's candidate 2-5% behind became the fastest plan
(docs/placers.md, "Cuts that see the all-reduce")."""


def _finished(problem: Problem, finish: Callable[[Partition], Partition] | None,
              place_in_view: PlaceFn | None, weights: Mapping[str, float], tried: list[dict[str, Any]],
              best: tuple[float, int, Partition] | None) -> tuple[float, int, Partition] | None:
    """The fastest of the pure pipeline and the finished replicated finalists: the fastest candidate of each degree
    and layout (by chunks per device) within ``FINALIST_WINDOW`` of the fastest, and the fastest of each layout
    placed again by ``place_in_view`` with its replicas' all-reduce in the placer's view (``_sub_problem``). Ties
    go to the earlier candidate, then to the plan placed without the sync. ``best`` without ``finish``. Takes the
    candidates' plans off their records, and marks the chosen record's ``sync_in_view``."""
    finalists: dict[tuple[int, int], tuple[float, int, Partition]] = {}
    grouping: dict[int, list[list[str]]] = {}
    for index, record in enumerate(tried):
        grouping[index] = record.pop("_pipelines", [])
        for chunks, (step, plan) in sorted(record.pop("_plans", {}).items()):
            key = (record["degree"], chunks)
            if key not in finalists or step < finalists[key][0] * (1 - 1e-9):
                finalists[key] = (step, index, plan)
    if finish is None:
        return best
    scored: list[tuple[float, int, int, Partition]] = []
    near = min((step for step, _, _ in finalists.values()), default=math.inf) * (1 + FINALIST_WINDOW)
    fastest: dict[int, tuple[float, int]] = {}
    for (_, chunks), (step, index, plan) in sorted(finalists.items()):
        if step <= near:
            scored.append((step_time_s(problem, done := finish(plan)), index, 0, done))
        if chunks not in fastest or step < fastest[chunks][0] * (1 - 1e-9):
            fastest[chunks] = (step, index)
    for chunks, (_, index) in sorted(fastest.items()) if place_in_view is not None else ():
        aware = _layouts_for(problem, place_in_view, weights, grouping[index], sync_in_view=True).get(chunks)
        if aware is not None:
            scored.append((step_time_s(problem, done := finish(aware[1])), index, 1, done))
    pure = [(best[0], best[1], 0, best[2])] if best is not None and degree_of(best[2]) == 1 else []
    if not pure + scored:
        return best
    step, index, aware_won, chosen = min(pure + scored, key=lambda x: x[:3])
    if degree_of(chosen) > 1:
        tried[index]["sync_in_view"] = bool(aware_won)
    return step, index, chosen


def _try(problem: Problem, place: PlaceFn, weights: Mapping[str, float], record: dict[str, Any],
         pipelines: list[list[str]], tried: list[dict[str, Any]], best: tuple[float, int, Partition] | None
         ) -> tuple[float, int, Partition] | None:
    """Places and simulates one grouping (``_layouts_for``), appends its ``record`` to ``tried`` (with the fastest
    plan of each layout under ``_plans``, for ``_finished``); the new best."""
    layouts = _layouts_for(problem, place, weights, pipelines)
    if not layouts:
        record.update(stages=None, step_time_s=None, fits=False)
    else:
        step, hybrid = min(layouts.values(), key=lambda x: x[0])
        record.update(stages=len(hybrid), step_time_s=step, shares=list(hybrid.shares), _plans=layouts,
                      _pipelines=pipelines)
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, len(tried), hybrid)
    tried.append(record)
    return best


def _best_for(problem: Problem, place: PlaceFn, weights: Mapping[str, float],
              pipelines: list[list[str]]) -> tuple[float, Partition] | None:
    """The fastest feasible hybrid over ``pipelines`` (``_layouts_for``); ``None`` when none fits."""
    layouts = _layouts_for(problem, place, weights, pipelines)
    return min(layouts.values(), key=lambda x: x[0]) if layouts else None


def _layouts_for(problem: Problem, place: PlaceFn, weights: Mapping[str, float], pipelines: list[list[str]],
                 sync_in_view: bool = False) -> dict[int, tuple[float, Partition]]:
    """The fastest feasible hybrid over ``pipelines`` per layout (chunks per device): the placer run on each distinct
    kind of pipeline, and under interleaved-1f1b or a V schedule also its several-chunks-per-device version
    (``interleave`` on one replica's sub-problem) when that simulates faster there -- under ``zb-planned`` always
    (its V is a finalist of the cut polish, as ``zbv``'s is) --, each with even or throughput-proportional shares;
    the first on ties. ``sync_in_view``: the placer's sub-problems carry their stages' all-reduce
    (``_sub_problem``)."""
    degree = len(pipelines)
    types = {d.id: d.type for d in problem.cluster.devices}
    kinds: dict[tuple[str, ...], int] = {}
    for r, p in enumerate(pipelines):
        kinds.setdefault(tuple(types[x] for x in p), r)
    found: dict[int, tuple[float, Partition]] = {}
    even = even_shares(problem.microbatches, degree)
    for r in kinds.values():
        sub = _sub_problem(problem, pipelines, r, max(even), sync_in_view)
        try:
            pure = place(sub, _weights_of(weights, pipelines[r]))
        except PlannerError:
            continue
        position = {dev: i for i, dev in enumerate(pipelines[r])}
        layouts: list[tuple[Partition, dict[str, Any]]] = [(pure, {})]
        split, record = interleave(sub, pure)  # several chunks per device (interleaved-1f1b, the V schedules)
        if record.get("chunks", 1) > 1:
            layouts.append((split, {"interleave": {**record, "reason": f"each replica pipeline: {record['reason']}"}}))
        elif problem.schedule in GENERATED_ORDER_SCHEDULES and record:
            v = chunked(sub, [st.device for st in pure], 2)
            if v is not None and not violations(sub, v):
                layouts.append((v, {"interleave": {**record, "chunks": 2, "reason": "each replica pipeline: 2 chunks "
                                                   "per device in a V, simulated with the replicas"}}))
        for pipe, facts in layouts:
            stages = tuple(StageSpec(st.start, st.stop, pipelines[0][position[st.device]],
                                     tuple(p[position[st.device]] for p in pipelines)) for st in pipe)
            least = len(stages) if problem.schedule == "1f1b" else 1
            options = [even]
            speeds = [1.0 / max(_busiest_device_s(problem, replica_of(stages, q)), 1e-30) for q in range(degree)]
            weighted = proportional_shares(speeds, problem.microbatches, least)
            if weighted is not None and weighted != even:
                options.append(weighted)
            chunks = len(stages) // len({st.device for st in stages})
            for shares in options:
                hybrid = Placed(stages, facts, shares=shares)
                if violations(problem, hybrid):
                    continue
                step = step_time_s(problem, hybrid)
                if chunks not in found or step < found[chunks][0] * (1 - 1e-9):
                    found[chunks] = (step, hybrid)
    return found


def _busiest_device_s(problem: Problem, pipeline: Partition) -> float:
    """Compute seconds per micro-batch of the pipeline's busiest device, its stages summed (several under
    interleaved-1f1b or in a V): what a replica's throughput is proportional to."""
    load: dict[str, float] = {}
    for st in pipeline:
        load[st.device] = load.get(st.device, 0.0) + stage_compute_s(problem.tables, st.device, st.start, st.stop)
    return max(load.values())


def _sub_problem(problem: Problem, pipelines: Sequence[Sequence[str]], r: int, microbatches: int,
                 sync_in_view: bool = False) -> Problem:
    """``problem`` on pipeline ``r``'s devices only, with ``microbatches`` (one replica's share); with
    ``sync_in_view``, each device carrying what its stage's all-reduce with the other pipelines' devices at its slot
    costs (``Problem.replica_sync``), so that the placer splits the replica with its sync in view."""
    devices = pipelines[r]
    keep = set(devices)
    cluster = replace(problem.cluster, devices=tuple(d for d in problem.cluster.devices if d.id in keep))
    groups = {dev: tuple(p[i] for p in pipelines) for i, dev in enumerate(devices)}
    return replace(problem, cluster=cluster, microbatches=microbatches,
                   speed_factors={k: v for k, v in problem.speed_factors.items() if k in keep},
                   replica_sync=replica_sync_rates(problem, groups) if sync_in_view else {})


def _weights_of(weights: Mapping[str, float], devices: Sequence[str]) -> dict[str, float]:
    """Seed 003's per-device weights restricted to one pipeline's devices and renormalised."""
    total = sum(weights.get(d, 1.0 / len(devices)) for d in devices)
    return {d: weights.get(d, 1.0 / len(devices)) / total for d in devices}
