"""The objective the exact placers share, and the device classes that keep them small.

**Objective.** A stage's *latency* is its compute per micro-batch (forward + backward on its device)
plus the transfer on its outgoing boundary: the activations it sends to the next stage and the
gradients it gets back, each ``latency_s + bytes / bandwidth_Bps`` on the link between the two
devices. The step time of a pipeline of latencies ``L_0 .. L_{p-1}`` over ``m`` micro-batches is

    step(P) = sum_k L_k + (m - 1) * max_k L_k

(GPipe's fill-and-drain bound; Alpa's stage-construction objective, Zheng et al., OSDI 2022, eq. 2;
TeraPipe, Li et al., ICML 2021). The ILP, the DP and the brute force all minimise exactly this, subject
to every stage fitting its device's memory under the schedule (``planner.partition.model.cost``); the
simulator ranks the resulting plans afterwards.

**The replicas' sync.** On one replica pipeline of a hybrid plan (``Problem.replica_sync``) each stage also
all-reduces its gradients with its replicas after its last backward, ``A_k`` seconds, while the stages before it
run their last backwards; what they do not hide lengthens the step. The formula adds, per stage,

    E_k = max(0, A_k - Bmin(start_k))

where ``Bmin(b)`` is the backward of blocks ``[0, b)``, each on its fastest device: no more than the stages before
stage ``k`` take for their last backward, so ``E_k`` is at least what they leave exposed. The first stage's sync
is always whole (``Bmin(0) = 0``); the later stages' are usually hidden. The sum over stages of ``E_k`` bounds the
largest from above, and equals it when one stage is exposed, as is usual; being additive, it fits the DP's sum and
the ILP's objective without a new bound to enumerate. ``step(P) = sum_k (L_k + E_k) + (m - 1) max_k L_k``.

**Device classes.** Devices of the same type, host, memory and speed factor that every other device
sees over equal links, and that are joined to each other by equal links, are interchangeable. The exact placers choose a *class* per stage and a count per
class, which removes the symmetry between identical GPUs (and makes the DP polynomial); stages are
given concrete devices of their class in id order at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np

from planner.errors import InfeasibleError
from planner.formats.cluster import Link
from planner.formats.plan import ZERO_BUBBLE_SCHEDULES
from planner.partition.model.cost import (
    inflight_microbatches,
    stage_activation_need_t,
    stage_compute_s,
    stage_stash_bytes_t,
    stage_static_bytes_t,
    stage_sync_s,
)
from planner.partition.model.problem import Partition, Problem, StageSpec
from planner.partition.model.tables import CostTables

__all__ = ["DeviceClass", "device_classes", "param_bytes_matrix", "stage_latencies_s", "step_time_formula_s",
           "sync_tail_s", "backward_floor", "stage_fits",
           "class_link", "assign_devices", "slot_inflight", "ClassTables", "class_tables",
           "StageLatencies", "stage_latencies", "stages_room"]


@dataclass(frozen=True)
class DeviceClass:
    """Interchangeable devices: same type, host, memory and speed, and no per-pair link."""

    devices: tuple[str, ...]
    """Device ids, sorted; stages of this class take them in this order."""
    type: str
    host: str
    memory_bytes: int
    speed: float

    @property
    def count(self) -> int:
        return len(self.devices)


def device_classes(problem: Problem) -> tuple[DeviceClass, ...]:
    """Group the cluster's devices into interchangeable classes, in order of their first device id.

    Two devices are interchangeable when they agree in type, host, memory and speed factor and every
    third device sees them over equal links (bandwidth and latency); within a class all links are equal.
    Explicit link pairs thus split a class only where they make a difference.
    """
    members: list[list[str]] = []
    for dev in sorted(problem.cluster.device_ids):
        home = next((m for m in members if _interchangeable(problem, m, dev)), None)
        if home is None:
            members.append([dev])
        else:
            home.append(dev)
    out = []
    for ids in members:
        first = problem.cluster.device(ids[0])
        out.append(DeviceClass(tuple(ids), first.type, first.host, first.memory_bytes,
                               float(problem.speed_factors.get(ids[0], 1.0))))
    return tuple(out)


def _interchangeable(problem: Problem, members: list[str], dev: str) -> bool:
    cluster = problem.cluster
    a, b = cluster.device(members[0]), cluster.device(dev)
    if (a.type, a.host, a.memory_bytes) != (b.type, b.host, b.memory_bytes):
        return False
    if problem.speed_factors.get(a.id, 1.0) != problem.speed_factors.get(b.id, 1.0):
        return False
    if problem.replica_sync.get(a.id) != problem.replica_sync.get(b.id):  # their stages' syncs cost differently
        return False
    inside = _link_key(cluster.link(members[0], members[1])) if len(members) > 1 else _link_key(cluster.link(a.id, dev))
    if any(_link_key(cluster.link(m, dev)) != inside for m in members):
        return False
    return all(_link_key(cluster.link(a.id, e)) == _link_key(cluster.link(dev, e))
               for e in cluster.device_ids if e not in members and e != dev)


def _link_key(link: Link) -> tuple[float, float]:
    return (link.bandwidth_Bps, link.latency_s)


def class_link(problem: Problem, a: DeviceClass, b: DeviceClass) -> Link | None:
    """The link between a device of ``a`` and a *different* device of ``b`` (None: no such pair)."""
    if a is b or a == b:
        return problem.cluster.link(a.devices[0], a.devices[1]) if a.count > 1 else None
    return problem.cluster.link(a.devices[0], b.devices[0])


def boundary_s(link: Link, fwd_bytes: int, bwd_bytes: int, per_byte_s: float = 0.0) -> float:
    """Activations forward plus gradients backward across one stage boundary on ``link``, and what the two
    endpoints' passes pay for them beside the link: on a ``host_copy`` link the other endpoint's copy, and on any
    link the runtime's cost per byte sent or received on both (``Cluster.pass_byte_overhead_s``; the simulator's
    ``_transfer_times``). The formula charges it all to the stage before the cut."""
    moved = fwd_bytes + bwd_bytes
    return (link.transfer_s(fwd_bytes) + link.transfer_s(bwd_bytes) + link.copy_s(fwd_bytes) + link.copy_s(bwd_bytes)
            + 2 * per_byte_s * moved)


def pass_pair_s(problem: Problem) -> float:
    """The runtime's fixed cost of a stage's passes of one micro-batch (``Cluster.pass_overhead_for`` the schedule per
    pass, as the simulator charges it: a forward and a backward, or under a zero-bubble schedule a forward, an input
    gradient and a weight gradient): part of every stage's latency in the formula."""
    passes = 3 if problem.schedule in ZERO_BUBBLE_SCHEDULES else 2
    return passes * problem.cluster.pass_overhead_for(problem.schedule)


