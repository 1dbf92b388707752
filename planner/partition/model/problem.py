"""The partitioning problem that every placer solves, built once from a profile and a cluster.

A plan is a sequence of stages, each a *contiguous* run of the profile's nodes in their
topological order, each on one device. Contiguity in that order is what
``torch.distributed.pipelining`` can execute (it cuts the exported graph between nodes), and it
makes every edge run forwards by construction. Placers therefore choose cut points between
*blocks* (contiguous node runs; one node per block at op granularity) and a device per stage.

Values that skip stages are routed through the stages in between (docs/run.md, "How a plan becomes a pipeline"), so the
bytes crossing the cut after block ``b`` are those of every value produced at or before ``b``
and read after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping, Sequence

from planner.errors import PlannerError, UsageError
from planner.formats.cluster import Cluster
from planner.formats.plan import (DEFAULT_STALENESS, DEFAULT_SYNC, PERIODIC_SYNCS, SCHEDULES, STALENESS_SYNCS,
                                  SYNC_MODES, even_shares, valid_drain_every)
from planner.formats.profile import Node, Profile
from planner.graph import last_reader, op_graph
from planner.formats.catalog import DeviceSpec
from planner.partition.model.tables import OPTIMIZER_STATES, CostTables
from planner.partition.model.times import (calibration_factors, loss_times, node_times, split_backward_excess,
                                          update_rates, update_tensor_rates, version_rates)
from planner.roofline import check_precision, weight_share



@dataclass(frozen=True)
class Block:
    """A contiguous run of profile nodes that placers never split."""

    name: str
    nodes: tuple[str, ...]
    param_bytes: int
    saved_bytes: int
    time_s: Mapping[str, tuple[float, float]]
    """Per device type: (forward, backward) seconds per micro-batch, summed over the block's nodes."""
    layers: tuple[str, ...] = ()
    """Sorted unique ``layer_of(module_path)`` of the block's nodes (empty paths left out)."""
    weight_s: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Per device type: the weight-gradient part of the backward (zero-bubble schedules' ``W``; absent: 0)."""
    param_tensors: int = 0
    """Parameter tensors the block's nodes use (a tensor two of its nodes share counts twice)."""


@dataclass(frozen=True)
class Problem:
    """Everything a placer needs: blocks, the bytes at every cut, the cluster and the run settings."""

    blocks: tuple[Block, ...]
    cut_fwd_bytes: tuple[int, ...]
    """``cut_fwd_bytes[b]``: activation bytes crossing the cut after block ``b`` (len = blocks - 1)."""
    cut_bwd_bytes: tuple[int, ...]
    """``cut_bwd_bytes[b]``: gradient bytes crossing the same cut backwards (model inputs carry none)."""
    cluster: Cluster
    microbatches: int
    schedule: str
    optimizer: str
    estimated_types: tuple[str, ...] = ()
    """Device types with estimated times: estimated here by the roofline because the profile lacked them,
    or marked ``estimated`` in the profile (``plan profile --estimate``)."""
    speed_factors: Mapping[str, float] = field(default_factory=dict)
    """Device id -> multiplier on that device's compute times (measured / predicted; 1 when absent).
    The runtime's rebalancer (the rebalancing patent's S5) feeds measured speeds back through this."""
    calibration: Mapping[str, float] = field(default_factory=dict)
    """Device type -> the factor its *measured* per-op times were scaled by (``calibration_factors``)."""
    corrections: tuple[tuple[int, int, float], ...] = ()
    """``(start, stop, factor)``: measured corrections already applied to profile nodes ``[start, stop)``
    (``build_problem(corrections=...)``), kept so the plan can record them."""
    loss_s: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Device type -> (forward, backward) seconds per micro-batch of the default loss (``loss_times``),
    included in the last block's times: the last stage computes it."""
    update_s_per_param_byte: Mapping[str, float] = field(default_factory=dict)
    """Device type -> seconds of the optimizer step per parameter byte (``update_rates``; 0 when absent).
    Each device pays it for its stages' parameters once per step, after its last backward."""
    update_s_per_param_tensor: Mapping[str, float] = field(default_factory=dict)
    """Device type -> seconds of the optimizer step per parameter tensor besides its bytes (``update_tensor_rates``;
    0 when absent), paid with the bytes' part."""
    version_s_per_param_byte: Mapping[str, float] = field(default_factory=dict)
    """Device type -> seconds per parameter byte of the weight-version bookkeeping an asynchronous schedule adds to
    each update (``version_rates``; 0 when absent); ``cost.stage_update_s`` charges it under those schedules."""
    split_backward_excess: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """Device type -> ``(a, k)``: a backward split into ``I`` and ``W`` takes ``a * saved_bytes ** k`` seconds beyond
    the fused one (``split_backward_excess``; none when absent); ``cost.stage_backward_halves`` charges it under the
    zero-bubble schedules."""
    sync: str = DEFAULT_SYNC
    """How replicated stages combine their updates (``data_parallel.sync``; ``with_sync``)."""
    sync_period: int | None = 1
    """Local steps between aggregations; ``None`` for ``adaptive``: the rule chooses it from the predicted times
    (``cost.sync_period``)."""
    sync_staleness: int = DEFAULT_STALENESS
    """``ssp``: how many steps the fastest worker may run ahead of the slowest (recorded in the plan;
    the step's cost does not depend on it)."""
    recompute: bool = False
    """Activation recomputation: every stage keeps only its input per micro-batch in flight and runs its forward
    again before each backward (the blocks' backward times include it; ``cost.stage_activation_terms_t``). A stage
    may say otherwise for itself (``StageSpec.recompute``)."""
    replica_sync: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    """One replica pipeline of a hybrid plan (``hybrid._sub_problem``): device id -> ``(a, b)``, the all-reduce a stage
    on it pays each step with its replicas on the other pipelines, ``a + b x`` its parameter bytes (0 without
    parameters; ``ssgd`` and ``local-sgd``, spread over the period). The simulator then runs each stage's sync after
    its last backward, as it does for the whole plan, and the formula adds what no backward hides
    (``objective.sync_tail_s``), so placers split the replica with its sync in view. Empty: none."""
    drain_every: int | None = None
    """Asynchronous schedules: the steps between pipeline drains, i.e. the run's round length (``plan run`` drains at
    every round end); each round then pays the pipeline's fill and drain (``simulate(drain_every=...)``). ``None``:
    never, the steady state. Flushing schedules drain every step whatever it says."""
    tied: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """Parameters several blocks read (a GPT's embedding and the LM head tied to it; the profile's
    ``tied_parameters``): ``(bytes, the blocks that read them, in order)``. Their bytes count once, at the first
    block (``Block.param_bytes``); a stage that reads them without holding that block keeps a copy of its own, with
    its gradient and optimizer state, which ``cost.stage_param_bytes_t`` adds. Empty: none."""

    def time_on(self, block: int, device_id: str) -> tuple[float, float]:
        fwd, bwd = self.blocks[block].time_s[self.cluster.device(device_id).type]
        factor = self.speed_factors.get(device_id, 1.0)
        return fwd * factor, bwd * factor

    @cached_property
    def tables(self) -> CostTables:
        """Prefix-sum cost tables, built on first use and kept (O(1) stage costs for placers)."""
        return CostTables.build(self)

    @cached_property
    def step_times(self) -> dict[tuple[tuple["StageSpec", ...], tuple[int, ...]], float]:
        """(stages, shares) -> simulated step seconds: ``cost.step_time_s``'s memo (a search meets a plan more than
        once: the polish's neighbours overlap, and the guard simulates what the placers already did)."""
        return {}


@dataclass(frozen=True)
class StageSpec:
    """One stage of a candidate partition: blocks ``[start, stop)`` on ``device``.

    ``replicas`` (hybrid plans, docs/formats.md): every device holding the stage, ``device`` first;
    empty means ``(device,)``. Replica ``r`` of the model is the pipeline of ``devices[r]`` of every stage.
    ``recompute``: whether the stage recomputes its activations (the plan's per-stage ``recompute``); ``None``, what
    placers leave it at, means the problem's ``recompute`` (``cost.recomputes``).
    """

    start: int
    stop: int
    device: str
    replicas: tuple[str, ...] = ()
    recompute: bool | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        return self.replicas or (self.device,)


Partition = tuple[StageSpec, ...]


def degree_of(partition: Partition) -> int:
    """The partition's data-parallel degree: the number of devices of its first stage (1 without replicas)."""
    return len(partition[0].devices) if partition else 1


def replica_of(partition: Partition, r: int) -> Partition:
    """Replica ``r``'s pipeline: every stage on its ``r``-th device, without replicas."""
    return tuple(StageSpec(st.start, st.stop, st.devices[r], recompute=st.recompute) for st in partition)


def shares_of(partition: Partition, microbatches: int) -> tuple[int, ...]:
    """Each replica's micro-batches per step: the shares a placer gave the partition (``Placed(..., shares=...)``),
    else an even split of ``microbatches`` (``cost.shape_of`` adds the sync mode and period)."""
    shares = getattr(partition, "shares", None)
    return tuple(shares) if shares else even_shares(microbatches, degree_of(partition))


def check_sync(sync: str, period: int | None, staleness: int | None = None) -> int | None:
    """``period`` for ``sync`` as the problem keeps it (1 for ``ssgd``; ``None``: adaptive's rule chooses), or a
    ``UsageError`` naming the option to fix (an unknown mode, ``--sync-period 0``, a period for ``ssgd``, a
    negative ``--staleness`` or one for a mode without a bound)."""
    if sync not in SYNC_MODES:
        raise UsageError(f"unknown sync mode {sync!r}; expected one of {', '.join(SYNC_MODES)}")
    if staleness is not None and (isinstance(staleness, bool) or staleness < 0):
        raise UsageError(f"--staleness must be a whole number of steps, 0 or more, found {staleness}; pass for "
                         f"example --staleness 3")
    if staleness is not None and sync not in STALENESS_SYNCS:
        raise UsageError(f"--staleness bounds {' and '.join(STALENESS_SYNCS)}, but --sync is {sync}; pass --sync ssp "
                         f"or drop --staleness")
    if period is not None and (isinstance(period, bool) or period < 1):
        raise UsageError(f"--sync-period must be a whole number of local steps, 1 or more, found {period}; pass "
                         f"for example --sync-period 4")
    if sync not in PERIODIC_SYNCS and period not in (None, 1):
        raise UsageError(f"--sync-period {period} needs local steps, but --sync {sync} averages every step; pass "
                         f"--sync local-sgd or drop --sync-period")
    if sync == "local-sgd" and period is None:
        raise UsageError("--sync local-sgd needs --sync-period H (local steps between aggregations); pass for "
                         "example --sync-period 4, or --sync adaptive to let the run choose")
    return 1 if sync == DEFAULT_SYNC else period


def with_sync(problem: "Problem", sync: str, period: int | None, staleness: int | None = None) -> "Problem":
    """``problem`` whose replicas combine their updates by ``sync`` every ``period`` steps (``None``: adaptive's rule
    chooses; ``staleness``: ssp's bound, default ``DEFAULT_STALENESS``), sharing its cost tables; bad
    values are refused as usage errors (``check_sync``)."""
    period = check_sync(sync, period, staleness)
    bound = DEFAULT_STALENESS if staleness is None else staleness
    if (sync, period, bound) == (problem.sync, problem.sync_period, problem.sync_staleness):
        return problem
    return _sharing_tables(problem, sync=sync, sync_period=period, sync_staleness=bound)


def with_microbatches(problem: "Problem", microbatches: int) -> "Problem":
    """``problem`` with another micro-batch count, sharing its cost tables (they do not depend on the count)."""
    if microbatches == problem.microbatches:
        return problem
    return _sharing_tables(problem, microbatches=microbatches)


def with_schedule(problem: "Problem", schedule: str) -> "Problem":
    """``problem`` under another schedule, sharing its cost tables (they do not depend on the schedule)."""
    if schedule == problem.schedule:
        return problem
    return _sharing_tables(problem, schedule=schedule)


def host_speed_order(problem: "Problem") -> list[str]:
    """The devices grouped by host, the fastest first within a host and the host with the fastest device first (speed:
    the whole model's profiled forward and backward on the device, measured speed factors left out so a re-plan keeps
    its groups; ties by device id). It depends on what the devices are, never on where the cluster file lists them:
    the order the shape search deals replicas from besides the file's (``search/hybrid.py``) and lists a class-count
    grouping's pipelines in (``search/groups.py``), the polish's restart's, and the first of ``placement_orders``."""
    tables, devices = problem.tables, problem.cluster.devices
    key = {d.id: (tables.fwd_prefix[d.id][-1] + tables.bwd_prefix[d.id][-1], d.id) for d in devices}
    fastest: dict[str, tuple[float, str]] = {}
    for d in devices:
        fastest[d.host] = min(fastest.get(d.host, key[d.id]), key[d.id])
    return [d.id for d in sorted(devices, key=lambda d: (fastest[d.host], key[d.id]))]


def with_device_order(problem: "Problem", ids: Sequence[str]) -> "Problem":
    """``problem`` with its cluster's devices listed in the order ``ids`` (a permutation of them), sharing its cost
    tables: what a placer that reads the file's order (the peers' baselines: stage ``i`` on the ``i``-th device) does
    from another order."""
    if tuple(ids) == problem.cluster.device_ids:
        return problem
    by_id = {d.id: d for d in problem.cluster.devices}
    if sorted(ids) != sorted(by_id):
        raise ValueError(f"a device order must list each of the cluster's devices once, found {list(ids)}")
    return _sharing_tables(problem, cluster=replace(problem.cluster, devices=tuple(by_id[i] for i in ids)))


def by_host_speed(problem: "Problem") -> "Problem":
    """``problem`` with its devices listed in ``host_speed_order``: where a placer that reads the file's order (stage
    ``i`` on the ``i``-th device) starts, so that the same devices listed otherwise give the same start."""
    return with_device_order(problem, host_speed_order(problem))


def placement_orders(problem: "Problem") -> tuple["Problem", ...]:
    """``problem`` under the device orders that the guard's baselines place from: ``by_host_speed`` first, then the
    cluster file's own when it differs. The first depends only on the devices, so permuting the file changes a result
    only where the file's order places strictly better (ties go to the first)."""
    canonical = by_host_speed(problem)
    return (canonical,) if canonical is problem else (canonical, problem)


def _sharing_tables(problem: "Problem", **changes: Any) -> "Problem":
    """``replace(problem, **changes)`` keeping the cost tables ``problem`` built (only for changes they ignore). The
    same changes give the same object again (kept on ``problem``, as its tables are), so a replica's share or a
    schedule asked for many times is built once and its step times are remembered (``Problem.step_times``); another
    cluster (``with_device_order``) is told apart by what it holds (``Cluster.content_key``)."""
    key = tuple(sorted((name, value.content_key if isinstance(value, Cluster) else value)
                       for name, value in changes.items()))
    variants = problem.__dict__.setdefault("_variants", {})
    if key not in variants:
        variants[key] = _built(problem, changes)
    return variants[key]


def _built(problem: "Problem", changes: Mapping[str, Any]) -> "Problem":
    other = replace(problem, **changes)
    other.__dict__["tables"] = problem.tables
    return other


class Placed(tuple):  # type: ignore[type-arg]
    """A ``Partition`` (it *is* the tuple of ``StageSpec``) that also carries top-level plan fields and, for
    replicated stages, the replicas' shares (read back by ``shares_of``; the sync mode is the problem's).

    A placer may return ``Placed(stages, {"solver": {...}})`` where a plain partition would do; every
    caller treats it as a partition, and ``partition()`` copies ``facts`` into the plan (the ILP's
    solver status, bound and gap) and writes ``data_parallel`` from ``cost.shape_of``.
    """

    facts: Mapping[str, Any]
    shares: tuple[int, ...] | None

    def __new__(cls, stages: Partition, facts: Mapping[str, Any] | None = None, *,
                shares: Sequence[int] | None = None) -> "Placed":
        obj = super().__new__(cls, stages)
        obj.facts = dict(facts or {})
        obj.shares = tuple(int(x) for x in shares) if shares else None
        return obj


def with_facts(partition: Partition, facts: Mapping[str, Any], stages: Partition | None = None) -> Placed:
    """``partition`` (or ``stages`` in its place) with ``facts`` added to its own, keeping its shares."""
    return Placed(partition if stages is None else stages, {**facts_of(partition), **facts},
                  shares=getattr(partition, "shares", None))


def facts_of(partition: Partition) -> Mapping[str, Any]:
    """The plan fields a placer attached to ``partition`` (empty for a plain partition)."""
    return getattr(partition, "facts", {})


def validate_settings(microbatches: int, schedule: str, optimizer: str) -> None:
    """Refuse bad run settings as usage errors (exit code 2 at the CLI)."""
    if microbatches < 1:
        raise UsageError(f"--microbatches must be at least 1, found {microbatches}; pass a positive count such as 8")
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise UsageError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_STATES)}")


