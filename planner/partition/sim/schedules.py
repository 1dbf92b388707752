"""Per-device operation orders of the pipeline schedules, shared by the cost model and the simulator.

A schedule is, for every device, a fixed order of forward (``F``) and backward (``B``) passes of
(stage, micro-batch) pairs; the device runs them in that order as soon as their inputs arrive.

- ``gpipe`` (Huang et al., 2019, GPipe): all forwards, then all backwards, micro-batches in order.
- ``1f1b`` (Narayanan et al., 2021, PipeDream-flush as in Megatron-LM): stage ``s`` of ``p`` warms up
  with ``p - 1 - s`` forwards, alternates one forward and one backward, and drains the backwards.
- ``interleaved-1f1b`` (Narayanan et al., 2021, Megatron-LM's interleaved schedule, as
  ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` orders it): each device holds ``v`` model
  chunks, stages assigned round-robin (stage ``c * p + r`` on device rank ``r``). Forwards run chunk by
  chunk over rounds of ``g`` micro-batches (``g = p`` when ``m`` is a multiple of ``p``, ``g = m`` when
  ``m < p``); the warm-up is ``2 (p - 1 - r) + (v - 1) g`` forwards, then one forward / one backward, then
  the remaining backwards. With ``v = 1`` it is ``1f1b``.
- ``async-1f1b`` and ``2bw`` (seed 000; PipeDream, Narayanan et al., 2019, and PipeDream-2BW, 2021): one step
  of them is ``1f1b``'s order, but the device goes on into the next step's forwards instead of draining, so
  over ``n`` steps a device runs ``1f1b``'s order over ``n * m`` micro-batches with its optimizer step
  (``UPD``) after every ``m``-th backward (``async_orders``). Which weights each forward uses is
  ``forward_version``; docs/async.md.
- ``zb-h1`` (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"; ``ScheduleInterleavedZeroBubble``'s order on one
  stage per device): each backward is split into its input gradient (``I``, which the previous stage waits for)
  and its weight gradient (``W``, which can wait). Device ``r`` warms up with ``p - 1 - r`` forwards, then runs
  forward / input-gradient pairs, each followed by one weight gradient once ``r`` of them have been held back, and
  ends with the held-back weight gradients. Every device keeps up to ``p`` micro-batches' activations (they live
  until ``W``), the most 1F1B keeps on its first device.
- ``zb-h2`` (the same paper's ZB-H2, Figure 3, which torch does not ship): device ``r`` warms up with ``2 (p - 1 - r)``
  forwards and holds back ``2 r`` weight gradients, otherwise as ``zb-h1``. Every device keeps up to ``2p - 1``
  micro-batches; the extra forwards fill the warm-up's bubble and the held-back weight gradients the drain's. On
  equal stages with ``m >= 2p`` and I and W of similar size (the paper's regime) the step is
  ``m (F + I + W) + (p - 1) F``, the least any flushing order takes, where ``zb-h1`` leaves ``(p - 1)(F + I - W)``
  idle when ``W < I`` (docs/zero-bubble.md).
- ``zb-planned``: an order generated from the stages' own F, I and W times on their devices
  (``planner.partition.sim.simulate.planned_orders``) under the same in-flight cap as ``zb-h1`` on one stage per
  device, or as ``zbv`` on two in a V; for memory questions asked without times (``device_orders``) it is that
  schedule's order, whose in-flight counts are the cap.
- ``zbv`` (the same paper's ZB-V, section 6; ``torch.distributed.pipelining.ScheduleZBVZeroBubble``'s order): each
  of the ``p`` devices holds two stages in a V, stage ``r`` and stage ``2p - 1 - r`` (``stage_ranks``), so the first
  device also runs the loss. The order is torch's: ``2 (p - r) - 1`` forwards of the first chunk, ``r`` pairs of
  forwards of both chunks, ``p - r`` forward / input / weight triples of the second chunk, then both chunks in turn,
  and the cool-down's input gradients before the held-back weight gradients. With one stage per device (the
  placers' one-chunk case, as for ``interleaved-1f1b``) it is ``zb-h1``.
- ``dualpipev`` (DeepSeek-V3's DualPipe folded into a V, DeepSeek-AI, 2024, arXiv 2412.19437, and
  ``torch.distributed.pipelining.ScheduleDualPipeV``'s order): the same V layout as ``zbv``, at least ``2p``
  micro-batches. After the fill, each device pairs a forward of one of its stages with a whole backward (``B``) of the
  other (DualPipe's overlapped forward-backward chunks; torch's runtime runs the pair one after the other, and so
  does the simulator); only the fill's and the drain's backwards are split into ``I`` and ``W``. With one stage per
  device it is ``zb-h1``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

from planner.errors import PlannerError
from planner.formats.plan import ASYNC_SCHEDULES, SCHEDULES, SERVER_SYNCS, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES

FWD = "F"
BWD = "B"
BWD_INPUT = "I"
"""A zero-bubble schedule's input-gradient half of a backward: it sends the gradient to the previous stage."""
BWD_WEIGHT = "W"
"""The weight-gradient half: it frees the micro-batch's activations."""
FREES = (BWD, BWD_WEIGHT)
"""Passes after which a micro-batch's activations on the stage are released."""
UPD = "U"
"""An asynchronous schedule's optimizer step (``async_orders``): (UPD, stage, update index)."""
Op = tuple[str, int, int]
"""(FWD, BWD, BWD_INPUT or BWD_WEIGHT, stage index, micro-batch index)."""


