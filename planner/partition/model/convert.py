"""The one conversion between a placer's ``Partition`` and a ``Plan``, both ways.

``build_plan``: partition -> plan (the stages' nodes, per-stage costs and the simulated prediction).
``partition_of``: plan -> partition over a problem's blocks (the runtime's rebalancer and ``plan check``
judge a plan in force with the same cost model the placers used).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

from planner.formats.plan import ASYNC_SCHEDULES, ZERO_BUBBLE_SCHEDULES, Plan, Stage
from planner.partition.model.cost import (evaluate, recomputes, shape_of, stage_backward_halves, stage_fwd_bwd_s,
                                          stage_memory_bytes, stage_sims, stage_sync_s, stage_update_s, tied_stages,
                                          transfer_s)
from planner.partition.model.feasibility import check_fits
from planner.errors import PlanMismatchError
from planner.partition.model.problem import (Partition, Placed, Problem, StageSpec, degree_of, replica_of, shares_of)
from planner.partition.sim.schedules import async_staleness, stashed_versions
from planner.partition.sim.simulate import SimResult, SimStage


def build_plan(problem: Problem, partition: Partition, *, method: str,
               profile_ref: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> Plan:
    """Check memory, simulate, and assemble the plan (docs/formats.md).

    ``profile_ref`` (path, sha256, model name: the caller knows them) is stored as ``profile``; the
    cluster is embedded so that a plan can be checked without its cluster file. ``extra`` adds
    top-level fields (solver status, refine rounds, ...). Raises ``InfeasibleError`` when a device's
    peak memory exceeds its capacity.
    """
    check_fits(problem, partition)
    sims = stage_sims(problem, replica_of(partition, 0))
    result = evaluate(problem, partition, record_events=False)
    stages = tuple(_stage(problem, partition, i, sims[i], result) for i in range(len(partition)))
    top: dict[str, Any] = {
        "optimizer": problem.optimizer,
        "estimated_types": list(problem.estimated_types),
        "cluster": problem.cluster.to_dict(),
    }
    if problem.speed_factors:
        top["speed_factors"] = dict(problem.speed_factors)
    if problem.calibration:
        top["calibration"] = dict(problem.calibration)
    if problem.corrections:
        top["cost_corrections"] = [list(c) for c in problem.corrections]
    if profile_ref is not None:
        top["profile"] = dict(profile_ref)
    top.update(extra or {})
    if problem.schedule in ASYNC_SCHEDULES:
        top["async"] = async_record(problem, partition, top.get("async"))
    if problem.schedule in ZERO_BUBBLE_SCHEDULES:
        top["schedule_order"] = schedule_order(problem, partition, result)
    if degree_of(partition) > 1:
        top["data_parallel"] = shape_of(problem, partition).data_parallel()
    if tied := tied_stages(problem, partition):  # what plan show's replay all-reduces
        top["tied_sync"] = [{"stages": list(stages), "bytes": nbytes} for stages, nbytes in tied]
    return Plan(
        method=method,
        schedule=problem.schedule,
        microbatches=problem.microbatches,
        stages=stages,
        predicted=MappingProxyType(predicted(result)),
        extra=MappingProxyType(top),
    )


def schedule_order(problem: Problem, partition: Partition, result: SimResult) -> dict[str, list[str]]:
    """The plan's ``schedule_order`` (design.md section 5): per rank, its passes in torch's action notation
    (``"0F1"``: stage 0's forward of micro-batch 1; ``I`` and ``W`` the halves of a backward), what the runtime hands
    to torch's ``_PipelineScheduleRuntime``. Each replica pipeline's order for its share of the micro-batches, as
    ``result`` (the plan's simulation, ``evaluate``) ran it: ``zb-h1``'s, ``zb-h2``'s, ``zbv``'s or ``dualpipev``'s
    fixed pattern, or ``zb-planned``'s order generated from that pipeline's stage times (``planned_orders``), under
    the stretch of ranks sharing a host's cores where the simulation applied one, so the order recorded is the one
    predicted. Ranks are numbered by first appearance of their devices over the stages, replica by replica
    (``planner.runtime.pipeline.stages.rank_devices`` without ``device_ranks``)."""
    pipelines = [replica_of(partition, r) for r in range(degree_of(partition))]
    devices = dict.fromkeys(st.device for pipe in pipelines for st in pipe)
    return {str(rank): [f"{s}{kind}{j}" for kind, s, j in result.orders[device]] for rank, device in enumerate(devices)}


def async_record(problem: Problem, partition: Partition, given: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The plan's ``async`` field (docs/formats.md): the correction (``given``'s, else ``predict``), per stage
    the staleness its gradients have in the steady state and the weight versions it keeps besides its live ones,
    and the steps between drains the prediction assumed (``drain_every``, absent for the steady state). Whether the
    runtime can run the schedule on this shape is the feasibility rule's (rule 7), which ``build_plan`` checks first."""
    p, shares = len(partition), sorted(set(shares_of(partition, problem.microbatches)))
    return {"correction": "predict", **dict(given or {}),  # with replicas: the most any replica's share gives
            "staleness": [max(async_staleness(problem.schedule, s, p, m) for m in shares) for s in range(p)],
            "weight_versions": [max(stashed_versions(problem.schedule, s, p, m) for m in shares) for s in range(p)],
            **({"drain_every": problem.drain_every} if problem.drain_every is not None else {})}


def predicted(result: SimResult) -> dict[str, Any]:
    """The plan's ``predicted`` field from a simulation (``sync_s`` per stage index for hybrid plans)."""
    out = {
        "step_time_s": result.step_time_s,
        "bubble_fraction": result.bubble_fraction,
        "devices": {dev: {"busy_s": s.busy_s, "idle_s": s.idle_s, "peak_memory_bytes": s.peak_memory_bytes,
                          "compute_s": s.compute_s, "copy_s": s.copy_s, "overhead_s": s.overhead_s,
                          "update_s": s.update_s, **({"sync_s": s.sync_s} if s.sync_s else {})}
                    for dev, s in result.devices.items()},
    }
    if result.sync_s:
        out["sync_s"] = {str(i): t for i, t in enumerate(result.sync_s)}
    return out


def _stage(problem: Problem, partition: Partition, i: int, sim: SimStage, result: SimResult) -> Stage:
    spec = partition[i]
    blocks = problem.blocks[spec.start:spec.stop]
    nodes = tuple(name for block in blocks for name in block.nodes)
    next_device = partition[i + 1].device if i + 1 < len(partition) else spec.device
    prev_device = partition[i - 1].device if i > 0 else spec.device
    device = problem.cluster.device(spec.device)
    fields = {
        "device_type": device.type,
        "blocks": [spec.start, spec.stop],
        "fwd_s": sim.fwd_s,
        "bwd_s": sim.bwd_s,
        "compute_s": sim.fwd_s + sim.bwd_s,
        "send_fwd_bytes": sim.send_fwd_bytes,
        "send_bwd_bytes": sim.send_bwd_bytes,
        "transfer_s": transfer_s(problem.tables, spec.device, next_device, sim.send_fwd_bytes),
        "transfer_bwd_s": transfer_s(problem.tables, spec.device, prev_device, sim.send_bwd_bytes),
        "static_bytes": sim.static_bytes,
        "activation_bytes": sim.activation_bytes,
        "update_s": sim.update_s,
        "inflight_microbatches": result.stage_inflight[i],
        "memory_bytes": stage_memory_bytes(problem, partition, i),
        "capacity_bytes": device.memory_bytes,
        "idle_s": result.devices[spec.device].idle_s,
        "layers": sorted({layer for block in blocks for layer in block.layers}),
    }
    if problem.schedule in ZERO_BUBBLE_SCHEDULES:  # what plan show needs to re-simulate the halves
        fields["bwd_weight_s"] = sim.bwd_weight_s
        fields["split_excess_s"] = sim.split_excess_s
    if recomputes(problem.tables, spec):  # design.md section 5; absent means "none"
        fields["recompute"] = "full"
        fields["recompute_bytes"] = sim.recompute_bytes
    if len(spec.devices) > 1:
        fields["replicas"] = list(spec.devices)
        fields["sync_s"] = stage_sync_s(problem, spec)
        fields["replica_times"] = [_replica_times(problem, spec, device, i == 0) for device in spec.devices]
    return Stage(index=i, device=spec.device, nodes=nodes, extra=MappingProxyType(fields))


def _replica_times(problem: Problem, spec: StageSpec, device: str, first: bool) -> dict[str, Any]:
    """What the stage costs on one of its replicas' devices (``plan show`` re-simulates every replica from these);
    ``first``: the stage is its pipeline's first."""
    fwd, bwd = stage_fwd_bwd_s(problem.tables, device, spec.start, spec.stop, spec.recompute)
    weight = excess = None
    if problem.schedule in ZERO_BUBBLE_SCHEDULES:
        fused = bwd
        bwd, weight = stage_backward_halves(problem.tables, device, spec.start, spec.stop, fused, first=first)
        excess = bwd - fused
    out = {"device": device, "fwd_s": fwd, "bwd_s": bwd, "update_s": stage_update_s(problem, device, spec.start, spec.stop)}
    if weight is not None:
        out["bwd_weight_s"] = weight
        out["split_excess_s"] = excess
    return out


def partition_of(problem: Problem, plan: Plan) -> Partition:
    """The plan's stages as block ranges of ``problem`` (each stage must start and end on a block boundary
    and hold a contiguous run of blocks, in order), each recomputing as the plan says (``Plan.recomputed``)."""
    first_block = {block.nodes[0]: b for b, block in enumerate(problem.blocks)}
    last_block = {block.nodes[-1]: b for b, block in enumerate(problem.blocks)}
    specs = []
    for stage, replicas, recompute in zip(plan.stages, plan.replicas(), plan.recomputed()):
        start, stop = first_block.get(stage.nodes[0]) if stage.nodes else None, last_block.get(stage.nodes[-1]) if stage.nodes else None
        size = sum(len(b.nodes) for b in problem.blocks[start:stop + 1]) if start is not None and stop is not None else -1
        if start is None or stop is None or stop < start or size != len(stage.nodes):
            raise PlanMismatchError(f"stage {stage.index} of the plan is not a contiguous run of the problem's blocks "
                                    f"(it starts at {stage.nodes[0] if stage.nodes else 'nothing'!r}); re-partition "
                                    f"from this profile")
        specs.append(StageSpec(start, stop + 1, stage.device, tuple(replicas) if len(replicas) > 1 else (), recompute))
    shape = plan.shape()
    return Placed(tuple(specs), shares=shape.shares) if shape.replicated else tuple(specs)
