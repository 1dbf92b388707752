"""The plan file (docs/formats.md): stages, their devices and nodes, and the prediction.

Binding: ``schema_version``, ``method``, ``schedule``, ``microbatches``, ``stages`` (``index``,
``device``, ``nodes``) and ``predicted`` (``step_time_s`` and per device ``busy_s``, ``idle_s``,
``peak_memory_bytes``). Everything else (solver status, refine rounds, the embedded cluster, the
profile's path and digest, per-stage costs) is carried in ``extra`` fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from planner.formats._validate import Checker
from planner.formats.jsonio import read_document, to_plain, write_json_atomic

SCHEMA_VERSION = 1
ZERO_BUBBLE_SCHEDULES = ("zb-h1", "zb-planned", "zb-h2", "zbv", "dualpipev")
"""Schedules that split each backward into its input gradient (I) and its weight gradient (W) and fill the bubble
with W's (Qi et al., 2024; docs/zero-bubble.md): torch's ZB1P order on one stage per device, an order the planner
generates from the stages' F, I and W times within the same memory (recorded in the plan's ``schedule_order``),
the paper's ZB-H2 pattern, which holds ``2p - 1`` micro-batches on every stage to leave less bubble, ZB-V
(torch's ``ScheduleZBVZeroBubble``), two stages per device in a V, and DualPipeV (torch's ``ScheduleDualPipeV``) on
the same V, which splits only the fill's and the drain's backwards."""
V_SCHEDULES = ("zb-planned", "zbv", "dualpipev")
"""Schedules that may put two stages on each of the ``p`` devices in a V (or one on each): stage ``s`` on device ``s``
for ``s < p`` and on device ``2p - 1 - s`` after, so the first device holds the first and the last stage (torch's
``style="v"``). ``zbv`` runs ZB-V's order there, ``dualpipev`` DualPipeV's, ``zb-planned`` its own order generated
for the V."""
GENERATED_ORDER_SCHEDULES = ("zb-planned",)
"""Zero-bubble schedules whose order depends on the stages' times: a plan under them must carry its
``schedule_order``; the others have a fixed pattern (``planner.partition.sim.schedules.device_orders``)."""
FLUSHING_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b") + ZERO_BUBBLE_SCHEDULES
"""Schedules that finish every step's backwards before its optimizer step (torch.distributed.pipelining's)."""
SCHEDULE_RUNTIME_SCHEDULES = ("interleaved-1f1b",) + ZERO_BUBBLE_SCHEDULES
"""Schedules torch runs through its ``_PipelineScheduleRuntime`` (an action list per rank, each send and receive an
action of its own; ``ScheduleInterleaved1F1B`` is one too): their passes cost the cluster's
``schedule_runtime_pass_overhead_s`` (``Cluster.pass_overhead_for``)."""
ASYNC_SCHEDULES = ("async-1f1b", "2bw")
"""Seed 000's schedules (docs/async.md): 1F1B with no flush between steps, weight stashing; ``2bw`` pins each step's
forwards to the weights one update old (PipeDream-2BW)."""
SCHEDULES = FLUSHING_SCHEDULES + ASYNC_SCHEDULES
ASYNC_CORRECTIONS = ("predict", "none")
"""``async.correction``: weight prediction on top of weight stashing (the default), or stashing alone."""
DEFAULT_ASYNC_WARMUP = 50
"""``async.warmup`` of a plan ``plan partition`` makes: the first steps an asynchronous schedule runs synchronously
(each step drained, as 1F1B) before its steps overlap (docs/async.md, "The synchronous warm-up"). A plan without the
field has none."""
SYNC_MODES = ("ssgd", "local-sgd", "adaptive", "bsp", "asp", "ssp", "dasp")
"""``data_parallel.sync`` values the runtime runs (docs/sync.md): gradients averaged every step; parameters
averaged every ``period`` local steps; the adaptive interval (docs/sync.md) with its correction and prioritised
chunks; and through a parameter server rank: bulk-synchronous, asynchronous, stale-synchronous and DASP's
dynamic sync/async states."""
SERVER_SYNCS = ("bsp", "asp", "ssp", "dasp")
"""Sync modes that run the replicas (of the whole model) against a parameter server rank (docs/sync.md)."""
STALENESS_SYNCS = ("ssp",)
"""Sync modes with a staleness bound (``data_parallel.staleness``): ssp's S."""
DEFAULT_STALENESS = 3
DEFAULT_SYNC = "ssgd"
"""What a plan with replicas and no ``data_parallel.sync`` means: gradients averaged every step."""
PERIODIC_SYNCS = ("local-sgd", "adaptive")
"""Sync modes that take local steps between aggregations (``data_parallel.period``)."""
RECOMPUTE_VALUES = ("none", "full")
"""A stage's ``recompute`` (design.md section 5): keep what its ops save for the backward (``none``, the default when
absent), or keep only its input per micro-batch and run its forward again before each backward (``full``). The
contract also allows a list of node names; this version refuses one in one line (docs/formats.md)."""


