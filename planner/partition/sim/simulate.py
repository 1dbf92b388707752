"""Simulation of one pipelined training step (forward and backward of every micro-batch).

Resources are the devices and the *directed* links between them. Each device runs its passes in the
fixed order of its schedule (``planner.partition.sim.schedules``), one at a time, each as soon as the device
is free and its input has arrived. A finished forward sends its activations to the next stage's
device, a finished backward sends gradients to the previous stage's device; a transfer of ``n`` bytes
occupies its directed link for ``latency_s + n / bandwidth_Bps`` and transfers on the same link run one
after another in request order (first come, first served). Compute and communication overlap, as they
do with asynchronous point-to-point sends on separate streams. Fixed orders are timed device by device
(``_run_orders``); ``zb-planned``'s generated order picks passes as they become ready, in an event loop whose heap
holds pass completions (``_run_events``). Either way a directed link's requests reach it in time order.
On links marked ``host_copy`` (gloo between CPU processes) the endpoints' processors move the bytes,
so a transfer lengthens the sending and the receiving pass instead of overlapping them. After its last
pass each device steps its optimizer (``SimStage.update_s``). Every pass also pays the runtime's own
per-pass cost, ``Cluster.pass_overhead_for`` the schedule, and per byte it sends or receives across devices,
``Cluster.pass_byte_overhead_s`` (each 0 unless the cluster file gives one).

See docs/simulator.md for the model and what it leaves out.
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass, field
from functools import lru_cache
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

from planner.errors import PlannerError
from planner.formats.cluster import Cluster
from planner.formats.plan import ASYNC_SCHEDULES, GENERATED_ORDER_SCHEDULES
from planner.partition.model.allreduce import allreduce_s
from planner.partition.sim.schedules import (BWD, BWD_INPUT, BWD_WEIGHT, FREES, FWD, UPD, Op, async_orders,
                                             device_orders, inflight_counts, pipeline_layout, planned_patterns,
                                             stage_ranks)

EVENT_KINDS = {FWD: "fwd", "B": "bwd", BWD_INPUT: "bwd_input", BWD_WEIGHT: "bwd_weight"}


@dataclass(frozen=True)
class SimStage:
    """One pipeline stage as the simulator sees it; times and bytes are per micro-batch."""

    device: str
    fwd_s: float
    bwd_s: float
    send_fwd_bytes: int
    """Activations sent to the next stage (0 for the last stage)."""
    send_bwd_bytes: int
    """Gradients sent to the previous stage (0 for the first stage)."""
    static_bytes: int
    """Weights, gradients and optimizer state."""
    activation_bytes: int
    """Bytes kept from a micro-batch's forward until its backward."""
    update_s: float = 0.0
    """The optimizer step over the stage's parameters, once per step after the device's last pass."""
    bwd_weight_s: float = 0.0
    """The weight-gradient part of ``bwd_s`` (zero-bubble schedules run it apart, as ``W``; the rest is ``I``)."""
    split_excess_s: float = 0.0
    """What ``bwd_s`` holds above the backward run whole, fused: a zero-bubble stage's ``I`` and ``W`` run apart pay
    it (``cost.stage_backward_halves`` adds it, shared in proportion); a whole backward ``B`` in its order does not."""
    recompute_bytes: int = 0
    """A recomputing stage: the saved bytes of the one micro-batch whose forward runs again inside a backward (its
    ``activation_bytes`` are then its input only). A device runs one backward at a time, so it holds the largest of
    its stages' (``held_bytes``)."""


def held_bytes(stages: Sequence[SimStage]) -> int:
    """What a device holding ``stages`` keeps whatever the order of its passes: their static bytes, and the largest
    forward any of them recomputes (one backward at a time)."""
    return sum(st.static_bytes for st in stages) + max((st.recompute_bytes for st in stages), default=0)


@dataclass(frozen=True)
class Event:
    """A busy interval of one resource: a device (its id) or a directed link (``"a->b"``)."""

    resource: str
    kind: str
    """``fwd``, ``bwd``, ``bwd_input`` and ``bwd_weight`` (a zero-bubble schedule's halves of a backward),
    ``send_fwd``, ``send_bwd``, ``sync`` (replicas all-reduce; hybrid plans) or ``update``."""
    stage: int
    """The stage that computed, or that sent."""
    microbatch: int
    start_s: float
    end_s: float


BY_TIME = operator.attrgetter("start_s", "end_s")
"""The order of a result's events: by start, then by end (ties keep the order the simulation made them in)."""


@dataclass(frozen=True)
class DeviceStats:
    busy_s: float
    idle_s: float
    peak_memory_bytes: int
    compute_s: float = 0.0
    """Forward and backward passes over the step (``busy_s`` = compute + copy + overhead + update)."""
    copy_s: float = 0.0
    """Moving transfers' bytes itself (host copies: gloo between CPU processes), over the step."""
    overhead_s: float = 0.0
    """The runtime's fixed cost per pass (``cluster.pass_overhead_s``), over the step."""
    update_s: float = 0.0
    """The optimizer step of its stages' parameters."""
    end_s: float = 0.0
    """When its last forward or backward pass ends (before any sync and update)."""
    sync_s: float = 0.0
    """All-reducing its stages' gradients with their replicas (hybrid plans; ``planner.partition.sim.hybrid``)."""


