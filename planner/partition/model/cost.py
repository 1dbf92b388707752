"""The cost model: a stage's compute time, transfer time and memory on a device (the rebalancing patent's S1).

- Compute: the sum of its blocks' forward and backward times on the device's type (measured, or
  estimated by the roofline), times the device's speed factor.
- Transfer: ``latency_s + bytes / bandwidth_Bps`` of the actual link between the two devices, for the
  bytes crossing the cut (values that skip stages are routed through them; see ``problem.cut_bytes``).
- Memory: weights + gradients + optimizer state (``OPTIMIZER_STATES``), plus the activations saved per
  micro-batch times the micro-batches in flight under the schedule (GPipe keeps all ``m``; 1F1B keeps
  ``min(m, p - s)`` on stage ``s``; interleaved as its order dictates).

``CostTables`` holds prefix sums so that placers get any stage's figures in O(1). See
docs/cost-model.md for the formulas and what they leave out.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from planner.errors import PlannerError
from planner.formats.cluster import Link
from planner.formats.plan import (ASYNC_SCHEDULES, DEFAULT_SYNC, GENERATED_ORDER_SCHEDULES, SERVER_SYNCS, V_SCHEDULES,
                                  ZERO_BUBBLE_SCHEDULES, ParallelShape)
from planner.partition.model.allreduce import allreduce_s, server_exchange_s, sync_chunk_bytes
from planner.partition.model.problem import (Partition, Problem, StageSpec, degree_of, replica_of, shares_of,
                                             with_microbatches)
from planner.partition.model.tables import CostTables
from planner.partition.sim.schedules import (device_orders, inflight_counts, peak_activation_bytes, pipeline_layout,
                                             planned_patterns, stage_ranks, version_copies)
from planner.partition.sim.simulate import SimResult, SimStage
from planner.partition.sim.step import compute_only_s, exposed_sync_s, simulate_step

# --- O(1) stage figures for placers -------------------------------------------------------------

def recomputes(tables: CostTables, stage: StageSpec) -> bool:
    """Whether ``stage`` recomputes its activations: its own ``recompute``, else the problem's (``tables.recompute``)."""
    return tables.recompute if stage.recompute is None else stage.recompute


def stage_fwd_bwd_s(tables: CostTables, device: str, start: int, stop: int,
                    recompute: bool | None = None) -> tuple[float, float]:
    """Forward and backward seconds per micro-batch of blocks ``[start, stop)`` on ``device``; ``recompute`` (``None``:
    the problem's) adds the forward run again inside the backward, which the tables hold only when the problem
    recomputes every stage."""
    fwd, bwd, factor = tables.fwd_prefix[device], tables.bwd_prefix[device], tables.speed[device]
    forward, backward = (fwd[stop] - fwd[start]) * factor, (bwd[stop] - bwd[start]) * factor
    if recompute is not None and recompute != tables.recompute:
        backward += forward if recompute else -forward
    return forward, backward


def stage_backward_halves(tables: CostTables, device: str, start: int, stop: int, bwd: float, *,
                          first: bool) -> tuple[float, float]:
    """A zero-bubble stage's backward per micro-batch on ``device`` and its weight-gradient part ``W`` (the input
    gradient ``I`` is the rest), from ``bwd``, its fused backward (``stage_fwd_bwd_s``), as torch's runtime runs them:
    the first stage of a pipeline has no input gradient to send and runs its whole backward, fused, as ``W``; every
    other stage runs ``I`` and ``W`` apart, which takes ``a * saved ** k`` longer than fused for the bytes its blocks
    save (``tables.split_excess``, ``Problem.split_backward_excess``), shared by the halves in proportion."""
    if first:
        return bwd, bwd
    weight = min(bwd, (tables.weight_prefix[device][stop] - tables.weight_prefix[device][start]) * tables.speed[device])
    excess = _split_excess_s(tables, device, start, stop, bwd, first=first)
    if excess <= 0:
        return bwd, weight
    total = bwd + excess
    return total, min(total, weight * total / bwd)  # the min: rounding can put an all-W share a last bit above


