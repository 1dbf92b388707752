"""The one feasibility rule: what a plan's shape and memory must satisfy for ``plan run`` to execute it.

Every consumer asks here and so gives the same message: the placers (through ``check_fits`` and
``build_plan``, and ``max_stages`` to bound the stage counts they try), ``validate_plan`` (and so
``plan check``) and the runtime before any rank starts. The rules:

1. the schedule is one the runtime has (``SCHEDULES``) and there is at least one micro-batch;
2. there is at least one stage;
3. devices per stage: one stage per device, except ``interleaved-1f1b``, whose stages go round-robin
   over its devices with the same number on each, and ``zbv``, ``dualpipev`` and ``zb-planned``, which may put two
   on each in a V (``schedules.pipeline_layout``);
4. micro-batch count: ``1f1b`` needs at least as many micro-batches as stages (torch's
   ``Schedule1F1B`` refuses fewer), and so does ``dualpipev`` in a V (``ScheduleDualPipeV``'s rule);
   ``interleaved-1f1b`` needs a count that splits into its rounds
   (``schedules.interleaved_group_size``, torch's ``ScheduleInterleaved1F1B`` rule);
5. memory: every device's peak (weights, gradients, optimizer state and the activations its schedule
   keeps in flight; ``cost.device_memory_bytes``) fits its capacity;
6. replicas (hybrid plans): every stage has the same number of devices d; no device holds a slot in two
   replicas; the shares are d positive counts that sum to the step's micro-batches; and each replica's
   pipeline, with its share, satisfies rules 3 and 4 (``replica_violations``). Rule 5 counts each replica's
   activations for its own share;
7. asynchronous schedules (``schedules.async_violation``): one stage per device, ``2bw`` at least ``p - 1``
   micro-batches per replica, and replicas only with ``ssgd`` (their gradients averaged at every update).
"""

from __future__ import annotations

from typing import Sequence

from planner.errors import InfeasibleError, PlannerError
from planner.formats.plan import SCHEDULES, even_shares
from planner.partition.model.cost import (device_memory_bytes, format_bytes, inflight_microbatches,
                                          infeasible_reason, stage_activation_need_t, stage_stash_bytes_t,
                                          stage_static_bytes,
                                          validate_partition)
from planner.partition.model.problem import Partition, Problem, degree_of, shares_of
from planner.partition.sim.schedules import (async_violation, dualpipev_violation, interleaved_group_size,
                                             pipeline_layout)

__all__ = ["shape_violations", "replica_violations", "memory_violations", "violations", "check_fits", "max_stages", "no_fit_message"]


def max_stages(schedule: str, microbatches: int, num_devices: int) -> int:
    """The most stages a plan on ``num_devices`` devices may have under rule 4 (one per device otherwise)."""
    if schedule == "1f1b":
        return max(1, min(num_devices, microbatches))
    return num_devices


def shape_violations(schedule: str, microbatches: int, stage_devices: Sequence[str]) -> list[str]:
    """Rules 1-4 for stages placed on ``stage_devices`` (in stage order); one line per broken rule."""
    if schedule not in SCHEDULES:
        return [f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}"]
    if microbatches < 1:
        return [f"a plan needs at least 1 micro-batch, found {microbatches}; re-partition with --microbatches 1 or more"]
    if not stage_devices:
        return ["a plan needs at least one stage, found none; re-partition"]
    try:
        ranks, _ = pipeline_layout(stage_devices, schedule)
    except PlannerError as exc:
        return [str(exc)]
    stages = len(stage_devices)
    if schedule == "1f1b" and microbatches < stages:
        return [f"1f1b needs at least as many micro-batches as stages ({stages}), the plan has {microbatches}; "
                f"re-partition with --microbatches {stages} or more, or use --schedule gpipe"]
    if schedule == "dualpipev" and (found := dualpipev_violation(stages, len(ranks), microbatches)):
        return [found]
    if schedule == "interleaved-1f1b":
        try:
            interleaved_group_size(len(ranks), microbatches)
        except PlannerError as exc:
            return [str(exc)]
    return []