@dataclass(frozen=True)
class SimResult:
    step_time_s: float
    devices: Mapping[str, DeviceStats]
    """Every device that holds a stage, in pipeline order."""
    bubble_fraction: float
    """Total idle time / (devices x step time)."""
    events: tuple[Event, ...]
    """Busy intervals sorted by start time (empty when simulated with ``record_events=False``)."""
    stage_inflight: tuple[int, ...] = ()
    """Per stage: the most micro-batches observed between their forward start and backward end."""
    sync_s: tuple[float, ...] = ()
    """Per stage: seconds its replicas all-reduce their gradients (empty for a pure pipeline)."""
    core_stretch: Mapping[str, float] = field(default_factory=dict)
    """Device -> the factor its times were stretched by because its host's ranks share fewer cores than they are
    (``planner.partition.sim.step``); absent: as profiled."""
    orders: Mapping[str, tuple[Op, ...]] = field(default_factory=dict)
    """Device -> the passes it ran, in its order (a flushing schedule's step; empty for the asynchronous ones):
    ``zb-planned``'s generated order as this simulation planned it, which a plan records
    (``convert.schedule_order``)."""


@dataclass
class _State:
    """Mutable bookkeeping of one simulation run (private; never escapes ``simulate``)."""

    orders: tuple[tuple[Op, ...], ...]
    rank_of_stage: list[int]
    fwd_ready: list[list[float | None]]
    bwd_ready: list[list[float | None]]
    position: list[int]
    free_at: list[float]
    running: list[bool]
    busy_s: list[float]
    parts: list[list[float]]
    """Per rank: compute, copy, overhead, update seconds (their sum is ``busy_s``)."""
    live_bytes: list[int]
    peak_bytes: list[int]
    live_mb: list[int]
    peak_mb: list[int]
    send_fwd_s: list[float]
    """Per stage: seconds its activations occupy the link to the next stage (0: no transfer)."""
    send_bwd_s: list[float]
    """Per stage: seconds its gradients occupy the link to the previous stage (0: no transfer)."""
    copy_fwd_s: list[float]
    """Per stage: seconds of host copies its forward pass pays (sending its output, receiving its input)."""
    copy_bwd_s: list[float]
    """Per stage: the same for its backward pass (gradients out to the previous stage, in from the next)."""
    link_free: dict[tuple[int, int], float]
    heap: list[tuple[float, int, int]]
    pass_overhead_s: float
    """Added to every pass: the runtime's own cost per pass (``Cluster.pass_overhead_for`` the schedule run)."""
    events: list[Event] | None
    seq: int = 0
    marks: list[list[tuple[float, float, list[float]]]] | None = None
    """Asynchronous schedules: per rank, (time, busy seconds, parts) at the end of each of its updates."""
    planner: "_OrderPlanner | None" = None
    """``zb-planned``: picks each device's next pass as the simulation goes (``planned_orders``)."""


def simulate(stages: Sequence[SimStage], cluster: Cluster, schedule: str, microbatches: int,
             *, record_events: bool = True, updates: bool = True, drain_every: int | None = None,
             tied: Sequence[tuple[Sequence[int], int]] = ()) -> SimResult:
    """Simulate one training step of ``stages`` (in pipeline order) under ``schedule``; ``updates=False`` leaves
    out the optimizer steps (``planner.partition.sim.hybrid`` adds them after the replicas' sync).
    ``drain_every``: an asynchronous schedule's steps between pipeline drains (the run's round length: the
    runtime drains at every round end); ``None``, never: the steady state. Flushing schedules ignore it.
    ``tied``: ``(stages, bytes)`` of each tied parameter set read by several stages; under a flushing schedule the
    devices holding them all-reduce its gradient once they are all done, before their updates (``_tied_syncs``, as
    the runtime's ``sync_tied_grads`` does); the asynchronous schedules' engine syncs them otherwise."""
    if microbatches < 1:
        raise PlannerError(f"microbatches must be at least 1, found {microbatches}")
    ranks, chunks = pipeline_layout([st.device for st in stages], schedule)
    for dev in ranks:
        cluster.device(dev)  # raises a clear error for an unknown device
    _check_stages(stages)
    if schedule in ASYNC_SCHEDULES:
        if drain_every is not None:
            return _simulate_async_rounds(stages, cluster, schedule, microbatches, ranks, record_events, drain_every)
        return _simulate_async(stages, cluster, schedule, microbatches, ranks, record_events)
    fixed = planned_orders(stages, cluster, microbatches, tied) if schedule in GENERATED_ORDER_SCHEDULES else None
    state = _initial_state(stages, ranks, chunks, schedule, microbatches, record_events)
    if fixed is not None:
        state.orders = fixed
    _run(state, stages, cluster, ranks, schedule)
    _tied_syncs(state, cluster, ranks, tied)
    return _result(state, stages, ranks, updates)


def _tied_syncs(state: _State, cluster: Cluster, ranks: tuple[str, ...],
                tied: Sequence[tuple[Sequence[int], int]]) -> None:
    """Each tied set's gradient all-reduced over the devices whose stages read it, once the last of them is done
    (``allreduce_s`` on the cluster's links); one set after another, in the given order. The devices wait meanwhile:
    their rows count it as idle, as they count a send."""
    hosts = {d.id: d.host for d in cluster.devices}
    for stage_ids, nbytes in tied:
        group = sorted({state.rank_of_stage[s] for s in stage_ids})
        if len(group) < 2 or nbytes <= 0:
            continue
        devices = [ranks[r] for r in group]
        took = allreduce_s(devices, nbytes, cluster.link, hosts, cluster.nics_per_host, cluster.pass_byte_overhead_s)
        start = max(state.free_at[r] for r in group)
        for r in group:  # a transfer, as a send is: the device waits (idle in its row), it does not compute
            state.free_at[r] = start + took
            if state.events is not None:
                state.events.append(Event(ranks[r], "sync", min(stage_ids), -1, start, start + took))