def pipeline_layout(devices: Sequence[str], schedule: str) -> tuple[tuple[str, ...], int]:
    """Distinct devices in pipeline order and ``v``, the number of stages each holds.

    Raises ``PlannerError`` when a device holds several stages under a schedule that cannot run them,
    or when the stages of an interleaved plan are not round-robin over its devices (of a ``zbv`` plan: not in a V).
    """
    if schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if not devices:
        raise PlannerError("a pipeline needs at least one stage, found none")
    ranks = tuple(dict.fromkeys(devices))
    if len(ranks) == len(devices):
        return ranks, 1
    if schedule not in ("interleaved-1f1b",) + V_SCHEDULES:
        first: dict[str, int] = {}
        for i, dev in enumerate(devices):
            if dev in first:
                raise PlannerError(
                    f"device {dev!r} holds stages {first[dev]} and {i}, but schedule {schedule!r} runs one stage "
                    f"per device; use --schedule interleaved-1f1b or give each stage its own device"
                )
            first[dev] = i
    p = len(ranks)
    if schedule in V_SCHEDULES:
        wanted = stage_ranks(schedule, p, 2 * p)
        for s, dev in enumerate(devices):
            if len(devices) != 2 * p or dev != ranks[wanted[s]]:
                raise PlannerError(
                    f"{schedule} needs two stages on each device in a V, stages s and 2p-1-s on the s-th device "
                    f"({', '.join(ranks)}, then back in reverse); stage {s} is on {dev!r}. Re-partition with "
                    f"--schedule {schedule}")
        return ranks, 2
    for s, dev in enumerate(devices):
        if len(devices) % p or dev != ranks[s % p]:
            raise PlannerError(
                f"interleaved-1f1b needs stages assigned round-robin over the devices ({', '.join(ranks)}) with "
                f"the same number of stages on each; stage {s} is on {dev!r}. Reorder the stages or use 1f1b"
            )
    return ranks, len(devices) // p


def stage_ranks(schedule: str, num_devices: int, num_stages: int) -> tuple[int, ...]:
    """The device rank of each stage: round-robin (stage ``s`` on rank ``s mod p``; one stage per device is its
    ``v = 1`` case), or under a V schedule with two stages per device, stage ``s`` on rank ``s`` and then
    ``2p - 1 - s``."""
    p = num_devices
    if schedule in V_SCHEDULES and num_stages == 2 * p:
        return tuple(s if s < p else 2 * p - 1 - s for s in range(num_stages))
    return tuple(s % p for s in range(num_stages))