def stage_latencies_s(problem: Problem, partition: Partition) -> tuple[float, ...]:
    """Per stage: compute per micro-batch and the runtime's cost of its two passes, plus the transfer across its
    outgoing boundary (both ways, ``boundary_s``)."""
    tables, passes, out = problem.tables, pass_pair_s(problem), []
    for k, st in enumerate(partition):
        latency = stage_compute_s(tables, st.device, st.start, st.stop) + passes
        if k + 1 < len(partition):
            nxt = partition[k + 1].device
            cut = st.stop - 1
            if nxt != st.device:
                latency += boundary_s(tables.links[(st.device, nxt)], problem.cut_fwd_bytes[cut],
                                      problem.cut_bwd_bytes[cut], problem.cluster.pass_byte_overhead_s)
        out.append(latency)
    return tuple(out)


def step_time_formula_s(problem: Problem, partition: Partition) -> float:
    """``sum_k (L_k + E_k) + (m - 1) * max_k L_k``: the objective every exact placer minimises (``E_k``, the sync
    tail, only on a replica pipeline: ``sync_tail_s``)."""
    latencies = stage_latencies_s(problem, partition)
    tails = 0.0
    if problem.replica_sync:
        floor = backward_floor(problem)
        tails = sum(sync_tail_s(problem, st.device, st.start, st.stop, floor) for st in partition)
    return sum(latencies) + tails + (problem.microbatches - 1) * max(latencies)