def _split_excess_s(tables: CostTables, device: str, start: int, stop: int, bwd: float, *, first: bool) -> float:
    """What running a zero-bubble stage's backward as ``I`` and ``W`` apart costs above ``bwd``, the fused one
    (``stage_backward_halves`` adds it): ``a * saved ** k`` for the bytes blocks ``[start, stop)`` save; nothing on a
    pipeline's first stage, whose backward torch's runtime runs fused, nor for a stage without a backward. A whole
    backward (``B``) in a zero-bubble order does not pay it: callers read it as the halves' sum less ``bwd``."""
    if first or bwd <= 0:
        return 0.0
    a, k = tables.split_excess[device]
    return max(0.0, a * (tables.saved_prefix[stop] - tables.saved_prefix[start]) ** k * tables.speed[device])


def stage_compute_s(tables: CostTables, device: str, start: int, stop: int) -> float:
    """Forward + backward seconds per micro-batch of blocks ``[start, stop)`` on ``device``."""
    fwd, bwd = tables.fwd_prefix[device], tables.bwd_prefix[device]
    return (fwd[stop] - fwd[start] + bwd[stop] - bwd[start]) * tables.speed[device]


def stage_param_bytes_t(tables: CostTables, start: int, stop: int) -> int:
    """Bytes of the parameters a stage of blocks ``[start, stop)`` holds: those first read there, and its own copy of
    each tied set (``Problem.tied``) it reads whose first reader lies before it (the runtime keeps one per rank and
    sums their gradients)."""
    own = tables.param_prefix[stop] - tables.param_prefix[start]
    for nbytes, readers in tables.tied:
        if readers[0] < start and any(start <= r < stop for r in readers):
            own += nbytes
    return own


def stage_static_bytes_t(tables: CostTables, start: int, stop: int) -> int:
    """Weights + gradients + optimizer state of blocks ``[start, stop)`` (a tied copy's too)."""
    return stage_param_bytes_t(tables, start, stop) * tables.static_per_param_byte


def stage_stash_bytes_t(tables: CostTables, schedule: str, start: int, stop: int, stages_to_end: int,
                        microbatches: int) -> int:
    """Weight versions an asynchronous schedule keeps for blocks ``[start, stop)`` (``version_copies``; 0 for the
    flushing schedules), for a stage with ``stages_to_end`` stages from it to the last."""
    copies = version_copies(schedule, stages_to_end, microbatches)
    return stage_param_bytes_t(tables, start, stop) * copies if copies else 0


def stage_activation_bytes_t(tables: CostTables, start: int, stop: int, recompute: bool | None = None) -> int:
    """Bytes a stage of blocks ``[start, stop)`` keeps per micro-batch in flight (``stage_activation_terms_t``)."""
    return stage_activation_terms_t(tables, start, stop, recompute)[0]


def stage_recompute_bytes_t(tables: CostTables, start: int, stop: int, recompute: bool | None = None) -> int:
    """Bytes a recomputing stage of blocks ``[start, stop)`` holds once on top (``stage_activation_terms_t``)."""
    return stage_activation_terms_t(tables, start, stop, recompute)[1]


def stage_activation_need_t(tables: CostTables, start: int, stop: int, inflight: int,
                            recompute: bool | None = None) -> int:
    """Activation bytes of a stage of blocks ``[start, stop)`` with ``inflight`` micro-batches in flight."""
    kept, once = stage_activation_terms_t(tables, start, stop, recompute)
    return kept * inflight + once