@lru_cache(maxsize=256)
def device_orders(schedule: str, num_devices: int, chunks: int, microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """The order of passes on each device rank (stage ``c * num_devices + r`` is chunk ``c`` of rank ``r``; under a
    V schedule, ``stage_ranks``).

    Cached: every simulation and memory check asks for it, and the polish asks thousands of times for
    the same few layouts; the result is immutable.
    """
    p, v, m = num_devices, chunks, microbatches
    if schedule in ASYNC_SCHEDULES:  # one step of them (what memory checks ask): 1f1b's order
        schedule = "1f1b"
    if schedule == "gpipe":
        if v != 1:
            raise PlannerError("gpipe runs one stage per device")
        return tuple(tuple([(FWD, r, j) for j in range(m)] + [(BWD, r, j) for j in range(m)]) for r in range(p))
    if schedule == "dualpipev" and v == 2:
        found = dualpipev_violation(2 * p, p, m)
        if found:
            raise PlannerError(found)
        return tuple(_dualpipev(r, p, m) for r in range(p))
    if schedule in V_SCHEDULES and v == 2:
        return tuple(_zbv(r, p, m) for r in range(p))
    if schedule in ZERO_BUBBLE_SCHEDULES:
        if v != 1:
            layouts = "one stage per device, or two in a V" if schedule in V_SCHEDULES else "one stage per device"
            raise PlannerError(f"{schedule} runs {layouts}")
        if schedule == "zb-h2":
            return tuple(_zero_bubble(r, m, 2 * (p - 1 - r), 2 * r) for r in range(p))
        return tuple(_zero_bubble(r, m, p - 1 - r, r) for r in range(p))
    if schedule == "1f1b" or v == 1:
        if v != 1:
            raise PlannerError("1f1b runs one stage per device")
        return tuple(_one_f_one_b([(r, j) for j in range(m)], [(r, j) for j in range(m)], min(p - 1 - r, m))
                     for r in range(p))
    group = interleaved_group_size(p, m)
    return tuple(_interleaved(r, p, v, m, group) for r in range(p))


def dualpipev_violation(num_stages: int, num_devices: int, microbatches: int) -> str | None:
    """torch's ``ScheduleDualPipeV`` rule: in a V (more stages than devices) at least as many micro-batches as
    stages; None when it holds."""
    if num_stages <= num_devices or microbatches >= num_stages:
        return None
    return (f"dualpipev needs at least as many micro-batches as stages ({num_stages} in a V on {num_devices} devices, "
            f"torch's ScheduleDualPipeV rule), found {microbatches}; re-partition with --microbatches {num_stages} or "
            f"more, or use --schedule zbv")


def planned_patterns(num_stages: int, num_devices: int, microbatches: int,
                     room: Sequence[int] | None = None, activation_bytes: Sequence[int] | None = None) -> tuple[str, ...]:
    """The fixed orders ``zb-planned`` takes as candidates on this layout, and so the memory it may hold (the most
    any of them holds on each device): ``zb-h1``'s on one stage per device, and ``zb-h2``'s too where its order's live
    activations fit every device (``room``: per device, its capacity less what it holds whatever the order;
    ``activation_bytes``: per stage, what a micro-batch in flight keeps; without them, ``zb-h1``'s only); ``zbv``'s in
    a V, and ``dualpipev``'s there too when it can run. The memory rule (``cost.device_memory_bytes``) and the order
    generator (``simulate.planned_orders``) both ask here, so they agree on what a plan may hold."""
    if num_stages == num_devices:
        if room is None or activation_bytes is None:
            return ("zb-h1",)
        activation = dict(enumerate(activation_bytes))
        orders = device_orders("zb-h2", num_devices, 1, microbatches)
        fits = all(peak_activation_bytes(order, activation) <= free for order, free in zip(orders, room))
        return ("zb-h1", "zb-h2") if fits else ("zb-h1",)
    return ("zbv",) if dualpipev_violation(num_stages, num_devices, microbatches) else ("zbv", "dualpipev")


def interleaved_group_size(num_devices: int, microbatches: int) -> int:
    """Micro-batches per round of the interleaved schedule, as ``torch.distributed.pipelining`` counts them.

    ``rounds = max(1, m // p)`` and ``m`` must split evenly into them (``ScheduleInterleaved1F1B``'s rule);
    a round is ``p`` micro-batches when ``m`` is a multiple of ``p``, all ``m`` when ``m < p``.
    """
    rounds = max(1, microbatches // num_devices)
    if microbatches % rounds:
        fits = sorted({k * num_devices for k in range(1, rounds + 2)} | set(range(1, num_devices + 1)))
        nearest = min(fits, key=lambda k: (abs(k - microbatches), k))
        raise PlannerError(
            f"interleaved-1f1b on {num_devices} devices needs a micro-batch count that splits into "
            f"{rounds} equal rounds (torch.distributed.pipelining's rule), found {microbatches}; "
            f"use --microbatches {nearest}"
        )
    return microbatches // rounds


def _one_f_one_b(fwds: Sequence[tuple[int, int]], bwds: Sequence[tuple[int, int]], warmup: int) -> tuple[Op, ...]:
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    ops: list[Op] = [(FWD, s, j) for s, j in fwds[:warmup]]
    steady = len(fwds) - warmup
    for i in range(steady):
        ops.append((FWD, *fwds[warmup + i]))
        ops.append((BWD, *bwds[i]))
    ops.extend((BWD, s, j) for s, j in bwds[steady:])
    return tuple(ops)


def _zero_bubble(rank: int, m: int, warmup: int, held: int) -> tuple[Op, ...]:
    """A zero-bubble pattern on one stage per device: ``warmup`` forwards; then per micro-batch a forward (while any
    remain) and an input gradient, each followed by the oldest held-back weight gradient once ``held`` are held; then
    the rest of the weight gradients. ``zb-h1`` (``warmup = p - 1 - rank``, ``held = rank``) is torch's
    ``ScheduleInterleavedZeroBubble`` order (its ``_get_1f1b_rank_ops`` with zero bubble on, idle slots left out);
    ``zb-h2`` doubles both. At most ``warmup + 1 + held`` micro-batches are in flight."""
    warmup = min(warmup, m)
    ops: list[Op] = [(FWD, rank, j) for j in range(warmup)]
    weights = 0
    for i in range(m):
        if warmup + i < m:
            ops.append((FWD, rank, warmup + i))
        ops.append((BWD_INPUT, rank, i))
        if i >= held:
            ops.append((BWD_WEIGHT, rank, weights))
            weights += 1
    ops.extend((BWD_WEIGHT, rank, j) for j in range(weights, m))
    return tuple(ops)


def _zbv(rank: int, p: int, m: int) -> tuple[Op, ...]:
    """ZB-V's order on device ``rank`` of ``p`` (stages ``rank`` and ``2p - 1 - rank``), as torch's
    ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` builds it: over ``max(m, 2p - 1)`` micro-batches,
    with the passes of micro-batches beyond ``m`` left out (torch leaves them as idle slots; tests compare the two)."""
    n = max(2 * p - 1, m)
    first, second = rank, 2 * p - 1 - rank
    ops: list[Op] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append((FWD, first, f0))
        f0 += 1
    for _ in range(rank):
        ops += [(FWD, second, f1), (FWD, first, f0)]
        f0, f1 = f0 + 1, f1 + 1
    for _ in range(p - rank):
        ops += [(FWD, second, f1), (BWD_INPUT, second, b1), (BWD_WEIGHT, second, b1)]
        f1, b1 = f1 + 1, b1 + 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append((FWD, first, f0))
            f0 += 1
        ops += [(BWD_INPUT, first, b0), (BWD_WEIGHT, first, b0), (FWD, second, f1), (BWD_INPUT, second, b1),
                (BWD_WEIGHT, second, b1)]
        b0, f1, b1 = b0 + 1, f1 + 1, b1 + 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [(BWD_INPUT, first, b0), (BWD_INPUT, second, b1)]
        b0, b1 = b0 + 1, b1 + 1
    for _ in range(p - rank):
        ops += [(BWD_INPUT, first, b0), (BWD_WEIGHT, first, w0)]
        b0, w0 = b0 + 1, w0 + 1
    ops += [(BWD_WEIGHT, second, j) for j in range(w1, b1)]
    ops += [(BWD_WEIGHT, first, j) for j in range(w0, b0)]
    return tuple(op for op in ops if op[2] < m)


def _dualpipev(rank: int, p: int, m: int) -> tuple[Op, ...]:
    """DualPipeV's order on device ``rank`` of ``p`` (stages ``rank`` and ``2p - 1 - rank``, ``m >= 2p``), as torch's
    ``ScheduleDualPipeV._calculate_single_rank_operations`` builds it, with each overlapped forward-backward action
    written as its two passes in torch's order (forward first). Weight gradients held back after an input gradient run
    oldest first where the order has room for one (tests compare the two)."""
    first, second = rank, 2 * p - 1 - rank
    ops: list[Op] = []
    taken: dict[tuple[int, str], int] = {}
    held: list[tuple[int, int]] = []

    def run(stage: int, kind: str) -> None:
        counter = (stage, FWD if kind == FWD else BWD_INPUT)  # a whole backward takes the input gradients' count
        j = taken.get(counter, 0)
        taken[counter] = j + 1
        ops.append((kind, stage, j))
        if kind == BWD_INPUT:
            held.append((stage, j))

    def weight() -> None:
        if held:
            stage, j = held.pop(0)
            ops.append((BWD_WEIGHT, stage, j))

    for _ in range(2 * (p - rank - 1)):  # the fill: the first stage's forwards, then both stages' in turn
        run(first, FWD)
    for _ in range(rank + 1):
        run(first, FWD)
        run(second, FWD)
    for _ in range(p - rank - 1):  # zero-bubble triples on the second stage
        run(second, BWD_INPUT)
        weight()
        run(second, FWD)
    for _ in range(m - 2 * p + rank + 1):  # the main part: forward of one stage with the backward of the other
        run(first, FWD)
        run(second, BWD)  # torch keeps the last rank's first pair apart; it is the same two passes in this order
        run(second, FWD)
        run(first, BWD)
    for _ in range(p - rank - 1):
        run(second, BWD)
        run(second, FWD)
        run(first, BWD)
    split = False  # the drain: the second half of its backwards split into input and weight gradients
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        run(second, BWD_INPUT if split else BWD)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        run(first, BWD_INPUT if split else BWD)
    for _ in range(p - rank - 1):
        weight()
        run(first, BWD_INPUT if split else BWD)
    for _ in range(rank + 1):
        weight()
    return tuple(ops)


def _interleaved(rank: int, p: int, v: int, m: int, group: int) -> tuple[Op, ...]:
    fwds: list[tuple[int, int]] = []
    bwds: list[tuple[int, int]] = []
    for first in range(0, m, group):
        members = range(first, first + group)
        fwds.extend((c * p + rank, j) for c in range(v) for j in members)
        bwds.extend((c * p + rank, j) for c in reversed(range(v)) for j in members)
    warmup = min(2 * (p - 1 - rank) + (v - 1) * group, m * v)
    return _one_f_one_b(fwds, bwds, warmup)


def inflight_counts(order: Sequence[Op]) -> dict[int, int]:
    """Per stage in ``order``: the most micro-batches forwarded but not yet backwarded at once."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for kind, stage, _ in order:
        live[stage] = live.get(stage, 0) + (1 if kind == FWD else -1 if kind in FREES else 0)
        peak[stage] = max(peak.get(stage, 0), live[stage])
    return peak


def peak_activation_bytes(order: Sequence[Op], activation_bytes: Mapping[int, int]) -> int:
    """Largest sum of live activations on a device running ``order`` (allocated at F, freed after B or W)."""
    live = peak = 0
    for kind, stage, _ in order:
        if kind == FWD:
            live += activation_bytes[stage]
            peak = max(peak, live)
        elif kind in FREES:
            live -= activation_bytes[stage]
    return peak


@lru_cache(maxsize=64)
def async_orders(num_devices: int, microbatches: int, steps: int,
                 inflight: int | None = None) -> tuple[tuple[Op, ...], ...]:
    """Each device's passes over ``steps`` steps of an asynchronous schedule, with no flush between them: 1F1B's
    order over ``steps * microbatches`` micro-batches, and ``(UPD, stage, u)`` after the backward of micro-batch
    ``(u + 1) * microbatches - 1``. Stage ``s`` keeps ``inflight`` micro-batches in flight (default ``p - s``,
    1F1B's; 1 runs one micro-batch at a time through the whole pipeline, plain model parallelism)."""
    total = steps * microbatches
    orders = []
    for r in range(num_devices):
        depth = inflight_depth(r, num_devices, inflight)
        ops: list[Op] = []
        for kind, s, j in _one_f_one_b([(r, j) for j in range(total)], [(r, j) for j in range(total)],
                                       min(depth - 1, total)):
            ops.append((kind, s, j))
            if kind == BWD and (j + 1) % microbatches == 0:
                ops.append((UPD, s, j // microbatches))
        orders.append(tuple(ops))
    return tuple(orders)


def inflight_depth(stage: int, num_stages: int, inflight: int | None = None) -> int:
    """Micro-batches stage ``stage`` holds between forward and backward in an asynchronous schedule's steady state."""
    return max(1, min(num_stages - stage, inflight if inflight is not None else num_stages))


def tied_grace(leader: int, num_stages: int, inflight: int | None = None) -> int:
    """How many forwards of a step a later holder of a weight tied to stage ``leader`` (its first holder) runs before
    it applies the weight's sum from the last update (``planner.runtime.pipeline.asynchronous``): as many as the
    leader runs of that step before its own update (``inflight_depth(leader) - 1``), so the wait costs nothing."""
    return inflight_depth(leader, num_stages, inflight) - 1


def async_spans(first_step: int, steps: int, warmup: int = 0) -> list[tuple[int, int]]:
    """The drained spans ``(first step, steps)`` an asynchronous schedule runs a round of ``steps`` steps from
    ``first_step`` in: while the synchronous warm-up lasts (steps before ``warmup``, ``async.warmup``) one span per
    step, each of which drains, which is 1F1B with its flush; the rest of the round in one span with no flush."""
    cut = min(max(warmup, first_step), first_step + steps)
    rest = [(cut, first_step + steps - cut)] if cut < first_step + steps else []
    return [(step, 1) for step in range(first_step, cut)] + rest


def run_drain_every(steps: int, round_steps: int, warmup: int) -> int:
    """The steps between drains an asynchronous run of ``steps`` steps in rounds of ``round_steps`` is priced for: its
    rounds', or 1 when the whole run lies within the synchronous warm-up, where every step drains (``async_spans``)."""
    return 1 if steps <= warmup else round_steps


def forward_version(schedule: str, stage: int, num_stages: int, microbatches: int, k: int, *, round_start: int = 0,
                    inflight: int | None = None, warmup: int = 0) -> int:
    """The weight version (optimizer steps taken before it) stage ``stage``'s forward of micro-batch ``k`` uses.

    ``async-1f1b``: the newest weights when the forward runs. In ``async_orders`` the forward of ``k`` follows
    the backward of ``k - d`` (``d = inflight_depth``), and a step's update follows its last backward, so the
    version is ``floor((k - d + 1) / m)`` counted from the round's first micro-batch ``round_start`` (the
    pipeline drains at round ends, where evaluation and rebalancing act). ``2bw``: every forward of step
    ``u`` uses version ``max(0, u - 1)``, PipeDream-2BW's ``W(t+1) = W(t) - lr * grad f(W(t-1))``. The
    backward of ``k`` uses the same version (weight stashing); the gradient is applied in update ``k // m``,
    so its staleness is ``k // m - forward_version``. Steps before ``warmup`` (the synchronous warm-up,
    ``async_spans``) use their own step's version under either schedule: no gradient is late."""
    step = k // microbatches
    if step < warmup:
        return step
    if schedule == "2bw":
        return max(0, step - 1)
    if schedule != "async-1f1b":
        return step
    depth = inflight_depth(stage, num_stages, inflight)
    return round_start // microbatches + max(0, (k - round_start - depth + 1) // microbatches)


@lru_cache(maxsize=1024)
def async_staleness(schedule: str, stage: int, num_stages: int, microbatches: int) -> int:
    """The most updates between the weights a stage's forward uses and the update its gradient joins, in the steady
    state of ``schedule`` (0 for flushing schedules)."""
    if schedule not in ASYNC_SCHEDULES:
        return 0
    m = microbatches
    ks = range(2 * m * num_stages, 2 * m * num_stages + m)  # one step, well past the warm-up
    return max(k // m - forward_version(schedule, stage, num_stages, m, k) for k in ks)


@lru_cache(maxsize=1024)
def stashed_versions(schedule: str, stage: int, num_stages: int, microbatches: int) -> int:
    """Weight versions a stage keeps besides its live parameters in the steady state (memory model): the
    distinct versions its in-flight micro-batches use other than the newest, over one steady step (2bw: 1)."""
    if schedule not in ASYNC_SCHEDULES:
        return 0
    m, depth = microbatches, inflight_depth(stage, num_stages)
    most = 0
    for k in range(2 * m * num_stages, 2 * m * num_stages + m):
        live = {forward_version(schedule, stage, num_stages, m, j) for j in range(k - depth + 1, k + 1)}
        newest = (k - depth + 1) // m  # updates done when the forward of k starts: the live parameters
        most = max(most, len(live - {newest}))
    return most


def version_copies(schedule: str, stages_to_end: int, microbatches: int) -> int:
    """Copies of a stage's weights an asynchronous schedule keeps besides its live parameters (memory model): every
    version it holds (the stashed ones and a snapshot of the newest), each with the optimizer's last step beside it
    and one predicted copy (``planner.runtime.pipeline.asynchronous``; counted with the correction on, which needs
    the most). A stage with ``stages_to_end`` stages from it to the last keeps ``stages_to_end`` micro-batches in
    flight. 0 for flushing schedules."""
    if schedule not in ASYNC_SCHEDULES:
        return 0
    return 3 * (stashed_versions(schedule, 0, stages_to_end, microbatches) + 1)


def async_violation(schedule: str, num_stages: int, num_devices: int, microbatches: int, degree: int = 1,
                    sync: str = "ssgd") -> str | None:
    """Why the runtime cannot run ``schedule`` on this shape (None when it can, or for a flushing schedule).
    ``num_devices``: one replica pipeline's; ``microbatches``: the smallest replica's share. Replica pipelines combine
    their updates among themselves at each update of a stage (``ssgd``: gradients summed; ``local-sgd``,
    ``adaptive``: models averaged every few updates); the parameter-server modes, which train whole-model replicas
    through a server rank, are refused."""
    if schedule not in ASYNC_SCHEDULES:
        return None
    if degree > 1 and sync in SERVER_SYNCS:
        return (f"{schedule} runs replica pipelines that combine their updates among themselves (ssgd, local-sgd, "
                f"adaptive), but the plan asks --sync {sync}, which trains whole-model replicas through a parameter "
                f"server; use one of those, or --schedule 1f1b for {sync}")
    if num_devices != num_stages:
        return (f"{schedule} runs one stage per device, but the plan puts {num_stages} stages on {num_devices} "
                f"devices; re-partition with --schedule {schedule}")
    if schedule == "2bw" and microbatches < num_stages - 1:
        per = " per replica" if degree > 1 else ""
        return (f"2bw needs at least {num_stages - 1} micro-batches per step{per} on {num_stages} stages (each step's "
                f"forwards use the weights one update old, which must exist when the step starts), found "
                f"{microbatches}; use -n {(num_stages - 1) * degree} or more")
    return None


def order_violations(orders: Sequence[Sequence[Op]], microbatches: int,
                     rank_of_stage: Sequence[int] | None = None) -> list[str]:
    """Why one pipeline's per-device orders cannot run (empty when they can). Device ``r`` holds the stages
    ``rank_of_stage`` gives it (default: stage ``r``). Each of its stages must run every micro-batch's forward once
    and its backward once, whole (``B``) or as ``I`` then ``W``; and the devices, each following its order, must
    finish (no device waits for a pass that another device runs only after it: a deadlock). Pure: no times, only the
    passes' dependencies."""
    p, m = len(orders), microbatches
    owner = list(rank_of_stage) if rank_of_stage is not None else list(range(p))
    last = len(owner) - 1
    out: list[str] = []
    for r, order in enumerate(orders):
        held = [s for s, o in enumerate(owner) if o == r]
        stray = sorted({s for _, s, _ in order} - set(held))
        if stray:
            out.append(f"rank {r} runs stage(s) {stray}, but it holds stage(s) {held} only")
            continue
        for stage in held:
            seen = [(kind, j) for kind, s, j in order if s == stage]
            extra = sorted({j for _, j in seen if not 0 <= j < m})
            broken = next((j for j in range(m) if sorted(k for k, jj in seen if jj == j)
                           not in ([BWD, FWD], [FWD, BWD_INPUT, BWD_WEIGHT])), None)
            if broken is not None:
                kinds = "".join(sorted(k for k, jj in seen if jj == broken)) or "nothing"
                which = f"stage {stage}'s " if len(held) > 1 else ""
                out.append(f"rank {r} runs {which}micro-batch {broken} as {kinds}; each micro-batch needs one F and "
                           f"either one B or one I and one W")
            if extra:
                out.append(f"rank {r} names micro-batch(es) {extra[:5]} outside 0..{m - 1}")
            if broken is not None or extra:
                break
    if out:
        return out
    done: set[tuple[str, int, int]] = set()
    position = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while position[r] < len(orders[r]):
                kind, s, j = orders[r][position[r]]
                if kind == FWD:
                    ready = s == 0 or (FWD, s - 1, j) in done
                elif kind == BWD_WEIGHT:
                    ready = (BWD_INPUT, s, j) in done
                else:
                    ready = (FWD, s, j) in done and (s == last or (BWD, s + 1, j) in done
                                                      or (BWD_INPUT, s + 1, j) in done)
                if not ready:
                    break
                done.add((kind, s, j))
                position[r] += 1
                progress = True
    stuck = [f"rank {r} at {orders[r][position[r]][1]}{orders[r][position[r]][0]}{orders[r][position[r]][2]}"
             for r in range(p) if position[r] < len(orders[r])]
    return [f"the order deadlocks: {', '.join(stuck)} wait for passes that come later in other ranks' orders"] if stuck else []