PLANNED_VARIANTS = ((True, "zb-h1"), (False, "zb-h1"), (True, "1f1b"), (False, "1f1b"))
"""The ``_OrderPlanner`` settings ``planned_orders`` tries on one stage per device: input gradients before forwards
or after, and the in-flight caps of ``zb-h1`` (``p`` micro-batches on every stage) or of ``1f1b`` (``p - s``, less
memory); and, where ``zb-h2``'s order fits every device (``planned_patterns``), its caps (``2p - 1`` on every stage,
``PLANNED_ROOMY_VARIANTS``). On two stages per device in a V the caps are ``zbv``'s (``PLANNED_V_VARIANTS``)."""
PLANNED_ROOMY_VARIANTS = ((True, "zb-h2"), (False, "zb-h2"))
PLANNED_V_VARIANTS = ((True, "zbv"), (False, "zbv"))


def planned_orders(stages: Sequence[SimStage], cluster: Cluster, microbatches: int,
                   tied: Sequence[tuple[Sequence[int], int]] = ()) -> tuple[tuple[Op, ...], ...]:
    """The ``zb-planned`` order of every device (``plan_orders``), remembered: the placers simulate the same stages
    again and again, on copies of one cluster that sub-problems make (``_SameCluster``); a ``plan train`` search on
    resnet_small over 4 T4s asked for 599 different orders 1,576 times."""
    return _remembered_orders(tuple(stages), _SameCluster(cluster), microbatches,
                              tuple((tuple(group), nbytes) for group, nbytes in tied))


class _SameCluster:
    """A cluster compared and hashed by what it holds (``Cluster.content_key``), not by which object it is."""

    __slots__ = ("cluster", "key")

    def __init__(self, cluster: Cluster) -> None:
        self.cluster, self.key = cluster, cluster.content_key

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _SameCluster) and self.key == other.key


@lru_cache(maxsize=1024)
def _remembered_orders(stages: tuple[SimStage, ...], cluster: _SameCluster, microbatches: int,
                       tied: tuple[tuple[tuple[int, ...], int], ...]) -> tuple[tuple[Op, ...], ...]:
    return plan_orders(stages, cluster.cluster, microbatches, tied)


def plan_orders(stages: Sequence[SimStage], cluster: Cluster, microbatches: int,
                tied: Sequence[tuple[Sequence[int], int]] = ()) -> tuple[tuple[Op, ...], ...]:
    """The ``zb-planned`` order of every device: the fastest of the fixed orders for the layout (``zb-h1``'s on one
    stage per device, and ``zb-h2``'s where it fits every device's memory, then 1F1B's; ``zbv``'s on two in a V, and
    ``dualpipev``'s there when there are enough micro-batches: both hold the same micro-batches in flight) and the
    greedy orders ``_OrderPlanner`` builds under each of the layout's variants (first listed wins ties), simulated on
    these stages' own F, I and W times and links, each judged by its step with the optimizer updates and the
    all-reduce of the ``tied`` parameter sets (``simulate``'s: an order that ends the tied stages' devices apart
    makes that all-reduce wait for the later one, which ``simulate`` charges). An order is a
    candidate only when no device's live activations peak above what those fixed orders (``planned_patterns``, which
    the memory rule replays for ``zb-planned``) hold there. The fastest then runs backwards whole where that is
    faster still (``_fused``): where splitting a backward costs more than the fused one (``split_excess_s``), the
    split pays only where the weight gradient has a bubble to fill. What ``simulate`` runs for that schedule, what a plan
    records (``schedule_order``) and what torch's runtime is handed. Deterministic: the same stages give the same
    order."""
    ranks, chunks = pipeline_layout([st.device for st in stages], "zb-planned")
    _check_stages(stages)
    room = [cluster.device(dev).memory_bytes - held_bytes([st for st in stages if st.device == dev]) for dev in ranks]
    patterns = planned_patterns(len(stages), len(ranks), microbatches, room, [st.activation_bytes for st in stages])
    fixed = patterns[0]
    best: tuple[tuple[Op, ...], ...] = ()
    best_step, ceiling = math.inf, [0] * len(ranks)
    for pattern in (*patterns, *(("1f1b",) if chunks == 1 else ())):  # 1F1B's whole backwards hold the least
        state = _initial_state(stages, ranks, chunks, pattern, microbatches, False)
        step = _judged_step(state, stages, cluster, ranks, "zb-planned", tied)  # as torch's schedule runtime runs it
        ceiling = [max(a, b) for a, b in zip(ceiling, state.peak_bytes)]
        if step < best_step - 1e-12:
            best, best_step = device_orders(pattern, len(ranks), chunks, microbatches), step
    variants = PLANNED_V_VARIANTS if chunks == 2 else \
        PLANNED_VARIANTS + (PLANNED_ROOMY_VARIANTS if "zb-h2" in patterns else ())
    for inputs_first, caps in variants:
        state = _initial_state(stages, ranks, chunks, fixed, microbatches, False)
        limits = [0] * len(stages)
        for r, order in enumerate(device_orders(caps, len(ranks), chunks, microbatches)):
            for s, count in inflight_counts(order).items():
                limits[s] = count
        state.orders = tuple([] for _ in ranks)  # type: ignore[assignment]
        state.planner = _OrderPlanner(stages, microbatches, limits, inputs_first, state.rank_of_stage)
        step = _judged_step(state, stages, cluster, ranks, "zb-planned", tied)
        if step < best_step - 1e-12 and all(a <= b for a, b in zip(state.peak_bytes, ceiling)):
            best, best_step = tuple(tuple(order) for order in state.orders), step
    return _fused(best, best_step, stages, cluster, ranks, chunks, fixed, microbatches, tied)