def sync_tail_s(problem: Problem, device: str, start: int, stop: int, floor: np.ndarray | None = None) -> float:
    """``E`` of a stage ``[start, stop)`` on ``device`` (module docstring): its all-reduce with its replicas
    (``cost.stage_sync_s``) less the backward of the blocks before it on their fastest devices (``floor``:
    ``backward_floor(problem)``, computed when not given), at least 0."""
    floor = backward_floor(problem) if floor is None else floor
    return max(0.0, stage_sync_s(problem, StageSpec(start, stop, device)) - float(floor[start]))


def backward_floor(problem: Problem) -> np.ndarray:
    """``Bmin``: per block boundary ``b``, the backward seconds of blocks ``[0, b)`` each on its fastest device."""
    tables = problem.tables
    per_block = np.min([np.diff(np.asarray(tables.bwd_prefix[d], dtype=float)) * tables.speed[d]
                        for d in problem.cluster.device_ids], axis=0)
    return np.concatenate([[0.0], np.cumsum(per_block)])


def slot_inflight(schedule: str, stages_to_end: int, microbatches: int, num_devices: int | None = None) -> int:
    """Micro-batches in flight on a stage with ``stages_to_end`` stages from it to the last (itself included).

    GPipe keeps all ``m``; 1F1B keeps ``min(m, p - s)`` = ``min(m, stages_to_end)``. The exact placers
    run one stage per device, so under interleaved-1f1b they plan its one-chunk case, which is 1F1B. Zero-bubble
    schedules keep ``min(m, p)`` on every stage, which the stages to the end do not tell: the placers assume the
    most stages the cluster's ``num_devices`` allow, at least what the plan they find will keep (so what they
    place fits; with fewer stages than devices they may refuse a tight stage the check would pass); ``zb-h2`` keeps
    ``2p - 1``, assumed the same way.
    """
    if schedule in ZERO_BUBBLE_SCHEDULES:  # the same count on every stage, so stage 0 of the most stages
        return inflight_microbatches(schedule, 0, max(stages_to_end, num_devices or stages_to_end), microbatches)
    return inflight_microbatches("1f1b" if schedule == "interleaved-1f1b" else schedule,
                                 0, stages_to_end, microbatches)


def stage_fits(problem: Problem, start: int, stop: int, memory_bytes: int, stages_to_end: int) -> bool:
    """Whether blocks ``[start, stop)`` fit ``memory_bytes`` as a stage with ``stages_to_end`` stages left."""
    tables = problem.tables
    need = (stage_static_bytes_t(tables, start, stop)
            + stage_activation_need_t(tables, start, stop, slot_inflight(problem.schedule, stages_to_end,
                                                                         problem.microbatches,
                                                                         len(problem.cluster.devices)))
            + stage_stash_bytes_t(tables, problem.schedule, start, stop, stages_to_end, problem.microbatches))
    return need <= memory_bytes


def assign_devices(classes: Sequence[DeviceClass], stages: Sequence[tuple[int, int, int]]) -> Partition:
    """Stages given as ``(start, stop, class index)`` -> a partition on concrete devices (ids in order)."""
    used = [0] * len(classes)
    out = []
    for start, stop, c in stages:
        if used[c] >= classes[c].count:
            raise InfeasibleError(f"more stages on device class {classes[c].devices} than it has devices")
        out.append(StageSpec(start, stop, classes[c].devices[used[c]]))
        used[c] += 1
    return tuple(out)


