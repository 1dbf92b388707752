"""Topology-aware mapping of stages to devices (seed 000: place stages with the links in mind).

Given a partition's stages (which blocks each holds), choose which device runs each stage so that
heavy cuts sit on fast links and host boundaries fall where the activations are small, and each
stage's compute runs on a device type that suits it. The score is the exact placers' shared
objective (``planner.partition.objective``), memory included.

- Exact: the class-count DP of ``planner.partition.dp`` restricted to the partition's own stages
  (``segments``): it chooses a device class per stage and tracks devices used per class, so it
  searches every assignment of stages to distinct devices up to interchangeable devices.
- Beyond ``dp.MAX_STATES`` (many devices with distinct links): deterministic local search over
  swaps of two stages' devices and moves of a stage to an unused device, while the objective drops.

``map_stages`` never returns a worse mapping than it was given. ``id_order`` is the baseline it is
compared with in the benchmark: stage ``i`` on the ``i``-th device of the cluster file.
"""

from __future__ import annotations

import logging

from planner.errors import InfeasibleError, PlannerError
from planner.partition.cost import check_fits
from planner.partition.objective import step_time_formula_s
from planner.partition.problem import Partition, Problem, StageSpec

__all__ = ["map_stages", "id_order"]

log = logging.getLogger(__name__)


def map_stages(problem: Problem, partition: Partition) -> Partition:
    """``partition``'s stages on the devices that minimise the shared objective (exact where the DP fits)."""
    from planner.partition.dp import solve_dp

    segments = [(st.start, st.stop) for st in partition]
    try:
        mapped = solve_dp(problem, segments=segments).partition
    except InfeasibleError:
        return partition  # no mapping of these stages fits; the caller's own check reports it
    except PlannerError as exc:  # state space too large: local search instead
        log.info("map_stages: %s; using local search", exc)
        mapped = _local_search(problem, partition)
    return mapped if _value(problem, mapped) < _value(problem, partition) else partition


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
    unused = [d for d in problem.cluster.device_ids if d not in devices]
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