def _judged_step(state: _State, stages: Sequence[SimStage], cluster: Cluster, ranks: tuple[str, ...], schedule: str,
                 tied: Sequence[tuple[Sequence[int], int]]) -> float:
    """Run ``state`` to the step's end as ``simulate`` prices it (the passes, the ``tied`` sets' all-reduce, the
    optimizer updates) and return the step: how ``planned_orders`` and ``_fused`` judge a candidate order."""
    _run(state, stages, cluster, ranks, schedule)
    _tied_syncs(state, cluster, ranks, tied)
    _updates(state, stages, ranks)
    return max(state.free_at)


def _fused(orders: tuple[tuple[Op, ...], ...], step: float, stages: Sequence[SimStage], cluster: Cluster,
           ranks: tuple[str, ...], chunks: int, pattern: str, microbatches: int,
           tied: Sequence[tuple[Sequence[int], int]]) -> tuple[tuple[Op, ...], ...]:
    """``orders`` with backwards run whole where that is faster: a ``B`` costs the fused backward, less than its
    ``I`` and ``W`` apart (``SimStage.split_excess_s``, and one pass fewer), but sends its input gradient only when
    the weight gradient is done too. Greedy, each kept only when the simulated step (updates included) gets shorter:
    first every ``I`` followed at once by its own ``W`` (nothing to fill between them), then, device by device, all
    of the device's backwards. A whole backward frees its activations no later than its ``W`` did, so no device
    holds more. Deterministic."""
    def timed(candidate: tuple[tuple[Op, ...], ...]) -> float:
        state = _initial_state(stages, ranks, chunks, pattern, microbatches, False)
        state.orders = candidate
        return _judged_step(state, stages, cluster, ranks, "zb-planned", tied)

    def whole(order: Sequence[Op], everywhere: bool) -> tuple[Op, ...]:
        out: list[Op] = []
        joined = set()
        for i, (kind, s, j) in enumerate(order):
            if kind == BWD_WEIGHT and (s, j) in joined:
                continue
            if kind == BWD_INPUT and (everywhere or (i + 1 < len(order) and order[i + 1] == (BWD_WEIGHT, s, j))):
                joined.add((s, j))
                out.append((BWD, s, j))
            else:
                out.append((kind, s, j))
        return tuple(out)

    moves: list[Callable[[tuple[tuple[Op, ...], ...]], tuple[tuple[Op, ...], ...]]] = [
        lambda now: tuple(whole(order, False) for order in now)]
    moves += [lambda now, r=r: tuple(whole(order, True) if k == r else order for k, order in enumerate(now))
              for r in range(len(ranks))]
    for move in moves:
        candidate = move(orders)
        if candidate != orders and (t := timed(candidate)) < step - 1e-12:
            orders, step = candidate, t
    return orders


class _OrderPlanner:
    """Chooses each device's next pass while the simulation runs (``zb-planned``; docs/zero-bubble.md).

    Greedy list scheduling in the spirit of the zero-bubble paper's heuristic (Qi et al., 2024, section 3.1): when
    its device is free, a stage of the device runs an input gradient whose output gradient has arrived, or a forward
    whose input has arrived while the stage holds fewer micro-batches than its cap (which first, ``inputs_first``;
    between a device's two stages in a V, the later stage first, whose passes the pipeline's end waits for);
    otherwise a held-back weight gradient when one fits before the next known arrival (or nothing is known to come);
    otherwise it waits for the earliest known arrival. Weight gradients fill what would be bubbles. The passes it
    picks become the device's order."""

    def __init__(self, stages: Sequence[SimStage], microbatches: int, caps: Sequence[int], inputs_first: bool,
                 rank_of_stage: Sequence[int]) -> None:
        self.stages, self.m, self.caps, self.inputs_first = stages, microbatches, caps, inputs_first
        n = len(stages)
        self.next_fwd, self.next_input, self.next_weight = [0] * n, [0] * n, [0] * n
        self.local: dict[int, list[int]] = {}
        """Per rank, its stages, the later first."""
        for s in reversed(range(n)):
            self.local.setdefault(rank_of_stage[s], []).append(s)

    def choose(self, state: _State, rank: int, now: float) -> Op | None:
        m = self.m
        known: list[tuple[float, int, int, Op]] = []
        for preference, s in enumerate(self.local[rank]):
            if self.next_input[s] < self.next_fwd[s]:
                ready = state.bwd_ready[s][self.next_input[s]]
                if ready is not None:
                    known.append((ready, 0 if self.inputs_first else 1, preference, (BWD_INPUT, s, self.next_input[s])))
            if self.next_fwd[s] < m and self.next_fwd[s] - self.next_weight[s] < self.caps[s]:
                ready = state.fwd_ready[s][self.next_fwd[s]]
                if ready is not None:
                    known.append((ready, 1 if self.inputs_first else 0, preference, (FWD, s, self.next_fwd[s])))
        waiting = next((s for s in self.local[rank] if self.next_weight[s] < self.next_input[s]), None)
        now_ready = [k for k in known if k[0] <= now]
        pick: Op | None = None
        if now_ready:
            pick = min(now_ready, key=lambda k: (k[1], k[2]))[3]
        elif waiting is not None and (not known or now + self.stages[waiting].bwd_weight_s <= min(k[0] for k in known)):
            pick = (BWD_WEIGHT, waiting, self.next_weight[waiting])
        elif known:
            pick = min(known, key=lambda k: (k[0], k[1], k[2]))[3]
        elif waiting is not None:
            pick = (BWD_WEIGHT, waiting, self.next_weight[waiting])
        if pick is None:
            return None
        counter = {FWD: self.next_fwd, BWD_INPUT: self.next_input, BWD_WEIGHT: self.next_weight}[pick[0]]
        counter[pick[1]] += 1
        return pick