def even_shares(microbatches: int, degree: int) -> tuple[int, ...]:
    """``microbatches`` split over ``degree`` replicas as evenly as possible, the first ones taking the rest (what a
    plan with replicas and no ``data_parallel.microbatches`` means)."""
    base, rest = divmod(microbatches, degree)
    return tuple(base + (1 if r < rest else 0) for r in range(degree))


@dataclass(frozen=True)
class ParallelShape:
    """A plan's parallel layout, read once from its stages and ``data_parallel`` (``Plan.shape``): every command
    that needs the degree, the shares or the sync mode asks this value, as torchtitan's ``ParallelDims`` owns
    every degree of its mesh."""

    replicas: tuple[tuple[str, ...], ...]
    """Per stage: every device holding it, the stage's ``device`` first."""
    shares: tuple[int, ...]
    """Per replica pipeline: its micro-batches per step (``(microbatches,)`` for a pure pipeline)."""
    sync: str = DEFAULT_SYNC
    """How replicas synchronise (``data_parallel.sync``; meaningless for a pure pipeline)."""
    period: int = 1
    """Local steps between aggregations (``data_parallel.period``; ``adaptive``: the first interval, which the
    run then adapts; 1 for ``ssgd``)."""
    staleness: int = DEFAULT_STALENESS
    """How many steps the fastest worker may be ahead of the slowest (``data_parallel.staleness``; ``ssp`` only)."""

    @property
    def served(self) -> bool:
        """True when the replicas train against a parameter server rank (``SERVER_SYNCS``)."""
        return self.replicated and self.sync in SERVER_SYNCS

    @property
    def degree(self) -> int:
        """Replica pipelines (1: a pure pipeline)."""
        return len(self.replicas[0])

    @property
    def replicated(self) -> bool:
        return self.degree > 1

    def holders(self) -> list[str]:
        """Per stage, who holds it: its device, or for replicas the devices and the shares (``a+b@[2, 2]``)."""
        tag = f"@{list(self.shares)}" if self.replicated else ""
        return ["+".join(devices) + tag for devices in self.replicas]

    def key(self) -> tuple[str, ...]:
        """The layout's identity, per stage: its holders, and for replicas the sync mode (``a+b@[2, 2]/ssgd``). With
        each stage's nodes it is what the rebalancer and a resume compare plans by (``replan.stage_keys``)."""
        tag = f"/{self.sync_text()}" if self.replicated else ""
        return tuple(holder + tag for holder in self.holders())

    def sync_text(self) -> str:
        """``ssgd``, ``local-sgd every 4 steps``, ``adaptive from 4 steps``, ``ssp staleness 3``."""
        if self.sync in STALENESS_SYNCS:
            return f"{self.sync} staleness {self.staleness}"
        if self.sync not in PERIODIC_SYNCS:
            return self.sync
        return f"{self.sync} {'every' if self.sync == 'local-sgd' else 'from'} {self.period} step{'s' if self.period != 1 else ''}"

    def data_parallel(self) -> dict[str, Any]:
        """The plan's ``data_parallel`` field for this layout (``period`` only for the modes with local steps)."""
        return {"degree": self.degree, "microbatches": list(self.shares), "sync": self.sync,
                **({"period": self.period} if self.sync in PERIODIC_SYNCS else {}),
                **({"staleness": self.staleness} if self.sync in STALENESS_SYNCS else {})}

    def stages_text(self) -> str:
        """``2 stages``."""
        return f"{len(self.replicas)} stage{'s' if len(self.replicas) != 1 else ''}"

    def replicas_text(self) -> str:
        """``4 replicas (data parallel; micro-batches 2/2/2/2, ssgd)``, or ``""`` for a pure pipeline."""
        if not self.replicated:
            return ""
        return (f"{self.degree} replicas (data parallel; micro-batches "
                f"{'/'.join(str(x) for x in self.shares)}, {self.sync_text()})")

    def describe(self) -> str:
        """``2 stages x 4 replicas (data parallel; micro-batches 2/2/2/2, ssgd)``, or ``2 stages``."""
        return " x ".join(part for part in (self.stages_text(), self.replicas_text()) if part)