@dataclass(frozen=True)
class ClassTables:
    """Dense per-class arrays over blocks for the DP and the ILP (built by ``class_tables``).

    ``compute_s[c][b, e]``: forward + backward seconds of blocks ``[b, e)`` on class ``c`` (speed applied),
    computed as ``planner.partition.model.cost.stage_compute_s`` does, so the numbers agree bit for bit.
    ``boundary_s[c, d, b]``: both-way transfer across the cut after block ``b`` between a stage on class
    ``c`` and the next on class ``d`` (``inf`` where no such device pair exists).
    ``max_stages_to_end[c, b, e]``: the largest ``stages_to_end`` for which ``[b, e)`` fits class ``c``'s
    memory (0: never fits; ``BIG``: always fits). ``pass_pair_s``: the runtime's cost of a stage's two passes per
    micro-batch, added to every stage latency (``stage_latencies``), not to ``compute_s``, whose per-block sums
    give the placers' lower bounds. ``sync_tail_s[c, b, e]``: ``E`` of stage ``[b, e)`` on class ``c`` on a
    replica pipeline (``sync_tail_s``), added to the sum but not to the latency a bound limits; ``None`` elsewhere.
    """

    classes: tuple[DeviceClass, ...]
    compute_s: np.ndarray
    boundary_s: np.ndarray
    max_stages_to_end: np.ndarray
    pass_pair_s: float = 0.0
    sync_tail_s: np.ndarray | None = None

    BIG = 1 << 30

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(c.count for c in self.classes)


def class_tables(problem: Problem) -> ClassTables:
    """Build the dense tables of ``problem`` over its device classes."""
    classes = device_classes(problem)
    tables, nblocks = problem.tables, len(problem.blocks)
    compute = np.empty((len(classes), nblocks + 1, nblocks + 1))
    for c, cls in enumerate(classes):
        fwd = np.asarray(tables.fwd_prefix[cls.devices[0]], dtype=float)
        bwd = np.asarray(tables.bwd_prefix[cls.devices[0]], dtype=float)
        compute[c] = (fwd[None, :] - fwd[:, None] + bwd[None, :] - bwd[:, None]) * cls.speed
    boundary = np.full((len(classes), len(classes), max(nblocks - 1, 0)), np.inf)
    for c, a in enumerate(classes):
        for d, b in enumerate(classes):
            link = class_link(problem, a, b)
            if link is not None:
                boundary[c, d] = [boundary_s(link, f, g, problem.cluster.pass_byte_overhead_s)
                                  for f, g in zip(problem.cut_fwd_bytes, problem.cut_bwd_bytes)]
    return ClassTables(classes, compute, boundary, _max_stages_to_end(problem, classes), pass_pair_s(problem),
                       _sync_tails(problem, classes))


def _sync_tails(problem: Problem, classes: Sequence[DeviceClass]) -> np.ndarray | None:
    """``ClassTables.sync_tail_s``: ``sync_tail_s`` for every stage and class at once (the same charge as
    ``cost.stage_sync_s``, on arrays); ``None`` off a replica pipeline."""
    if not problem.replica_sync:
        return None
    nbytes = param_bytes_matrix(problem.tables).astype(float)
    floor = backward_floor(problem)[:, None]
    out = np.empty((len(classes), *nbytes.shape))
    for c, cls in enumerate(classes):
        a, b = problem.replica_sync.get(cls.devices[0], (0.0, 0.0))
        out[c] = np.maximum(0.0, np.where(nbytes > 0, a + b * nbytes, 0.0) - floor)
    return out


def param_bytes_matrix(tables: CostTables) -> np.ndarray:
    """``stage_param_bytes_t`` for every ``[start, stop)`` at once: ``out[start, stop]`` (int64, ``stop > start``)."""
    params = np.asarray(tables.param_prefix, dtype=np.int64)
    out = params[None, :] - params[:, None]
    n = len(params)
    for nbytes, readers in tables.tied:
        for start in range(readers[0] + 1, n):
            later = [r for r in readers if r >= start]
            if later:  # a stage from ``start`` holds a copy once it reaches the next reader
                out[start, later[0] + 1:] += nbytes
    return out