ASYNC_WARMUP_STEPS = 1
"""Updates an asynchronous simulation leaves out at each end (the fill, and the drain after its last step)."""
ASYNC_MEASURED_STEPS = 4
"""Steps of the steady state an asynchronous simulation measures between them."""


def _simulate_async(stages: Sequence[SimStage], cluster: Cluster, schedule: str, microbatches: int,
                    ranks: tuple[str, ...], record_events: bool) -> SimResult:
    """Seed 000's schedules: ``async_orders`` over several steps with no flush, optimizer steps in the order. Each
    device's figures are taken between the end of its update ``a = p + ASYNC_WARMUP_STEPS - 1`` and of update
    ``a + ASYNC_MEASURED_STEPS`` and divided by the step count: the steady state, fill and drain left out; the step
    time is the slowest device's. Peak memory is the run's (stashed weight versions are in ``static_bytes``,
    ``planner.partition.model.cost.stage_stash_bytes_t``)."""
    p = len(ranks)
    first = p + ASYNC_WARMUP_STEPS - 1
    steps = first + ASYNC_MEASURED_STEPS + 1 + ASYNC_WARMUP_STEPS
    state = _async_state(stages, cluster, schedule, microbatches, ranks, record_events, steps)
    n = ASYNC_MEASURED_STEPS
    spans = [(marks[first], marks[first + n]) for marks in state.marks or ()]
    step = max((b[0] - a[0]) / n for a, b in spans)
    return _async_result(state, stages, ranks, step, spans, n)


def _simulate_async_rounds(stages: Sequence[SimStage], cluster: Cluster, schedule: str, microbatches: int,
                           ranks: tuple[str, ...], record_events: bool, drain_every: int) -> SimResult:
    """An asynchronous schedule run in rounds of ``drain_every`` steps, each from an empty pipeline to a drained
    one (``plan run`` drains at every round end, where evaluation, rebalancing and checkpoints act): the mean step
    is one round's makespan over its steps, so the fill and the drain are paid once per round. With one step per
    round it is 1F1B's flushing step; as rounds grow it tends to the steady state (``_simulate_async``)."""
    if drain_every < 1:
        raise PlannerError(f"drain_every must be at least 1 step, found {drain_every}")
    state = _async_state(stages, cluster, schedule, microbatches, ranks, record_events, drain_every)
    start = (0.0, 0.0, [0.0] * len(state.parts[0]))
    spans = [(start, marks[-1]) for marks in state.marks or ()]
    step = max(b[0] for _, b in spans) / drain_every
    return _async_result(state, stages, ranks, step, spans, drain_every)


def _async_state(stages: Sequence[SimStage], cluster: Cluster, schedule: str, microbatches: int,
                 ranks: tuple[str, ...], record_events: bool, steps: int) -> _State:
    """``steps`` steps of ``async_orders`` simulated from an empty pipeline, each device's clock marked at its
    updates."""
    state = _initial_state(stages, ranks, 1, "1f1b", steps * microbatches, record_events)
    state.orders = async_orders(len(ranks), microbatches, steps)
    state.marks = [[] for _ in ranks]
    _run(state, stages, cluster, ranks, schedule)
    return state


Mark = tuple[float, float, list[float]]


def _async_result(state: _State, stages: Sequence[SimStage], ranks: tuple[str, ...], step: float,
                  spans: Sequence[tuple[Mark, Mark]], n: int) -> SimResult:
    """Per-device figures of an asynchronous simulation: busy time and its parts between each device's two marks,
    over ``n`` steps; the step ``step``; peak memory the whole run's."""
    p = len(ranks)
    static = _held_by_rank(state, stages, p)
    devices = {}
    for r, dev in enumerate(ranks):
        (_, busy_a, parts_a), (_, busy_b, parts_b) = spans[r]
        busy = (busy_b - busy_a) / n
        parts = [(b - a) / n for a, b in zip(parts_a, parts_b)]
        devices[dev] = DeviceStats(busy_s=busy, idle_s=max(step - busy, 0.0), peak_memory_bytes=static[r] + state.peak_bytes[r],
                                   compute_s=parts[0], copy_s=parts[1], overhead_s=parts[2], update_s=parts[3],
                                   end_s=step)
    idle = sum(d.idle_s for d in devices.values())
    events = tuple(sorted(state.events, key=BY_TIME)) if state.events is not None else ()
    return SimResult(step_time_s=step, devices=MappingProxyType(devices),
                     bubble_fraction=idle / (p * step) if step > 0 else 0.0, events=events,
                     stage_inflight=tuple(state.peak_mb))


def _run(state: _State, stages: Sequence[SimStage], cluster: Cluster, ranks: tuple[str, ...], schedule: str) -> None:
    """Run ``state`` to the end (fixed orders: ``_run_orders``; a planned order: the event loop); raise when a device
    is left with passes it cannot start."""
    state.pass_overhead_s = cluster.pass_overhead_for(schedule)
    _transfer_times(state, stages, cluster)
    if state.planner is None:
        _run_orders(state, stages, ranks)
        expected = [len(order) for order in state.orders]
    else:
        _run_events(state, stages, ranks)  # a planned order: F, I and W per micro-batch of each stage the device holds
        expected = [3 * len(state.fwd_ready[0]) * state.rank_of_stage.count(r) for r in range(len(ranks))]
    stuck = [ranks[r] for r in range(len(ranks)) if state.position[r] < expected[r]]
    if stuck:
        raise PlannerError(f"schedule {schedule!r} deadlocked with {len(state.fwd_ready[0])} micro-batches on "
                           f"{len(ranks)} devices (stuck: {', '.join(stuck)}); the schedule's order is wrong for this "
                           f"case: report it with the plan, and meanwhile use another micro-batch count or schedule")