def replica_violations(schedule: str, microbatches: int, stage_replicas: Sequence[Sequence[str]],
                       shares: Sequence[int] | None) -> list[str]:
    """Rules 1-4 and 6 for stages held by ``stage_replicas[s]`` (device first) with replica shares ``shares``
    (``None``: one replica, or an even split); one line per broken rule. Degree 1 is ``shape_violations``."""
    if not stage_replicas:
        return shape_violations(schedule, microbatches, [])
    degree = len(stage_replicas[0])
    for s, devices in enumerate(stage_replicas):
        if len(devices) != degree:
            return [f"stage {s} has {len(devices)} replica(s) but stage 0 has {degree}; every stage needs the same "
                    f"number of replicas (the data-parallel degree): re-partition"]
    if degree == 1 and shares is None:
        return shape_violations(schedule, microbatches, [d[0] for d in stage_replicas])
    if shares is None:
        shares = even_shares(microbatches, degree)
    if len(shares) != degree:
        return [f"data_parallel.microbatches lists {len(shares)} share(s) for {degree} replicas; give one share per "
                f"replica"]
    if any(m < 1 for m in shares) or sum(shares) != microbatches:
        return [f"the replicas' shares {list(shares)} must be positive and sum to the step's {microbatches} "
                f"micro-batches, they sum to {sum(shares)}; fix data_parallel.microbatches or re-partition"]
    owner: dict[str, tuple[int, int]] = {}
    for s, devices in enumerate(stage_replicas):
        for r, device in enumerate(devices):
            if device in owner and owner[device][1] != r:
                other_stage, other_r = owner[device]
                return [f"device {device!r} holds stage {other_stage} of replica {other_r} and stage {s} of replica {r}; "
                        f"a device may serve one replica only: re-partition"]
            owner.setdefault(device, (s, r))
    for r in range(degree):
        found = shape_violations(schedule, shares[r], [devices[r] for devices in stage_replicas])
        if found:
            return [f"replica {r} (share {shares[r]}): {found[0]}" if degree > 1 else found[0]]
    return []


def memory_violations(problem: Problem, partition: Partition) -> list[str]:
    """Rule 5: one line per device whose peak memory exceeds its capacity, naming its stages."""
    out = []
    for device, need in device_memory_bytes(problem, partition).items():
        capacity = problem.tables.capacity_bytes[device]
        if need > capacity:
            stages = [i for i, st in enumerate(partition) if device in st.devices]
            which = f"stage {stages[0]} on {device!r} needs" if len(stages) == 1 else \
                f"stages {', '.join(map(str, stages))} on {device!r} need"
            stash = sum(stage_stash_bytes_t(problem.tables, problem.schedule, st.start, st.stop, len(partition) - i,
                                            problem.microbatches) for i, st in enumerate(partition) if device in st.devices)
            versions = (f" ({format_bytes(stash)} of it the weight versions {problem.schedule} keeps)" if stash else "")
            remedy = "a flushing schedule (1f1b), which keeps no weight versions" if stash else \
                "a schedule with fewer micro-batches in flight"
            out.append(f"{which} {format_bytes(need)} ({need} bytes) of memory at peak{versions} under "
                       f"{problem.schedule} with {problem.microbatches} micro-batches, but the device has "
                       f"{format_bytes(capacity)} ({capacity} bytes); move blocks off it, use more stages, or {remedy}")
    return out


def violations(problem: Problem, partition: Partition) -> list[str]:
    """Rules 1-7 for ``partition`` of ``problem`` (memory only once the shape is right)."""
    shares = shares_of(partition, problem.microbatches) if degree_of(partition) > 1 else None
    return (replica_violations(problem.schedule, problem.microbatches, [st.devices for st in partition], shares)
            or _async_violations(problem, partition) or memory_violations(problem, partition))


def _async_violations(problem: Problem, partition: Partition) -> list[str]:
    """Rule 7 (``schedules.async_violation``) for ``partition``: one replica pipeline's devices, its smallest share."""
    found = async_violation(problem.schedule, len(partition), len({st.device for st in partition}),
                            min(shares_of(partition, problem.microbatches)), degree_of(partition), problem.sync)
    return [found] if found else []


def check_fits(problem: Problem, partition: Partition) -> None:
    """Raise ``InfeasibleError`` with the first violation of rules 1-7 (``PlannerError`` for a malformed partition)."""
    validate_partition(problem, partition)
    found = violations(problem, partition)
    if found:
        raise InfeasibleError(found[0])