def _max_stages_to_end(problem: Problem, classes: Sequence[DeviceClass]) -> np.ndarray:
    tables = problem.tables
    params = np.asarray(tables.param_prefix, dtype=np.int64)
    saved = np.asarray(tables.saved_prefix, dtype=np.int64)
    static = param_bytes_matrix(tables) * tables.static_per_param_byte
    act = saved[None, :] - saved[:, None]
    if tables.recompute:  # cost.stage_activation_terms_t: the input per micro-batch, the saved bytes once
        static = static + act
        act = np.broadcast_to(np.asarray((*tables.input_bytes, 0), dtype=np.int64)[:, None], act.shape).copy()
    return np.stack([stages_room(problem, cls, static, act) for cls in classes]) if classes else \
        np.zeros((0, len(params), len(params)), dtype=np.int64)


def stages_room(problem: Problem, cls: DeviceClass, static: np.ndarray, act: np.ndarray) -> np.ndarray:
    """Per stage (arrays of its static and saved-activation bytes): the most stages-to-end that fit ``cls``.

    0: never fits; ``ClassTables.BIG``: fits whatever its position.
    """
    big, m = ClassTables.BIG, problem.microbatches
    room = cls.memory_bytes - static
    if problem.schedule == "gpipe":
        return np.where(room - act * m >= 0, big, 0).astype(np.int64)
    if problem.schedule in ZERO_BUBBLE_SCHEDULES:  # the same count on every stage (slot_inflight)
        held = slot_inflight(problem.schedule, 1, m, len(problem.cluster.devices))
        return np.where(room - act * held >= 0, big, 0).astype(np.int64)
    # 1F1B keeps min(m, stages_to_end) micro-batches
    with np.errstate(divide="ignore"):
        most = np.where(act > 0, room // np.maximum(act, 1), big)
    most = np.where(most >= m, big, most)
    return np.where(room >= 0, np.maximum(most, 0), 0).astype(np.int64)


@dataclass(frozen=True)
class StageLatencies:
    """Every candidate stage latency on every class (inf: invalid by memory, segment or device pair)."""

    mid: np.ndarray
    """``mid[c, d, b, e]``: stage ``[b, e)`` on class ``c`` followed by a stage on ``d`` (inf: invalid)."""
    last: np.ndarray
    """``last[c, b]``: stage ``[b, B)`` on class ``c`` as the last stage (inf: invalid)."""
    room: np.ndarray
    """``room[c, b, e]``: most stages-to-end for which ``[b, e)`` fits class ``c``."""
    tail: np.ndarray | None = None
    """``tail[c, b, e]``: the stage's sync tail ``E`` (``ClassTables.sync_tail_s``), in the sum but not in the latency
    bounded; ``None``: none."""


def stage_latencies(tab: ClassTables, nblocks: int, segments: Collection[tuple[int, int]] | None = None
                    ) -> StageLatencies:
    """Latency of every (stage, class, next class), restricted to ``segments`` ``(start, stop)`` when given.

    A middle stage needs room for at least two stages to its end, the last for one.
    """
    ncls = len(tab.classes)
    allowed = np.zeros((nblocks + 1, nblocks + 1), dtype=bool)
    if segments is None:
        allowed[np.triu_indices(nblocks + 1, k=1)] = True
    else:
        for start, stop in segments:
            allowed[start, stop] = True
    mid = np.full((ncls, ncls, nblocks + 1, nblocks + 1), np.inf)
    for c in range(ncls):
        for d in range(ncls):
            # a stage [b, e) with e < B pays the cut after block e - 1 on link (c, d)
            cross = np.concatenate([[np.inf], tab.boundary_s[c, d], [np.inf]])
            value = tab.compute_s[c] + tab.pass_pair_s + cross[None, :]
            ok = allowed & (tab.max_stages_to_end[c] >= 2)
            ok[:, nblocks] = False
            mid[c, d] = np.where(ok, value, np.inf)
    last = np.where(allowed[None, :, nblocks] & (tab.max_stages_to_end[:, :, nblocks] >= 1),
                    tab.compute_s[:, :, nblocks] + tab.pass_pair_s, np.inf)
    return StageLatencies(mid, last, tab.max_stages_to_end, tab.sync_tail_s)