def _run_events(state: _State, stages: Sequence[SimStage], ranks: tuple[str, ...]) -> None:
    """The event loop: pass completions in time order from the heap, each deciding what starts next."""
    for rank in range(len(ranks)):
        _try_start(state, stages, ranks, rank, 0.0)
    while state.heap:
        now, _, rank = heapq.heappop(state.heap)
        _finish(state, stages, ranks, rank, now)


def _run_orders(state: _State, stages: Sequence[SimStage], ranks: tuple[str, ...]) -> None:
    """The event loop's result for fixed orders, without a queue of events: each device runs its passes in order,
    each from ``max(input arrival, device free)``, so a device's passes can be timed one after another as far as their
    inputs are known, and the devices swept until none moves. The same floats as the event loop (``_try_start``,
    ``_finish``): an idle device's next pass is never ready (it would have started), so the loop's ``now`` never
    decides a start; a directed link's sends all come from one device, in its order, which is their order in time;
    a device's memory changes in the order of its own passes. The hottest code of every placer, so it is written
    for speed (docs/simulator.md, "Speed"). The planned order (``_OrderPlanner``) picks passes by the time they run,
    so it keeps the event loop."""
    orders, position, free_at, busy_s, parts_of = state.orders, state.position, state.free_at, state.busy_s, state.parts
    fwd_ready, bwd_ready, send_fwd_s, send_bwd_s = state.fwd_ready, state.bwd_ready, state.send_fwd_s, state.send_bwd_s
    rank_of_stage, p = state.rank_of_stage, len(orders)
    link_free = [0.0] * (p * p)  # the directed link a -> b's next free time, at a * p + b
    live_bytes, peak_bytes, live_mb, peak_mb = state.live_bytes, state.peak_bytes, state.live_mb, state.peak_mb
    copy_fwd_s, copy_bwd_s, overhead, events = state.copy_fwd_s, state.copy_bwd_s, state.pass_overhead_s, state.events
    last = len(stages) - 1
    moved = True
    while moved:
        moved = False
        for rank, order in enumerate(orders):
            i, n = position[rank], len(order)
            if i == n:
                continue
            free, busy, parts = free_at[rank], busy_s[rank], parts_of[rank]
            start_i = i
            while i < n:
                kind, s, j = order[i]
                stage = stages[s]
                if kind == FWD:
                    ready = fwd_ready[s][j]
                    if ready is None:
                        break
                    compute, copy = stage.fwd_s, copy_fwd_s[s]
                    live = live_bytes[rank] + stage.activation_bytes
                    live_bytes[rank] = live
                    if live > peak_bytes[rank]:
                        peak_bytes[rank] = live
                    in_flight = live_mb[s] + 1
                    live_mb[s] = in_flight
                    if in_flight > peak_mb[s]:
                        peak_mb[s] = in_flight
                elif kind == UPD:
                    end = free + stage.update_s
                    busy += stage.update_s
                    parts[3] += stage.update_s
                    if events is not None and stage.update_s > 0:
                        events.append(Event(ranks[rank], "update", s, -1, free, end))
                    free = end
                    if state.marks is not None:
                        state.marks[rank].append((end, busy, list(parts)))
                    i += 1
                    continue
                elif kind == BWD_WEIGHT:
                    ready = free
                    compute, copy = stage.bwd_weight_s, 0.0
                else:
                    ready = bwd_ready[s][j]
                    if ready is None:
                        break
                    compute = stage.bwd_s - (stage.bwd_weight_s if kind == BWD_INPUT else stage.split_excess_s)
                    copy = copy_bwd_s[s]
                start = ready if ready > free else free
                duration = overhead + compute + copy
                end = start + duration
                busy += duration
                parts[0] += compute
                parts[1] += copy
                parts[2] += overhead
                if events is not None:
                    events.append(Event(ranks[rank], EVENT_KINDS[kind], s, j, start, end))
                free = end
                i += 1
                if kind == FWD:
                    if s == last:
                        bwd_ready[s][j] = end
                        continue
                    to, took = s + 1, send_fwd_s[s]
                    arrivals = fwd_ready[to]
                else:
                    if kind in FREES:
                        live_bytes[rank] -= stage.activation_bytes
                        live_mb[s] -= 1
                    if s == 0 or kind == BWD_WEIGHT:
                        continue
                    to, took = s - 1, send_bwd_s[s]
                    arrivals = bwd_ready[to]
                if took <= 0:
                    arrivals[j] = end
                    continue
                # ``_send`` inline (the hottest call): the directed link's next free time, then the arrival
                link = rank * p + rank_of_stage[to]
                at = link_free[link]
                sent = end if end >= at else at
                arrivals[j] = link_free[link] = sent + took
                if events is not None:
                    events.append(Event(f"{ranks[rank]}->{ranks[rank_of_stage[to]]}",
                                        "send_fwd" if to > s else "send_bwd", s, j, sent, sent + took))
            if i > start_i:
                position[rank], free_at[rank], busy_s[rank] = i, free, busy
                moved = True


def _held_by_rank(state: _State, stages: Sequence[SimStage], p: int) -> list[int]:
    """``held_bytes`` of each of the ``p`` ranks' stages."""
    return [held_bytes([st for s, st in enumerate(stages) if state.rank_of_stage[s] == r]) for r in range(p)]