def cut_bytes(profile: Profile, groups: Sequence[Sequence[str]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes crossing each cut between consecutive ``groups`` (forward activations, backward gradients).

    A value produced in group ``i`` whose last reader (``planner.graph.last_reader``) is in group ``j > i``
    crosses cuts ``i .. j-1``; a difference array makes this one pass over the op graph's nodes.
    """
    graph = op_graph(profile)
    group_of = {name: g for g, names in enumerate(groups) for name in names}
    last = last_reader(graph, group_of)
    fwd = [0] * (len(groups) + 1)
    bwd = [0] * (len(groups) + 1)
    for name, attrs in graph.nodes(data=True):
        start, end = group_of[name], last.get(name, -1)
        if end <= start:
            continue
        fwd[start] += attrs["output_bytes"]
        fwd[end] -= attrs["output_bytes"]
        if attrs["grad"]:
            bwd[start] += attrs["output_bytes"]
            bwd[end] -= attrs["output_bytes"]
    return _prefix(fwd)[: len(groups) - 1], _prefix(bwd)[: len(groups) - 1]


def _prefix(deltas: list[int]) -> tuple[int, ...]:
    out, running = [], 0
    for d in deltas:
        running += d
        out.append(running)
    return tuple(out)


_REPEATED = re.compile(r"^(.*?\.\d+)(\.|$)")


def layer_of(module_path: str) -> str:
    """The top-level repeated module holding an op: ``h.3.attn.c_attn`` -> ``h.3``.

    The shallowest path component followed by an integer index marks a ``ModuleList``/``Sequential``
    entry; ops outside any repeated module (embeddings, heads) belong to their top-level module.
    """
    if not module_path:
        return ""
    match = _REPEATED.match(module_path)
    if match:
        return match.group(1)
    return module_path.split(".")[0]


def build_problem(
    profile: Profile,
    cluster: Cluster,
    *,
    microbatches: int,
    schedule: str,
    optimizer: str = "adam",
    groups: Sequence[Sequence[str]] | None = None,
    speed_factors: Mapping[str, float] | None = None,
    estimate_precision: str | None = None,
    catalog: Mapping[str, DeviceSpec] | None = None,
    corrections: Sequence[tuple[int, int, float]] = (),
    recompute: bool = False,
    drain_every: int | None = None,
) -> Problem:
    """Build the placers' problem: blocks with per-device-type times, cut bytes, the cluster and settings.

    ``groups`` are contiguous runs of the profile's nodes in its order (default: one block per node,
    i.e. op granularity). Device types of the cluster that the profile lacks are estimated with the
    profiler's roofline (``planner.roofline``) and listed in ``Problem.estimated_types``.
    ``estimate_precision`` (``fp32``, ``tf32``, ``bf16``; default ``None``: the profiled dtype) is the
    precision those estimates assume; when given, the profile's own ``estimated`` entries of catalog types
    are re-estimated in it too (measured times are never touched). ``corrections`` (``(start, stop, factor)``,
    from the run-time speed fit, ``planner.partition.search.speed``) multiply the times of profile nodes
    ``[start, stop)`` on every device type. ``recompute``: activation recomputation in every stage (``Problem.recompute``):
    each block's backward also pays its forward again. ``drain_every``: an asynchronous schedule's steps between
    pipeline drains (``Problem.drain_every``).
    Work is per node and per device *type*, never per device. ``catalog`` (``planner.formats.catalog.load_catalog``,
    loaded by the caller) is needed only to estimate types the profile did not measure; without it such a
    type is refused with a message that says so.
    """
    check_precision(estimate_precision)
    validate_settings(microbatches, schedule, optimizer)
    factors = _check_speed_factors(cluster, speed_factors or {})
    names = [[n] for n in (node.name for node in profile.nodes)] if groups is None else [list(g) for g in groups]
    _check_groups(profile, names)
    types = sorted({d.type for d in cluster.devices})
    calibration = {t: f for t, f in calibration_factors(profile, cluster).items() if t in types}
    times, estimated = node_times(profile, cluster, types, estimate_precision, calibration, catalog)
    checked = _check_corrections(len(profile.nodes), corrections)
    for start, stop, factor in checked:
        times[start:stop] = [[(f * factor, b * factor) for f, b in row] for row in times[start:stop]]
    if estimated and catalog is None:
        raise PlannerError(f"device type(s) {', '.join(sorted(estimated))} have estimated times; their loss and "
                           f"optimizer-step estimates need the device catalog: pass catalog=load_catalog() (the CLI does)")
    loss = loss_times(profile, types, estimated, catalog or {})
    per_tensor = update_tensor_rates(profile, types, optimizer, estimated)
    if loss and times:
        times[-1] = [(f + loss.get(t, (0.0, 0.0))[0], b + loss.get(t, (0.0, 0.0))[1]) for (f, b), t in zip(times[-1], types)]
    shares = [weight_share(node) for node in profile.nodes]  # before the loss and recomputation, which are input gradient
    weights = [[b * share for _, b in row] for row, share in zip(times, shares)]
    if recompute:  # the forward runs again, inside the backward
        times = [[(f, b + f) for f, b in row] for row in times]
    fwd_cut, bwd_cut = cut_bytes(profile, names)
    layers: dict[str, str] = {}
    blocks, start = [], 0
    for group in names:
        stop = start + len(group)
        blocks.append(_block(profile.nodes[start:stop], times[start:stop], types, layers, weights[start:stop]))
        start = stop
    return Problem(
        blocks=tuple(blocks),
        cut_fwd_bytes=fwd_cut,
        cut_bwd_bytes=bwd_cut,
        cluster=cluster,
        microbatches=microbatches,
        schedule=schedule,
        optimizer=optimizer,
        estimated_types=tuple(sorted(estimated)),
        speed_factors=MappingProxyType(factors),
        calibration=MappingProxyType(calibration),
        corrections=tuple(checked),
        loss_s=MappingProxyType(loss),
        update_s_per_param_byte=MappingProxyType(update_rates(profile, types, optimizer, estimated, catalog or {},
                                                              per_tensor)),
        update_s_per_param_tensor=MappingProxyType(per_tensor),
        version_s_per_param_byte=MappingProxyType(version_rates(profile, types, estimated, catalog or {})),
        split_backward_excess=MappingProxyType(split_backward_excess(profile, types, estimated)),
        recompute=recompute,
        drain_every=check_drain_every(drain_every),
        tied=tied_blocks(profile, names),
    )


def tied_blocks(profile: Profile, groups: Sequence[Sequence[str]]) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """``Problem.tied`` from the profile's ``tied_parameters`` and the blocks' node groups: each shared parameter set
    read by at least two blocks, as ``(bytes, reading blocks)``; entries naming no node of the profile are left out."""
    block_of = {name: b for b, group in enumerate(groups) for name in group}
    out = []
    for entry in profile.extra.get("tied_parameters") or ():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("bytes"), int) or entry["bytes"] <= 0:
            continue
        readers = tuple(sorted({block_of[n] for n in entry.get("nodes") or () if n in block_of}))
        if len(readers) > 1:
            out.append((int(entry["bytes"]), readers))
    return tuple(out)


def check_drain_every(drain_every: int | None) -> int | None:
    """``drain_every`` as given, refused as a usage error unless ``None`` or a whole number of steps >= 1."""
    if not valid_drain_every(drain_every):
        raise UsageError(f"the steps between pipeline drains (--round-steps) must be a whole number >= 1, found "
                         f"{drain_every!r}")
    return drain_every


def _check_corrections(count: int, corrections: Sequence[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    out = []
    for start, stop, factor in corrections:
        if not (0 <= start < stop <= count) or not (0 < factor < float("inf")):
            raise PlannerError(f"a cost correction must cover profile nodes [start, stop) within 0..{count} with a positive "
                               f"finite factor, found ({start}, {stop}, {factor!r}); the rebalancing state does not "
                               f"match this profile: delete the checkpoint to start over")
        out.append((int(start), int(stop), float(factor)))
    return out


def _check_speed_factors(cluster: Cluster, factors: Mapping[str, float]) -> dict[str, float]:
    ids = set(cluster.device_ids)
    for device_id, factor in sorted(factors.items()):
        if device_id not in ids:
            raise PlannerError(f"speed factor given for device {device_id!r}, which is not in cluster "
                               f"{cluster.name!r} (devices: {', '.join(cluster.device_ids)})")
        if not (factor > 0 and factor < float("inf")):
            raise PlannerError(f"speed factor of device {device_id!r} must be a positive finite number, found {factor!r}")
    return dict(sorted(factors.items()))


def _check_groups(profile: Profile, groups: list[list[str]]) -> None:
    """Groups must be non-empty and, concatenated, list every profile node once in profile order."""
    position = 0
    for g, group in enumerate(groups):
        if not group:
            raise PlannerError(f"group {g} is empty; every group must hold at least one node")
        for name in group:
            expected = profile.nodes[position].name if position < len(profile.nodes) else None
            if name != expected:
                raise PlannerError(
                    f"group {g} lists node {name!r} where the profile's order has {expected!r}; groups must be "
                    f"contiguous runs of the profile's nodes, in profile order, covering each node exactly once"
                )
            position += 1
    if position != len(profile.nodes):
        raise PlannerError(f"groups cover {position} of the profile's {len(profile.nodes)} nodes; "
                           f"the first left out is {profile.nodes[position].name!r}")


def _block(nodes: Sequence[Node], times: Sequence[Sequence[tuple[float, float]]], types: Sequence[str],
           layer_cache: dict[str, str], weights: Sequence[Sequence[float]]) -> Block:
    """Sum a group's nodes; ``layer_cache`` memoises ``layer_of`` (module paths repeat across nodes)."""
    name = nodes[0].name if len(nodes) == 1 else f"{nodes[0].name}..{nodes[-1].name}"
    if len(nodes) == 1:
        time_s = dict(zip(types, times[0]))
    else:
        time_s = {t: (sum(row[k][0] for row in times), sum(row[k][1] for row in times)) for k, t in enumerate(types)}
    paths = {node.module_path for node in nodes}
    for path in paths:  # not `paths - layer_cache.keys()`: that copies every cached key per call
        if path not in layer_cache:
            layer_cache[path] = layer_of(path)
    return Block(
        name=name,
        nodes=tuple(node.name for node in nodes),
        param_bytes=sum(node.param_bytes for node in nodes),
        param_tensors=sum(len(node.params) for node in nodes if node.param_bytes),
        saved_bytes=sum(node.saved_bytes for node in nodes),
        time_s=MappingProxyType(time_s),
        layers=tuple(sorted({layer_cache[path] for path in paths} - {""})),
        weight_s=MappingProxyType({t: sum(row[k] for row in weights) for k, t in enumerate(types)}),
    )