_NO_FIT_BLOCK_LIMIT = 600
"""Blocks up to which ``no_fit_message`` computes the least memory any split needs (O(blocks^2 x stages^2))."""


def no_fit_message(problem: Problem, method: str) -> str:
    """Why no split of ``problem`` fits in memory, with sizes: the quick reasons of ``infeasible_reason`` (a
    block too large for every device, weights that exceed all devices together), else the least memory the
    fullest stage of *any* contiguous split into at most ``max_stages`` stages needs, which stage and blocks
    that is, and the largest device's capacity."""
    quick = infeasible_reason(problem)
    if quick is not None:
        return quick
    largest = max(problem.cluster.devices, key=lambda d: (d.memory_bytes, d.id))
    advice = ("use devices with more memory, more devices, fewer micro-batches in flight (--schedule 1f1b, fewer "
              "--microbatches), a finer --granularity, an optimizer with less state"
              + (", or activation recomputation (--recompute auto)" if not problem.recompute else ""))
    head = (f"{method}: no split of the {len(problem.blocks)} blocks fits in memory under {problem.schedule} with "
            f"{problem.microbatches} micro-batches")
    if len(problem.blocks) > _NO_FIT_BLOCK_LIMIT:
        return f"{head}; the largest device, {largest.id!r} ({largest.type}), has {format_bytes(largest.memory_bytes)}; {advice}"
    need, stage, start, stop, stages = _least_peak(problem)
    names = problem.blocks[start].name if stop - start == 1 else f"{problem.blocks[start].name}..{problem.blocks[stop - 1].name}"
    return (f"{head}: the split that needs least memory ({stages} stage(s)) still needs {format_bytes(need)} "
            f"({need} bytes) on stage {stage} (blocks {start}-{stop - 1}: {names}), but the largest device, "
            f"{largest.id!r} ({largest.type}), has {format_bytes(largest.memory_bytes)} ({largest.memory_bytes} "
            f"bytes); {advice}")


def _least_peak(problem: Problem) -> tuple[int, int, int, int, int]:
    """Over every split into k <= max_stages contiguous stages: the least possible largest stage memory.

    Returns (bytes, stage index, first block, stop block, k). A DP per k: ``best[j]`` is the least largest
    memory of the first stages covering blocks ``[0, j)``, stage ``s`` keeping its schedule's in-flight
    micro-batches (``inflight_microbatches``: ``m`` under GPipe, ``min(m, k - s)`` under 1F1B).
    """
    n = len(problem.blocks)
    limit = max_stages(problem.schedule, problem.microbatches, len(problem.cluster.devices))
    best_overall: tuple[int, int, int, int, int] | None = None
    for k in range(1, min(limit, n) + 1):
        inflight = [inflight_microbatches(problem.schedule, s, k, problem.microbatches, k) for s in range(k)]
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(k + 1)]
        back = [[-1] * (n + 1) for _ in range(k + 1)]
        best[0][0] = 0
        for s in range(1, k + 1):
            for j in range(s, n - (k - s) + 1):
                for i in range(s - 1, j):
                    if best[s - 1][i] == inf:
                        continue
                    need = (stage_static_bytes(problem, i, j) + stage_activation_need_t(problem.tables, i, j, inflight[s - 1])
                            + stage_stash_bytes_t(problem.tables, problem.schedule, i, j, k - s + 1, problem.microbatches))
                    value = max(best[s - 1][i], need)
                    if value < best[s][j]:
                        best[s][j], back[s][j] = value, i
        if best[k][n] == inf:
            continue
        bounds, j = [n], n
        for s in range(k, 0, -1):
            j = back[s][j]
            bounds.append(j)
        bounds.reverse()
        needs = [stage_static_bytes(problem, bounds[s], bounds[s + 1])
                 + stage_activation_need_t(problem.tables, bounds[s], bounds[s + 1], inflight[s]) for s in range(k)]
        fullest = max(range(k), key=lambda s: (needs[s], -s))
        candidate = (int(needs[fullest]), fullest, bounds[fullest], bounds[fullest + 1], k)
        if best_overall is None or candidate[0] < best_overall[0]:
            best_overall = candidate
    assert best_overall is not None
    return best_overall