def _check_stages(stages: Sequence[SimStage]) -> None:
    """Times must be finite and non-negative, byte counts non-negative."""
    for s, stage in enumerate(stages):
        values = (stage.fwd_s, stage.bwd_s, stage.send_fwd_bytes, stage.send_bwd_bytes, stage.static_bytes,
                  stage.activation_bytes, stage.update_s, stage.bwd_weight_s, stage.split_excess_s,
                  stage.recompute_bytes)
        if min(values) >= 0 and sum(values) < math.inf and \
                stage.bwd_s >= max(stage.bwd_weight_s, stage.split_excess_s):
            continue  # the common case, at once (a NaN makes the sum fail); otherwise say which field is wrong
        for name in ("fwd_s", "bwd_s", "send_fwd_bytes", "send_bwd_bytes", "static_bytes", "activation_bytes",
                     "update_s", "bwd_weight_s", "split_excess_s", "recompute_bytes"):
            value = getattr(stage, name)
            if not 0 <= value < float("inf"):  # also false for NaN
                raise PlannerError(f"stage {s} has {name} = {value!r}; expected a finite non-negative number")
        if stage.bwd_weight_s > stage.bwd_s:
            raise PlannerError(f"stage {s} has bwd_weight_s = {stage.bwd_weight_s!r} above its bwd_s = "
                               f"{stage.bwd_s!r}; the weight gradient is a part of the backward")
        if stage.split_excess_s > stage.bwd_s:
            raise PlannerError(f"stage {s} has split_excess_s = {stage.split_excess_s!r} above its bwd_s = "
                               f"{stage.bwd_s!r}; the split's excess is a part of the backward")


def _initial_state(stages: Sequence[SimStage], ranks: tuple[str, ...], chunks: int, schedule: str,
                   m: int, record_events: bool) -> _State:
    n, p = len(stages), len(ranks)
    fwd_ready: list[list[float | None]] = [[None] * m for _ in range(n)]
    fwd_ready[0] = [0.0] * m
    return _State(
        orders=device_orders(schedule, p, chunks, m),
        rank_of_stage=list(stage_ranks(schedule, p, n)),
        fwd_ready=fwd_ready,
        bwd_ready=[[None] * m for _ in range(n)],
        position=[0] * p, free_at=[0.0] * p, running=[False] * p, busy_s=[0.0] * p,
        parts=[[0.0, 0.0, 0.0, 0.0] for _ in range(p)],
        live_bytes=[0] * p, peak_bytes=[0] * p, live_mb=[0] * n, peak_mb=[0] * n,
        send_fwd_s=[0.0] * n, send_bwd_s=[0.0] * n, copy_fwd_s=[0.0] * n, copy_bwd_s=[0.0] * n,
        link_free={}, heap=[], pass_overhead_s=0.0, events=[] if record_events else None,
    )


def _transfer_times(state: _State, stages: Sequence[SimStage], cluster: Cluster) -> None:
    """Each stage's send durations on its actual links, looked up once (not per micro-batch).

    On a ``host_copy`` link the endpoints move the bytes themselves: the sender's pass and the
    receiver's pass each take ``bytes / bandwidth`` longer, and the link only adds its latency. On any
    link, both passes also pay the runtime's probed cost per byte (``Cluster.pass_byte_overhead_s``).
    """
    per_byte = cluster.pass_byte_overhead_s
    for s, stage in enumerate(stages):
        if s + 1 < len(stages) and stage.device != stages[s + 1].device:
            link = cluster.link(stage.device, stages[s + 1].device)
            copy = link.copy_s(stage.send_fwd_bytes)
            state.send_fwd_s[s] = link.latency_s if copy else link.transfer_s(stage.send_fwd_bytes)
            state.copy_fwd_s[s] += copy + per_byte * stage.send_fwd_bytes
            state.copy_fwd_s[s + 1] += copy + per_byte * stage.send_fwd_bytes
        if s > 0 and stage.device != stages[s - 1].device:
            link = cluster.link(stage.device, stages[s - 1].device)
            copy = link.copy_s(stage.send_bwd_bytes)
            state.send_bwd_s[s] = link.latency_s if copy else link.transfer_s(stage.send_bwd_bytes)
            state.copy_bwd_s[s] += copy + per_byte * stage.send_bwd_bytes
            state.copy_bwd_s[s - 1] += copy + per_byte * stage.send_bwd_bytes


def _try_start(state: _State, stages: Sequence[SimStage], ranks: tuple[str, ...], rank: int, now: float) -> None:
    """Start the device's next pass if the device is free and the pass's input has arrived. (The hottest function of
    every placer: it reads each list of ``state`` once.)"""
    if state.running[rank]:
        return
    order = state.orders[rank]
    position = state.position[rank]
    if position == len(order):
        chosen = state.planner.choose(state, rank, max(now, state.free_at[rank])) if state.planner else None
        if chosen is None:
            return
        order.append(chosen)  # type: ignore[attr-defined]
    kind, s, j = order[position]
    if kind == FWD:
        ready = state.fwd_ready[s][j]
        if ready is None:
            return
        stage = stages[s]
        compute, copy = stage.fwd_s, state.copy_fwd_s[s]
        live = state.live_bytes[rank] + stage.activation_bytes
        state.live_bytes[rank] = live
        if live > state.peak_bytes[rank]:
            state.peak_bytes[rank] = live
        in_flight = state.live_mb[s] + 1
        state.live_mb[s] = in_flight
        if in_flight > state.peak_mb[s]:
            state.peak_mb[s] = in_flight
    elif kind == BWD_WEIGHT:
        ready = now
        compute, copy = stages[s].bwd_weight_s, 0.0
    elif kind == UPD:  # an asynchronous schedule's optimizer step, in the device's order
        _start_update(state, stages[s], ranks[rank], rank, s, now)
        return
    else:
        ready = state.bwd_ready[s][j]
        if ready is None:
            return
        stage = stages[s]  # I: the input-gradient half; B: a whole backward, without the excess a split one costs
        compute = stage.bwd_s - (stage.bwd_weight_s if kind == BWD_INPUT else stage.split_excess_s)
        copy = state.copy_bwd_s[s]
    free = state.free_at[rank]
    start = now if now >= ready else ready
    if free > start:
        start = free
    overhead = state.pass_overhead_s
    duration = overhead + compute + copy
    end = start + duration
    state.running[rank] = True
    state.free_at[rank] = end
    state.busy_s[rank] += duration
    parts = state.parts[rank]
    parts[0] += compute
    parts[1] += copy
    parts[2] += overhead
    if state.events is not None:
        state.events.append(Event(ranks[rank], EVENT_KINDS[kind], s, j, start, end))
    state.seq += 1
    heapq.heappush(state.heap, (end, state.seq, rank))


