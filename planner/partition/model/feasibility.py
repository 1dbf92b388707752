"""The one feasibility rule: what a plan's shape and memory must satisfy for ``plan run`` to execute it.

Every consumer asks here and so gives the same message: the placers (through ``check_fits`` and
``build_plan``, and ``max_stages`` to bound the stage counts they try), ``validate_plan`` (and so
``plan check``) and the runtime before any rank starts. The rules:

1. the schedule is one the runtime has (``SCHEDULES``) and there is at least one micro-batch;
2. there is at least one stage;
3. devices per stage: one stage per device, except ``interleaved-1f1b``, whose stages go round-robin
   over its devices with the same number on each (``schedules.pipeline_layout``);
4. micro-batch count: ``1f1b`` needs at least as many micro-batches as stages (torch's
   ``Schedule1F1B`` refuses fewer); ``interleaved-1f1b`` needs a count that splits into its rounds
   (``schedules.interleaved_group_size``, torch's ``ScheduleInterleaved1F1B`` rule);
5. memory: every device's peak (weights, gradients, optimizer state and the activations its schedule
   keeps in flight; ``cost.device_memory_bytes``) fits its capacity.
"""

from __future__ import annotations

from typing import Sequence

from planner.errors import InfeasibleError, PlannerError
from planner.formats.plan import SCHEDULES
from planner.partition.model.cost import device_memory_bytes, format_bytes, validate_partition
from planner.partition.model.problem import Partition, Problem
from planner.partition.sim.schedules import interleaved_group_size, pipeline_layout

__all__ = ["shape_violations", "memory_violations", "violations", "check_fits", "max_stages"]


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
    if schedule == "interleaved-1f1b":
        try:
            interleaved_group_size(len(ranks), microbatches)
        except PlannerError as exc:
            return [str(exc)]
    return []


def memory_violations(problem: Problem, partition: Partition) -> list[str]:
    """Rule 5: one line per device whose peak memory exceeds its capacity, naming its stages."""
    out = []
    for device, need in device_memory_bytes(problem, partition).items():
        capacity = problem.tables.capacity_bytes[device]
        if need > capacity:
            stages = [i for i, st in enumerate(partition) if st.device == device]
            which = f"stage {stages[0]} on {device!r} needs" if len(stages) == 1 else \
                f"stages {', '.join(map(str, stages))} on {device!r} need"
            out.append(f"{which} {format_bytes(need)} ({need} bytes) at peak under {problem.schedule} with "
                       f"{problem.microbatches} micro-batches, but the device has {format_bytes(capacity)} "
                       f"({capacity} bytes); move blocks off it, use more stages, or a schedule with fewer "
                       f"micro-batches in flight")
    return out


def violations(problem: Problem, partition: Partition) -> list[str]:
    """Rules 1-5 for ``partition`` of ``problem`` (memory only once the shape is right)."""
    shape = shape_violations(problem.schedule, problem.microbatches, [st.device for st in partition])
    return shape or memory_violations(problem, partition)


def check_fits(problem: Problem, partition: Partition) -> None:
    """Raise ``InfeasibleError`` with the first violation of rules 1-5 (``PlannerError`` for a malformed partition)."""
    validate_partition(problem, partition)
    found = violations(problem, partition)
    if found:
        raise InfeasibleError(found[0])