@dataclass(frozen=True)
class Stage:
    index: int
    device: str
    nodes: tuple[str, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Per-stage figures (compute_s, transfer_s, memory_bytes, ...)."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"index": self.index, "device": self.device, "nodes": list(self.nodes)}
        data.update(self.extra)
        return data


@dataclass(frozen=True)
class Plan:
    method: str
    schedule: str
    microbatches: int
    stages: tuple[Stage, ...]
    predicted: Mapping[str, Any]
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Top-level fields such as ``profile``, ``cluster``, ``optimizer``, ``solver``, ``refine``."""

    @property
    def step_time_s(self) -> float:
        return float(self.predicted["step_time_s"])

    @property
    def peak_memory_bytes(self) -> int | None:
        """Largest predicted per-device peak memory, else the largest stage memory, else ``None``."""
        devices = self.predicted.get("devices")
        if isinstance(devices, Mapping):
            peaks = _numbers(d.get("peak_memory_bytes") for d in devices.values() if isinstance(d, Mapping))
            if peaks:
                return int(max(peaks))
        stage_mem = _numbers(s.extra.get("memory_bytes") for s in self.stages)
        return int(max(stage_mem)) if stage_mem else None

    def replicas(self) -> list[list[str]]:
        """Per stage: every device holding it, its ``device`` first (``[device]`` without ``replicas``)."""
        return [[str(d) for d in (s.extra.get("replicas") or [s.device])] for s in self.stages]

    def shares(self) -> tuple[int, ...] | None:
        """``data_parallel.microbatches`` (each replica's micro-batches per step), or ``None`` when absent."""
        dp = self.extra.get("data_parallel")
        shares = dp.get("microbatches") if isinstance(dp, Mapping) else None
        return tuple(int(x) for x in shares) if shares else None

    def replica_shares(self) -> tuple[int, ...]:
        """Each replica's micro-batches per step: ``shares()``, else an even split (``(microbatches,)`` without replicas)."""
        return self.shares() or even_shares(self.microbatches, len(self.replicas()[0]))

    def shape(self) -> ParallelShape:
        """The parallel layout (replicas, shares, sync and its period), validated when the plan was read."""
        dp = self.extra.get("data_parallel")
        dp = dp if isinstance(dp, Mapping) else {}
        return ParallelShape(tuple(tuple(r) for r in self.replicas()), self.replica_shares(),
                             str(dp.get("sync") or DEFAULT_SYNC), int(dp.get("period") or 1),
                             int(dp.get("staleness", DEFAULT_STALENESS)))

    @property
    def drain_every(self) -> int | None:
        """An asynchronous plan's steps between pipeline drains that its prediction assumed (``async.drain_every``,
        validated when the plan was read); ``None``: the steady state."""
        record = self.extra.get("async")
        value = record.get("drain_every") if isinstance(record, Mapping) else None
        return int(value) if value is not None else None

    @property
    def async_warmup(self) -> int:
        """An asynchronous plan's synchronous warm-up: the steps before which every step drains (``async.warmup``,
        validated when the plan was read; 0 when absent)."""
        record = self.extra.get("async")
        value = record.get("warmup") if isinstance(record, Mapping) else None
        return int(value) if value is not None else 0

    def replica_devices(self) -> list[str]:
        """Every device once, replica by replica (replica 0's stages in order, then replica 1's, ...): the rank
        order of ``plan run`` and the device rows of ``plan show``."""
        replicas = self.replicas()
        return list(dict.fromkeys(devices[r] for r in range(len(replicas[0])) for devices in replicas))

    def recomputed(self) -> tuple[bool, ...]:
        """Per stage: whether it recomputes its activations (``recompute: "full"``; a plan of an earlier version may
        say ``recompute: true`` at the top level instead, meaning every stage)."""
        every = self.extra.get("recompute") is True
        return tuple(every or s.extra.get("recompute") == "full" for s in self.stages)

    def recompute_mode(self) -> bool | str:
        """How to plan this plan's model again: ``False`` (no stage recomputes), ``True`` (every stage does) or
        ``"auto"`` (some do: each stage only where it needs it, ``planner.partition.partition``)."""
        flags = self.recomputed()
        return all(flags) or ("auto" if any(flags) else False)

    def assignment(self) -> dict[str, int]:
        """Node name -> stage index."""
        return {name: stage.index for stage in self.stages for name in stage.nodes}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "method": self.method,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "stages": [s.to_dict() for s in self.stages],
            "predicted": to_plain(self.predicted),
        }
        data.update(to_plain(self.extra))
        return data


def plan_from_dict(data: dict[str, Any], what: str = "plan") -> Plan:
    """Validate a plan document's shape (not yet against a profile; see ``planner.app.check``)."""
    check = Checker(what)
    check.schema_version(data, SCHEMA_VERSION)
    schedule = check.get(data, "schedule", str)
    if schedule not in SCHEDULES:
        check.fail("schedule", f"one of {', '.join(SCHEDULES)}", schedule)
    microbatches = check.get(data, "microbatches", int)
    if microbatches < 1:
        check.fail("microbatches", "at least 1", microbatches)
    raw_stages = check.get(data, "stages", list)
    if not raw_stages:
        check.fail("stages", "a non-empty list", raw_stages)
    stages = []
    for i, raw in enumerate(raw_stages):
        where = f"stages[{i}]"
        if not isinstance(raw, dict):
            check.fail(where, "an object", raw)
        index = check.get(raw, "index", int, f"{where}.index")
        if index != i:
            check.fail(f"{where}.index", f"{i} (stages listed in order)", index)
        nodes = check.get(raw, "nodes", list, f"{where}.nodes")
        if not all(isinstance(n, str) for n in nodes):
            check.fail(f"{where}.nodes", "a list of node names", nodes)
        if raw.get("recompute", "none") not in RECOMPUTE_VALUES:
            check.fail(f"{where}.recompute", '"none" or "full" (a list of node names is not built in this version)',
                       raw["recompute"], "use \"full\" for the whole stage, or re-partition with --recompute auto")
        stages.append(Stage(
            index=index,
            device=check.get(raw, "device", str, f"{where}.device"),
            nodes=tuple(nodes),
            extra=MappingProxyType({k: v for k, v in raw.items() if k not in ("index", "device", "nodes")}),
        ))
    if not isinstance(data.get("recompute", False), bool):
        check.fail("recompute", "true or false (earlier versions' every-stage flag; now each stage's recompute)",
                   data["recompute"], "drop it and set each stage's recompute to \"full\" or \"none\"")
    _check_data_parallel(check, data, microbatches, stages)
    _check_schedule_order(check, data, schedule, len(stages))
    _check_async(check, data)
    predicted = check.get(data, "predicted", dict)
    check.get(predicted, "step_time_s", float, "predicted.step_time_s")
    extra = {k: v for k, v in data.items()
             if k not in ("schema_version", "method", "schedule", "microbatches", "stages", "predicted")}
    return Plan(
        method=check.get(data, "method", str),
        schedule=schedule,
        microbatches=microbatches,
        stages=tuple(stages),
        predicted=MappingProxyType(predicted),
        extra=MappingProxyType(extra),
    )


ACTION = re.compile(r"^(\d+)([FBIW])(\d+)$")
"""One pass of ``schedule_order`` in torch's action notation: stage, kind (forward, whole backward, its input or
weight half), micro-batch."""


def _check_schedule_order(check: Checker, data: Mapping[str, Any], schedule: str, num_stages: int) -> None:
    """``schedule_order``, when present: per rank (a whole number as a string), a list of passes of stages the plan has;
    only a zero-bubble schedule runs one (whether the passes make a valid schedule is torch's runtime's check)."""
    if "schedule_order" not in data:
        return
    order = check.get(data, "schedule_order", dict)
    if schedule not in ZERO_BUBBLE_SCHEDULES:
        check.fail("schedule_order", f"no order for schedule {schedule!r} (only {', '.join(ZERO_BUBBLE_SCHEDULES)} run "
                   f"one)", "an order", "drop schedule_order or re-partition with --schedule zb-planned")
    hint = "re-partition with --schedule zb-planned, or fix the order"
    for rank, actions in order.items():
        if not str(rank).isdigit():
            check.fail(f"schedule_order.{rank}", "a rank number as key", rank, hint)
        if not isinstance(actions, list) or not actions:
            check.fail(f"schedule_order.{rank}", "a non-empty list of passes like \"0F1\", \"1I3\", \"1W3\"", actions,
                       hint)
        for i, action in enumerate(actions):
            found = ACTION.match(action) if isinstance(action, str) else None
            if found is None or int(found.group(1)) >= num_stages:
                check.fail(f"schedule_order.{rank}[{i}]", f"a pass like \"0F1\" (stage < {num_stages}, F, B, I or W, "
                           f"micro-batch)", action, hint)


def valid_drain_every(value: Any) -> bool:
    """Whether ``value`` can be ``async.drain_every``: absent (``None``, the steady state) or whole steps >= 1."""
    return value is None or _whole_at_least(value, 1)


def valid_warmup(value: Any) -> bool:
    """Whether ``value`` can be ``async.warmup``: whole steps >= 0."""
    return _whole_at_least(value, 0)


def _whole_at_least(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_async(check: Checker, data: Mapping[str, Any]) -> None:
    """``async``, when present: an object whose ``drain_every``, when present, is a whole number of steps >= 1, and
    whose ``warmup``, when present, one >= 0."""
    record = data.get("async")
    if record is None:
        return
    if not isinstance(record, dict):
        check.fail("async", "an object", record)
    value = record.get("drain_every")
    if not valid_drain_every(value):
        check.fail("async.drain_every", "a whole number of steps >= 1 (or absent: the steady state)", value,
                   "fix it, or re-partition with `plan partition --round-steps N`")
    warmup = record.get("warmup")
    if warmup is not None and not valid_warmup(warmup):
        check.fail("async.warmup", "a whole number of steps >= 0 (or absent: none)", warmup,
                   "fix it, or re-partition with `plan partition --async-warmup N`")


def _check_data_parallel(check: Checker, data: Mapping[str, Any], microbatches: int, stages: list[Stage]) -> None:
    """``data_parallel``, when present, agrees with the stages' replicas: every field a command reads (``degree``,
    ``sync``, the shares) is checked here, once, so ``plan check`` passes only what ``plan run`` runs."""
    if "data_parallel" not in data:
        return
    dp = check.get(data, "data_parallel", dict)
    counts = {len(r) if isinstance(r := s.extra.get("replicas"), list) and r else 1 for s in stages}
    if len(counts) > 1:
        return  # stages of unequal degree: the feasibility rule says so, naming the stages
    degree = counts.pop()
    hint = "fix data_parallel or re-partition with `plan partition --data-parallel N`"
    if "degree" in dp and (not isinstance(dp["degree"], int) or isinstance(dp["degree"], bool) or dp["degree"] != degree):
        check.fail("data_parallel.degree", f"{degree}, the number of replicas every stage lists", dp["degree"], hint)
    if "sync" in dp and dp["sync"] not in SYNC_MODES:
        check.fail("data_parallel.sync", f"one of {', '.join(SYNC_MODES)} (the sync modes plan run has)", dp["sync"], hint)
    if "period" in dp:
        period, sync = dp["period"], dp.get("sync", DEFAULT_SYNC)
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            check.fail("data_parallel.period", "a whole number of local steps between aggregations, 1 or more", period,
                       "fix data_parallel.period or re-partition with `plan partition --sync-period H`")
        elif period != 1 and sync not in PERIODIC_SYNCS:
            check.fail("data_parallel.period", f"1 for sync {sync!r} (local steps are for {' and '.join(PERIODIC_SYNCS)})",
                       period, "set data_parallel.sync to local-sgd or drop the period")
    sync = dp.get("sync", DEFAULT_SYNC)
    if "staleness" in dp:
        staleness = dp["staleness"]
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            check.fail("data_parallel.staleness", "a whole number of steps, 0 or more", staleness,
                       "fix data_parallel.staleness or re-partition with `plan partition --staleness S`")
        elif sync not in STALENESS_SYNCS:
            check.fail("data_parallel.staleness", f"no staleness for sync {sync!r} (it is for "
                       f"{' and '.join(STALENESS_SYNCS)})", staleness, "drop data_parallel.staleness")
    if sync in SERVER_SYNCS and degree > 1 and len(stages) != 1:
        check.fail("data_parallel.sync", f"one stage for {sync!r}: its parameter server serves replicas of the whole "
                   f"model, and a server rank is not a pipeline stage", f"{len(stages)} stages",
                   f"re-partition with `plan partition --sync {sync}` (it makes one stage per replica), or use "
                   f"--sync ssgd for replicated pipelines")
    if "microbatches" in dp:
        shares = dp["microbatches"]
        if (not isinstance(shares, list) or len(shares) != degree
                or not all(isinstance(m, int) and not isinstance(m, bool) and m >= 1 for m in shares)
                or sum(shares) != microbatches):
            check.fail("data_parallel.microbatches", f"{degree} positive whole share(s), one per replica, summing to the "
                       f"plan's {microbatches} micro-batches", shares, hint)


def load_plan(path: str | Path) -> Plan:
    return plan_from_dict(read_document(path, "plan"), f"plan {str(path)!r}")


def save_plan(plan: Plan, path: str | Path) -> Path:
    return write_json_atomic(path, plan.to_dict())



def _numbers(values: Iterable[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