def stage_activation_terms_t(tables: CostTables, start: int, stop: int,
                             recompute: bool | None = None) -> tuple[int, int]:
    """``(per micro-batch in flight, once)``: the activation bytes of a stage of blocks ``[start, stop)``.

    Without recomputation a stage keeps what its ops save for backward, per micro-batch in flight: ``(saved, 0)``.
    With it (``recompute``; ``None``: the problem's, ``tables.recompute``) it keeps only its input per micro-batch
    in flight, and before each backward runs the forward again, holding that one micro-batch's saved bytes:
    ``(input, saved)``.
    """
    saved = tables.saved_prefix[stop] - tables.saved_prefix[start]
    on = tables.recompute if recompute is None else recompute
    return (tables.input_bytes[start], saved) if on else (saved, 0)


def transfer_s(tables: CostTables, src: str, dst: str, nbytes: int) -> float:
    """Seconds to move ``nbytes`` from ``src`` to ``dst`` (0 on the same device or for no bytes)."""
    if src == dst or nbytes <= 0:
        return 0.0
    return tables.links[(src, dst)].transfer_s(nbytes)


def stage_static_bytes(problem: Problem, start: int, stop: int) -> int:
    """Weights + gradients + optimizer state of blocks ``[start, stop)`` (``stage_static_bytes_t`` by problem)."""
    return stage_static_bytes_t(problem.tables, start, stop)


def stage_activation_bytes(problem: Problem, start: int, stop: int) -> int:
    """Bytes kept per micro-batch in flight by blocks ``[start, stop)`` (``stage_activation_bytes_t`` by problem)."""
    return stage_activation_bytes_t(problem.tables, start, stop)


# --- Schedules and memory -------------------------------------------------------------------------

