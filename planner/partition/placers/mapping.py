"""Topology-aware mapping of stages to devices (the adaptive scheduling paper: place stages with the links in mind).

Given a partition's stages (which blocks each holds), choose which device runs each stage so that
heavy cuts sit on fast links and host boundaries fall where the activations are small, and each
stage's compute runs on a device type that suits it. The score is the exact placers' shared
objective (``planner.partition.model.objective``), memory included.

- Exact: the class-count DP of ``planner.partition.placers.dp`` restricted to the partition's own stages: it
  chooses a device class per stage and tracks devices used per class, so it searches every
  assignment of stages to distinct devices up to interchangeable devices. Its tables are built over
  the stages themselves (one "block" per stage), so the cost does not depend on the block count.
- Beyond ``dp.MAX_STATES`` (many devices with distinct links): deterministic local search over
  swaps of two stages' devices and moves of a stage to an unused device, while the objective drops.

``map_stages`` never returns a worse mapping than it was given. ``id_order`` is the baseline it is
compared with in the benchmark: stage ``i`` on the ``i``-th device of the cluster file.
"""

from __future__ import annotations

import logging

import numpy as np

from planner.errors import InfeasibleError, PlannerError
from planner.partition.model.cost import stage_activation_terms_t, stage_static_bytes_t
from planner.partition.model.feasibility import check_fits
from planner.partition.model.objective import (
    ClassTables,
    boundary_s,
    class_link,
    device_classes,
    pass_pair_s,
    stage_latencies,
    stages_room,
    step_time_formula_s,
)
from planner.partition.model.problem import Partition, Problem, StageSpec

__all__ = ["map_stages", "id_order", "exact_mapping_fits"]

log = logging.getLogger(__name__)


def map_stages(problem: Problem, partition: Partition, *, local_search: bool = True) -> Partition:
    """``partition``'s stages on the devices that minimise the shared objective (exact where the DP fits).

    Beyond the DP's state limit: the local search, or (``local_search=False``) ``partition`` unchanged.
    """
    try:
        mapped = _exact(problem, partition)
    except InfeasibleError:
        return partition  # no mapping of these stages fits; the caller's own check reports it
    except PlannerError as exc:  # state space too large: local search instead
        if not local_search:
            return partition
        log.info("map_stages: %s; using local search", exc)
        mapped = _local_search(problem, partition)
    return mapped if _value(problem, mapped) < _value(problem, partition) else partition


def exact_mapping_fits(problem: Problem) -> bool:
    """Whether ``map_stages`` would use the exact DP on ``problem``'s cluster (the state space fits)."""
    from planner.partition.placers.dp import MAX_STATES, state_count

    return state_count(tuple(c.count for c in device_classes(problem))) <= MAX_STATES


def _exact(problem: Problem, partition: Partition) -> Partition:
    """The class-count DP over the fixed stages (``dp.walk_bounds`` on tables with one entry per stage)."""
    from planner.partition.placers.dp import check_state_space, walk_bounds

    tab = _stage_tables(problem, partition)
    check_state_space(tab)
    count = len(partition)
    segments = [(k, k + 1) for k in range(count)]
    _, stages, _ = walk_bounds(problem, tab, stage_latencies(tab, count, segments), count)
    used = [0] * len(tab.classes)
    out = []
    for (k, _, c), st in zip(stages, partition):
        out.append(StageSpec(st.start, st.stop, tab.classes[c].devices[used[c]]))
        used[c] += 1
    return tuple(out)


def _stage_tables(problem: Problem, partition: Partition) -> ClassTables:
    """``ClassTables`` whose block ``k`` is stage ``k`` of ``partition`` (same arithmetic as ``class_tables``)."""
    classes, tables, count = device_classes(problem), problem.tables, len(partition)
    compute = np.full((len(classes), count + 1, count + 1), np.inf)
    for c, cls in enumerate(classes):
        fwd, bwd = tables.fwd_prefix[cls.devices[0]], tables.bwd_prefix[cls.devices[0]]
        for k, st in enumerate(partition):
            compute[c, k, k + 1] = (float(fwd[st.stop]) - float(fwd[st.start])
                                    + float(bwd[st.stop]) - float(bwd[st.start])) * cls.speed
    boundary = np.full((len(classes), len(classes), max(count - 1, 0)), np.inf)
    cuts = [st.stop - 1 for st in partition[:-1]]
    for c, a in enumerate(classes):
        for d, b in enumerate(classes):
            link = class_link(problem, a, b)
            if link is not None:
                boundary[c, d] = [boundary_s(link, problem.cut_fwd_bytes[j], problem.cut_bwd_bytes[j],
                                             problem.cluster.pass_byte_overhead_s) for j in cuts]
    static = np.zeros((count + 1, count + 1), dtype=np.int64)
    act = np.zeros((count + 1, count + 1), dtype=np.int64)
    for k, st in enumerate(partition):
        kept, once = stage_activation_terms_t(tables, st.start, st.stop)
        static[k, k + 1] = stage_static_bytes_t(tables, st.start, st.stop) + once
        act[k, k + 1] = kept
    room = np.stack([stages_room(problem, cls, static, act) for cls in classes])
    return ClassTables(classes, compute, boundary, room, pass_pair_s(problem))


def id_order(problem: Problem, partition: Partition) -> Partition:
    """Stage ``i`` on the ``i``-th device in the cluster file's order (what rank order gives)."""
    ids = problem.cluster.device_ids
    if len(partition) > len(ids):
        raise PlannerError(f"{len(partition)} stages need as many devices; the cluster has {len(ids)}")
    return tuple(StageSpec(st.start, st.stop, ids[i]) for i, st in enumerate(partition))


def _value(problem: Problem, partition: Partition) -> float:
    """The shared objective, infinite where memory does not fit."""
    try:
        check_fits(problem, partition)
    except PlannerError:
        return float("inf")
    return step_time_formula_s(problem, partition)


def _local_search(problem: Problem, partition: Partition) -> Partition:
    """First-improvement search over device swaps and moves to unused devices, in a fixed order."""
    best, best_value = partition, _value(problem, partition)
    improved = True
    while improved:
        improved = False
        for candidate in _neighbours(problem, best):
            value = _value(problem, candidate)
            if value < best_value * (1 - 1e-12):
                best, best_value, improved = candidate, value, True
                break
    return best


def _neighbours(problem: Problem, partition: Partition) -> list[Partition]:
    devices = [st.device for st in partition]
    unused = [d for d in sorted(problem.cluster.device_ids) if d not in devices]
    out = []
    for i in range(len(partition)):
        for j in range(i + 1, len(partition)):
            swapped = list(devices)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            out.append(swapped)
        for d in unused:
            moved = list(devices)
            moved[i] = d
            out.append(moved)
    return [tuple(StageSpec(st.start, st.stop, d) for st, d in zip(partition, devs)) for devs in out]