def _start_update(state: _State, stage: SimStage, device: str, rank: int, s: int, now: float) -> None:
    start = max(now, state.free_at[rank])
    state.running[rank] = True
    state.free_at[rank] = start + stage.update_s
    state.busy_s[rank] += stage.update_s
    state.parts[rank][3] += stage.update_s
    if state.events is not None and stage.update_s > 0:
        state.events.append(Event(device, "update", s, -1, start, start + stage.update_s))
    state.seq += 1
    heapq.heappush(state.heap, (start + stage.update_s, state.seq, rank))


def _finish(state: _State, stages: Sequence[SimStage], ranks: tuple[str, ...], rank: int, now: float) -> None:
    """A pass on ``rank`` completed at ``now``: send its output, then start what became runnable."""
    position = state.position[rank]
    kind, s, j = state.orders[rank][position]
    state.position[rank] = position + 1
    state.running[rank] = False
    if kind == FWD:
        if s == len(stages) - 1:
            state.bwd_ready[s][j] = now
        else:
            state.fwd_ready[s + 1][j] = _send(state, ranks, s, s + 1, j, now)
            _try_start(state, stages, ranks, state.rank_of_stage[s + 1], now)
    elif kind == UPD:
        if state.marks is not None:  # the device's clock, busy time and its parts after each update
            state.marks[rank].append((now, state.busy_s[rank], list(state.parts[rank])))
    else:
        if kind in FREES:
            state.live_bytes[rank] -= stages[s].activation_bytes
            state.live_mb[s] -= 1
        if s > 0 and kind != BWD_WEIGHT:
            state.bwd_ready[s - 1][j] = _send(state, ranks, s, s - 1, j, now)
            _try_start(state, stages, ranks, state.rank_of_stage[s - 1], now)
    _try_start(state, stages, ranks, rank, now)


def _send(state: _State, ranks: tuple[str, ...], src: int, dst: int, j: int, now: float) -> float:
    """Queue stage ``src``'s output for stage ``dst`` on their directed link; return its arrival time."""
    duration = state.send_fwd_s[src] if dst > src else state.send_bwd_s[src]
    if duration <= 0:
        return now
    rank_of_stage = state.rank_of_stage
    key = (rank_of_stage[src], rank_of_stage[dst])
    free = state.link_free.get(key, 0.0)
    start = now if now >= free else free
    end = start + duration
    state.link_free[key] = end
    if state.events is not None:
        kind = "send_fwd" if dst > src else "send_bwd"
        state.events.append(Event(f"{ranks[key[0]]}->{ranks[key[1]]}", kind, src, j, start, end))
    return end


def _updates(state: _State, stages: Sequence[SimStage], ranks: tuple[str, ...]) -> None:
    """Each device steps its optimizer after its last pass: the update of its stages' parameters."""
    for r, dev in enumerate(ranks):
        update = sum(st.update_s for s, st in enumerate(stages) if state.rank_of_stage[s] == r)
        if update <= 0:
            continue
        if state.events is not None:
            state.events.append(Event(dev, "update", min(s for s in range(len(stages)) if state.rank_of_stage[s] == r),
                                      -1, state.free_at[r], state.free_at[r] + update))
        state.free_at[r] += update
        state.busy_s[r] += update
        state.parts[r][3] += update


def _result(state: _State, stages: Sequence[SimStage], ranks: tuple[str, ...], updates: bool = True) -> SimResult:
    ends = list(state.free_at)
    if updates:
        _updates(state, stages, ranks)
    step = max(state.free_at) if state.free_at else 0.0
    static = _held_by_rank(state, stages, len(ranks))
    devices = {
        dev: DeviceStats(busy_s=state.busy_s[r], idle_s=max(step - state.busy_s[r], 0.0),
                         peak_memory_bytes=static[r] + state.peak_bytes[r], compute_s=state.parts[r][0],
                         copy_s=state.parts[r][1], overhead_s=state.parts[r][2], update_s=state.parts[r][3],
                         end_s=ends[r])
        for r, dev in enumerate(ranks)
    }
    idle = sum(d.idle_s for d in devices.values())
    events = tuple(sorted(state.events, key=BY_TIME)) if state.events is not None else ()
    return SimResult(
        step_time_s=step,
        devices=MappingProxyType(devices),
        bubble_fraction=idle / (len(ranks) * step) if step > 0 else 0.0,
        events=events,
        stage_inflight=tuple(state.peak_mb),
        orders=MappingProxyType({dev: tuple(state.orders[r]) for r, dev in enumerate(ranks)}),
    )