def inflight_microbatches(schedule: str, stage_index: int, num_stages: int, microbatches: int,
                          num_devices: int | None = None) -> int:
    """Micro-batches whose activations stage ``stage_index`` holds at once at its peak.

    GPipe: ``m``. 1F1B: ``min(m, p - s)``. Zero-bubble: ``min(m, p)``, and ``min(m, 2p - 1)`` under ``zb-h2``.
    Interleaved 1F1B over ``num_devices`` devices (default: one stage per device, which is 1F1B) and ``zbv`` or
    ``dualpipev`` with two stages per device (the same counts): counted by replaying the stage's device order.
    """
    devices = num_stages if num_devices is None else num_devices
    if schedule == "gpipe":
        return microbatches
    if schedule in V_SCHEDULES and devices != num_stages:  # two stages per device in a V: replay its order
        if num_stages != 2 * devices:
            raise PlannerError(f"{schedule} puts 1 or 2 stages on each device, but found {num_stages} on {devices} "
                               f"devices; re-partition with --schedule {schedule}")
        rank = stage_ranks(schedule, devices, num_stages)[stage_index]
        return inflight_counts(device_orders(schedule, devices, 2, microbatches)[rank])[stage_index]
    if schedule == "zb-h2":  # warms up with 2 (p - 1 - s) forwards and holds back 2 s weight gradients
        return min(microbatches, 2 * num_stages - 1)
    if schedule in ZERO_BUBBLE_SCHEDULES:  # activations live until W: zb-h1 holds min(m, p) on every stage; so
        return min(microbatches, num_stages)  # may zb-planned, and more only where zb-h2's order fits (planned_patterns)
    if schedule == "1f1b" or devices == num_stages:
        return min(microbatches, num_stages - stage_index)
    if num_stages % devices:
        raise PlannerError(f"{num_stages} stages cannot be spread round-robin over {devices} devices")
    orders = device_orders(schedule, devices, num_stages // devices, microbatches)
    return inflight_counts(orders[stage_index % devices])[stage_index]


def stage_memory_bytes(problem: Problem, partition: Partition, i: int) -> int:
    """Stage ``i``'s peak memory: static bytes + saved activations x micro-batches in flight (with replicas: the
    most any replica needs, each keeping activations for its own share of micro-batches)."""
    if degree_of(partition) > 1:
        return max(stage_memory_bytes(with_microbatches(problem, m), replica_of(partition, r), i)
                   for r, m in enumerate(shares_of(partition, problem.microbatches)))
    ranks, _ = pipeline_layout([st.device for st in partition], problem.schedule)
    stage = partition[i]
    if problem.schedule in GENERATED_ORDER_SCHEDULES and len(ranks) == len(partition):
        return device_memory_bytes(problem, partition)[stage.device]  # the stage is its device's: what its order holds
    inflight = inflight_microbatches(problem.schedule, i, len(partition), problem.microbatches, len(ranks))
    return (stage_static_bytes(problem, stage.start, stage.stop)
            + stage_activation_need_t(problem.tables, stage.start, stage.stop, inflight, stage.recompute)
            + stage_stash_bytes_t(problem.tables, problem.schedule, stage.start, stage.stop, len(partition) - i,
                                  problem.microbatches))


def device_memory_bytes(problem: Problem, partition: Partition) -> dict[str, int]:
    """Peak memory of every device holding stages: its stages' static bytes + its peak live activations.

    Activations are allocated when a forward starts and freed when its backward ends, in the device's
    schedule order; the simulator observes the same peaks. ``zb-planned`` in a V holds at most what ``zbv``'s or,
    with at least as many micro-batches as stages, ``dualpipev``'s order holds on each device (its candidates). A replica's devices hold the same stages and the
    activations of its own share of the micro-batches.
    """
    if degree_of(partition) > 1:
        out: dict[str, int] = {}
        for r, m in enumerate(shares_of(partition, problem.microbatches)):
            out.update(device_memory_bytes(with_microbatches(problem, m), replica_of(partition, r)))
        return out
    ranks, chunks = pipeline_layout([st.device for st in partition], problem.schedule)
    activation = {i: stage_activation_bytes_t(problem.tables, st.start, st.stop, st.recompute)
                  for i, st in enumerate(partition)}
    p = len(partition)
    held = []
    for device in ranks:
        static = sum(stage_static_bytes(problem, st.start, st.stop)
                     + stage_stash_bytes_t(problem.tables, problem.schedule, st.start, st.stop, p - i, problem.microbatches)
                     for i, st in enumerate(partition) if st.device == device)
        once = max((stage_recompute_bytes_t(problem.tables, st.start, st.stop, st.recompute) for st in partition
                    if st.device == device), default=0)  # one backward's recomputed forward at a time
        held.append(static + once)
    patterns = (problem.schedule,)
    if problem.schedule in GENERATED_ORDER_SCHEDULES:  # zb-planned: the most any of its candidates holds
        room = [problem.tables.capacity_bytes[device] - h for device, h in zip(ranks, held)]
        patterns = planned_patterns(p, len(ranks), problem.microbatches, room, [activation[i] for i in range(p)])
    orders = [device_orders(name, len(ranks), chunks, problem.microbatches) for name in patterns]
    return {device: h + max(peak_activation_bytes(order[r], activation) for order in orders)
            for r, (device, h) in enumerate(zip(ranks, held))}


def stage_sync_s(problem: Problem, stage: StageSpec) -> float:
    """Seconds to all-reduce the gradients of ``stage``'s parameters over its replicas (0 without replicas); on one
    replica pipeline of a hybrid plan (``Problem.replica_sync``), the charge per step of the all-reduce with the
    stage's replicas on the other pipelines."""
    tables = problem.tables
    nbytes = stage_param_bytes_t(tables, stage.start, stage.stop)  # a tied weight's copy is all-reduced too
    if len(stage.devices) < 2:
        a, b = problem.replica_sync.get(stage.device, (0.0, 0.0))
        return a + b * nbytes if nbytes > 0 else 0.0

    def link(a: str, b: str) -> Link:
        return tables.links[(a, b)]

    if problem.sync in SERVER_SYNCS:
        return server_exchange_s(stage.devices, nbytes, link, problem.cluster.pass_byte_overhead_s)
    hosts = {d.id: d.host for d in problem.cluster.devices}
    chunk = sync_chunk_bytes(stage.devices, link) if problem.sync == "adaptive" else 0  # sent as sub-tensors
    return allreduce_s(stage.devices, nbytes, link, hosts, problem.cluster.nics_per_host,
                       problem.cluster.pass_byte_overhead_s, chunk)


REPLICA_SYNC_MODES = (DEFAULT_SYNC, "local-sgd")
"""The modes whose all-reduce a replica pipeline's placer prices (``replica_sync_rates``): one aggregation every
``sync_period`` steps after the last backward. ``adaptive`` charges only what the compute of its period's steps does
not hide, and the parameter-server modes have one stage, so their placers see none."""


def replica_sync_rates(problem: Problem, groups: Mapping[str, Sequence[str]]) -> dict[str, tuple[float, float]]:
    """``Problem.replica_sync`` for one replica pipeline of ``problem``: for each of its devices, from the stage slot's
    replicas ``groups[device]`` (as the hybrid plan lists them), ``(a, b)`` with ``stage_sync_s`` of a stage of
    ``n > 0`` parameter bytes on the whole plan ``= a + b n``, divided by the sync period; empty for the other modes.
    The all-reduce is affine in the bytes (``allreduce``), so two sizes fix it."""
    if problem.sync not in REPLICA_SYNC_MODES or problem.sync_period is None:
        return {}
    tables, hosts = problem.tables, {d.id: d.host for d in problem.cluster.devices}
    out = {}
    for device, group in groups.items():
        if len(group) < 2:
            continue
        one, two = (allreduce_s(group, n, lambda a, b: tables.links[(a, b)], hosts, problem.cluster.nics_per_host,
                                problem.cluster.pass_byte_overhead_s) for n in (1e9, 2e9))
        out[device] = ((2 * one - two) / problem.sync_period, (two - one) / 1e9 / problem.sync_period)
    return out


def infeasible_reason(problem: Problem) -> str | None:
    """Why no plan can fit in memory, or ``None`` when this quick test finds no reason.

    A block can never be split, so it needs at least its static bytes plus its activations for the
    fewest micro-batches any stage keeps in flight (``m`` under GPipe, 1 otherwise); and the whole
    model's static bytes must fit in the devices' memory together.
    """
    tables = problem.tables
    least_inflight = problem.microbatches if problem.schedule == "gpipe" else 1
    needs = [stage_static_bytes_t(tables, b, b + 1) + stage_activation_need_t(tables, b, b + 1, least_inflight)
             for b in range(len(problem.blocks))]
    biggest = max(range(len(needs)), key=lambda b: (needs[b], -b))
    largest = max(problem.cluster.devices, key=lambda d: (d.memory_bytes, d.id))
    if needs[biggest] > largest.memory_bytes:
        return (f"no feasible plan (memory): block {problem.blocks[biggest].name!r} alone needs "
                f"{format_bytes(needs[biggest])} but the largest device, {largest.id!r} ({largest.type}), has "
                f"{format_bytes(largest.memory_bytes)}; use devices with more memory, a smaller micro-batch, "
                f"an optimizer with less state" + (", or --recompute auto" if not problem.recompute else ""))
    total = stage_static_bytes_t(tables, 0, len(problem.blocks))
    capacity = sum(d.memory_bytes for d in problem.cluster.devices)
    if total > capacity:
        return (f"no feasible plan (memory): weights, gradients and optimizer state take {format_bytes(total)} but all "
                f"{len(problem.cluster.devices)} devices together have {format_bytes(capacity)} (the largest single "
                f"need is block {problem.blocks[biggest].name!r} with {format_bytes(needs[biggest])}; the largest "
                f"device is {largest.id!r} with {format_bytes(largest.memory_bytes)}); add devices")
    return None


def format_bytes(nbytes: float) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


# --- Whole partitions ---------------------------------------------------------------------------

def validate_partition(problem: Problem, partition: Partition) -> None:
    """Stages must cover blocks ``0 .. n-1`` contiguously, in order, on devices of the cluster (replicas too)."""
    if not partition:
        raise PlannerError("a partition needs at least one stage, found none")
    expected = 0
    for i, stage in enumerate(partition):
        if stage.start != expected or stage.stop <= stage.start:
            raise PlannerError(f"stage {i} covers blocks [{stage.start}, {stage.stop}) but must start at block "
                               f"{expected} and hold at least one block; stages must be contiguous and in order")
        for device in stage.devices:
            if device not in problem.tables.capacity_bytes:
                problem.cluster.device(device)  # raises naming the known devices
        if stage.replicas and stage.replicas[0] != stage.device:
            raise PlannerError(f"stage {i} lists replicas {list(stage.replicas)} but its device is {stage.device!r}; "
                               f"replicas must list the stage's device first")
        expected = stage.stop
    if expected != len(problem.blocks):
        raise PlannerError(f"the stages cover blocks [0, {expected}) of {len(problem.blocks)}; "
                           f"every block must be in exactly one stage")
    pipeline_layout([st.device for st in partition], problem.schedule)


def stage_sims(problem: Problem, partition: Partition) -> tuple[SimStage, ...]:
    """The simulator's view of each stage: compute times, bytes sent each way, static and activation bytes."""
    validate_partition(problem, partition)
    tables, last = problem.tables, len(partition) - 1
    sims = []
    for i, st in enumerate(partition):
        fwd, bwd = stage_fwd_bwd_s(tables, st.device, st.start, st.stop, st.recompute)
        weight = excess = 0.0
        if problem.schedule in ZERO_BUBBLE_SCHEDULES:
            fused = bwd
            bwd, weight = stage_backward_halves(tables, st.device, st.start, st.stop, fused, first=i == 0)
            excess = bwd - fused
        sims.append(SimStage(
            device=st.device, fwd_s=fwd, bwd_s=bwd,
            send_fwd_bytes=problem.cut_fwd_bytes[st.stop - 1] if i < last else 0,
            send_bwd_bytes=problem.cut_bwd_bytes[st.start - 1] if i > 0 else 0,
            static_bytes=(stage_static_bytes_t(tables, st.start, st.stop)
                          + stage_stash_bytes_t(tables, problem.schedule, st.start, st.stop, len(partition) - i,
                                                problem.microbatches)),
            activation_bytes=stage_activation_bytes_t(tables, st.start, st.stop, st.recompute),
            recompute_bytes=stage_recompute_bytes_t(tables, st.start, st.stop, st.recompute),
            update_s=stage_update_s(problem, st.device, st.start, st.stop),
            bwd_weight_s=weight,
            split_excess_s=excess,
        ))
    return tuple(sims)


def stage_update_s(problem: Problem, device: str, start: int, stop: int) -> float:
    """The optimizer step over blocks ``[start, stop)``'s parameters on ``device`` (seconds per step): a sweep over
    their bytes and a fixed cost per tensor (``Problem.update_s_per_param_tensor``); under an asynchronous schedule
    with the weight versions' bookkeeping it adds (``Problem.version_s_per_param_byte``)."""
    tables = problem.tables
    if device not in tables.update_rate:
        problem.cluster.device(device)  # raises naming the known devices
    rate = tables.update_rate[device]
    if problem.schedule in ASYNC_SCHEDULES:
        rate += tables.version_rate[device]
    tensors = tables.param_tensor_prefix[stop] - tables.param_tensor_prefix[start]
    return rate * stage_param_bytes_t(tables, start, stop) + tables.update_tensor_rate[device] * tensors


def evaluate(problem: Problem, partition: Partition, *, record_events: bool = True) -> SimResult:
    """Simulate one training step of ``partition`` under the problem's schedule and micro-batches; with replicas,
    each replica pipeline runs its share (``shares_of``) and the stages then sync, one aggregation every
    ``sync_period`` steps; ranks sharing a host's cores are stretched to fit them (``planner.partition.sim.step``)."""
    degree = degree_of(partition)
    tied = tied_stages(problem, partition)
    if degree == 1:  # one replica pipeline of a hybrid plan also runs its stages' syncs
        syncs = [stage_sync_s(problem, st) for st in partition] if problem.replica_sync else []
        return simulate_step([stage_sims(problem, partition)], [problem.microbatches], syncs, problem.cluster,
                             problem.schedule, record_events=record_events, drain_every=problem.drain_every, tied=tied)
    pipelines = [stage_sims(problem, replica_of(partition, r)) for r in range(degree)]
    shares = shares_of(partition, problem.microbatches)
    syncs, period = _charged_syncs(problem, partition, pipelines, shares)
    return simulate_step(pipelines, shares, syncs, problem.cluster, problem.schedule, period=period,
                         record_events=record_events, drain_every=problem.drain_every, tied=tied)


def tied_stages(problem: Problem, partition: Partition) -> tuple[tuple[tuple[int, ...], int], ...]:
    """``(stages, bytes)`` of each tied parameter set (``Problem.tied``) that several stages read: what the runtime
    all-reduces every step (``simulate``'s ``tied``)."""
    out = []
    for nbytes, readers in problem.tied:
        stages = tuple(i for i, st in enumerate(partition) if any(st.start <= r < st.stop for r in readers))
        if len(stages) > 1:
            out.append((stages, nbytes))
    return tuple(out)


def sync_period(problem: Problem, partition: Partition) -> int:
    """Local steps between the replicas' aggregations: 1 for ``ssgd`` and pure pipelines, the problem's period for
    ``local-sgd``, and for ``adaptive`` without one the adaptive rule's first interval on the predicted step
    compute and the aggregation time it does not hide (``planner.partition.search.sync_period.initial_period``)."""
    degree = degree_of(partition)
    if degree == 1:
        return 1
    if problem.sync_period is not None:
        return problem.sync_period
    pipelines = [stage_sims(problem, replica_of(partition, r)) for r in range(degree)]
    return _charged_syncs(problem, partition, pipelines, shares_of(partition, problem.microbatches))[1]


def _charged_syncs(problem: Problem, partition: Partition, pipelines: list[tuple[SimStage, ...]],
                   shares: tuple[int, ...]) -> tuple[list[float], int]:
    """Each stage's all-reduce as the step is charged for it (``adaptive``: the part that the compute of the period's
    steps, which it travels under, does not hide), and the period it is spread over; the sync-free step is simulated
    once, and only for ``adaptive``. Without a period the adaptive rule's first interval is chosen from what one
    step's compute leaves exposed, as the run starts (its delay at 1 step, ``runtime.data_parallel.local``)."""
    syncs = [stage_sync_s(problem, st) for st in partition]
    if problem.sync != "adaptive":
        return syncs, problem.sync_period or 1
    compute = compute_only_s(pipelines, shares, problem.cluster, problem.schedule)
    period = problem.sync_period
    if period is None:
        from planner.partition.search.sync_period import initial_period

        period = initial_period(compute, max(exposed_sync_s(syncs, compute), default=0.0))
    return exposed_sync_s(syncs, compute, period), period


def shape_of(problem: Problem, partition: Partition) -> ParallelShape:
    """The partition's parallel layout, the value a plan's ``Plan.shape`` reads back: its stages' devices, its
    shares (``shares_of``), the problem's sync mode and the period (``sync_period``)."""
    replicated = degree_of(partition) > 1
    return ParallelShape(tuple(tuple(st.devices) for st in partition), shares_of(partition, problem.microbatches),
                         problem.sync if replicated else DEFAULT_SYNC,
                         sync_period(problem, partition) if replicated else 1, problem.sync_staleness)


def step_time_s(problem: Problem, partition: Partition) -> float:
    """The simulated step time of ``partition`` (``evaluate`` without recording events): what placers, polish,
    interleaving and the optimality check compare; each (stages, shares) is simulated once per problem."""
    key = (tuple(partition), shares_of(partition, problem.microbatches))
    if key not in problem.step_times:
        problem.step_times[key] = evaluate(problem, partition, record_events=False).step_time_s
    return problem.step_times[key]
