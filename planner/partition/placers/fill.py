"""One greedy fill at a fixed period ``T``: the inner loop of the ``greedy`` placer (the rebalancing patent's S2).

Walk the blocks in order; the current stage's device keeps taking blocks while its load (compute,
plus the weighted transfers at the stage's cuts) stays within its capacity ``T * share`` and its
memory; then the unused device where the next block finishes earliest (input transfer over the
actual link plus its compute there) opens the next stage. ``fill`` returns the stages, or ``None``
when the devices run out first. See ``planner.partition.placers.greedy`` and docs/placers.md.

Public (to ``greedy``): ``FillDevice``, ``FillContext``, ``fill``, ``work``.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from planner.formats.cluster import Link
from planner.partition.model.cost import (inflight_microbatches, stage_activation_need_t, stage_param_bytes_t,
                                          transfer_s)
from planner.partition.sim.schedules import version_copies
from planner.partition.model.problem import Partition, Problem, StageSpec


@dataclass(frozen=True)
class FillDevice:
    """One device's constants for the fill: its prefix sums, speed, share and memory."""

    id: str
    work_prefix: Sequence[float]
    """Forward + backward seconds of blocks ``0 .. k-1`` on this device's type (speed factor not applied)."""
    speed: float
    share: float
    """``w_d * n / sum(w)``: the fraction of the period ``T`` this device may fill."""
    memory_bytes: int
    unsupported: Sequence[int]
    """Sorted indices of blocks this device's type has no (finite) time for: it cannot run them."""
    order: int
    """Position in the cluster file: ties go to the earlier device."""
    kind: tuple[Any, ...]
    """Devices of one kind on one host are interchangeable for the fill (same type, speed, share, memory)."""
    host: str


@dataclass(frozen=True)
class FillContext:
    """Everything one fill reads: the problem, its devices, prefix sums and the search's load model."""

    problem: Problem
    devices: tuple[FillDevice, ...]
    static_per_param_byte: int
    assumed_stages: int
    """Stage count used for the 1F1B in-flight count (an upper bound on the stages the fill makes)."""
    transfer_weight: float = 1.0
    """Weight of the cut transfers in a stage's load (1: counted in full; 0: compute only)."""
    cut_slack: float = 0.0
    """A stage may give up this fraction of its compute to end at a cheaper cut (``_cheapest_cut_nearby``)."""


def fill(ctx: FillContext, period_s: float) -> Partition | None:
    """Walk the blocks once at period ``period_s``; ``None`` when the devices run out first."""
    n = len(ctx.problem.blocks)
    unused = _Pools(ctx.devices, by_host=not ctx.problem.cluster.pairs)
    stages: list[StageSpec] = []
    start, previous = 0, None
    while start < n:
        if len(stages) == ctx.assumed_stages:
            return None
        stage_index = len(stages)
        choice = _earliest_finish(ctx, unused.candidates(previous), start, previous, period_s, stage_index)
        if choice is None:
            return None
        unused.take(choice)
        inbound = _inbound_s(ctx, previous.id if previous else None, choice.id, start)
        outbound = unused.outbound_link(ctx, choice)
        stop = _extend(ctx, choice, start, period_s * choice.share, inbound, outbound, stage_index)
        stages.append(StageSpec(start, stop, choice.id))
        start, previous = stop, choice
    return tuple(stages)


class _Pools:
    """Unused devices grouped by kind and host; only a few of them need evaluating for each stage.

    Without per-pair links, a device's links to the previous stage's device are the intra-host link
    (same host) or the inter-host link (any other host). Devices of one kind then differ only in that,
    so per kind two candidates suffice: the first unused one on the previous device's host and the
    first unused one on another host (in the cluster's order of hosts). Equal finish times go to the
    device listed first among equals, so the fill is deterministic.
    """

    def __init__(self, devices: Sequence[FillDevice], *, by_host: bool) -> None:
        self._by_host = by_host
        self._pools: dict[tuple[Any, ...], dict[str, deque[FillDevice]]] = {}
        self._left_on_host: dict[str, int] = {}
        for device in devices:
            self._pools.setdefault(device.kind, {}).setdefault(device.host, deque()).append(device)
            self._left_on_host[device.host] = self._left_on_host.get(device.host, 0) + 1
        self._left = len(devices)

    def candidates(self, previous: FillDevice | None) -> list[FillDevice]:
        out = []
        for hosts in self._pools.values():
            same = hosts.get(previous.host) if previous is not None and self._by_host else None
            if same:
                out.append(same[0])
            for host, pool in hosts.items():
                if pool and pool is not same:
                    out.append(pool[0])
                    if self._by_host:
                        break
        return out

    def take(self, device: FillDevice) -> None:
        pool = self._pools[device.kind][device.host]
        assert pool[0] is device
        pool.popleft()
        self._left_on_host[device.host] -= 1
        self._left -= 1

    def outbound_link(self, ctx: FillContext, device: FillDevice) -> Link | None:
        """The fastest link from ``device`` to a device still unused: where the next stage will most likely go."""
        if not self._left:
            return None
        cluster = ctx.problem.cluster
        if self._by_host:
            intra = self._left_on_host[device.host] > 0
            inter = self._left > self._left_on_host[device.host]
            links = ([cluster.intra_host] if intra else []) + ([cluster.inter_host] if inter else [])
        else:
            links = [ctx.problem.tables.links[(device.id, other.id)] for other in self.candidates(None)]
        return min(links, key=lambda link: (1 / link.bandwidth_Bps, link.latency_s))


def _inbound_s(ctx: FillContext, previous: str | None, device: str, start: int) -> float:
    """Seconds per micro-batch on the link from the previous stage: activations in, gradients back."""
    if previous is None or start == 0:
        return 0.0
    problem = ctx.problem
    return ctx.transfer_weight * (transfer_s(problem.tables, previous, device, problem.cut_fwd_bytes[start - 1])
                                  + transfer_s(problem.tables, device, previous, problem.cut_bwd_bytes[start - 1]))


def _outbound_s(ctx: FillContext, link: Link | None, stop: int) -> float:
    """Seconds per micro-batch to send the cut after block ``stop - 1`` onwards and take its gradients back."""
    if link is None or stop >= len(ctx.problem.blocks):
        return 0.0
    problem = ctx.problem
    return ctx.transfer_weight * (link.transfer_s(problem.cut_fwd_bytes[stop - 1])
                                  + link.transfer_s(problem.cut_bwd_bytes[stop - 1]))


def _earliest_finish(ctx: FillContext, unused: Sequence[FillDevice], block: int, previous: FillDevice | None,
                     period_s: float, stage_index: int) -> FillDevice | None:
    """S2: among unused devices that implement ``block`` and can hold it, the one where it finishes first.

    Finish time = its inputs' transfer over the actual link from the previous stage's device + its
    compute time there (an unused device has nothing queued), free ops folded into the next costly
    one (``_first_costly``). Ties keep the earlier device.
    """
    problem = ctx.problem
    links = problem.tables.links
    fwd_bytes = problem.cut_fwd_bytes[block - 1] if previous is not None else 0
    bwd_bytes = problem.cut_bwd_bytes[block - 1] if previous is not None else 0
    need_bytes = _memory_bytes(ctx, block, block + 1, _memory_terms(ctx, stage_index))  # the same on every device
    best, best_finish = None, math.inf
    for device in unused:
        if need_bytes > device.memory_bytes or _blocked(device, block, block + 1):
            continue
        arrival = links[(previous.id, device.id)].transfer_s(fwd_bytes) if previous is not None else 0.0
        back = links[(device.id, previous.id)].transfer_s(bwd_bytes) if previous is not None else 0.0
        if work(device, block, block + 1) + ctx.transfer_weight * (arrival + back) > period_s * device.share:
            continue
        finish = arrival + work(device, block, _first_costly(device, block) + 1)
        if finish < best_finish or (finish == best_finish and best is not None and device.order < best.order):
            best, best_finish = device, finish
    return best


def _first_costly(device: FillDevice, block: int) -> int:
    """The first block at or after ``block`` with non-zero work on ``device`` (the last block if none).

    Free ops (model inputs, views) finish at once everywhere; judging a device by them would make
    every choice a tie, so the finish time is that of the run up to the next op that costs something.
    """
    prefix = device.work_prefix
    return min(bisect_right(prefix, prefix[block]) - 1, len(prefix) - 2)


def _extend(ctx: FillContext, device: FillDevice, start: int, capacity_s: float, inbound_s: float,
            outbound: Link | None, stage_index: int) -> int:
    """The furthest stop such that blocks ``[start, stop)`` fit ``device``'s capacity, memory and kernels.

    The load is the stage's compute plus ``transfer_weight`` times the transfers at both of its cuts
    (the rebalancing patent's S2 counts the time to bring inputs; in a 1F1B steady state the outbound cut's round
    trip delays the stage too).
    Compute bounds the stop by bisection on the prefix sums; the stop then steps back to the last
    cut whose transfers also fit, which is usually within a few ops (cut bytes vary inside a layer).
    """
    prefix = device.work_prefix
    budget = capacity_s - inbound_s
    if math.isinf(capacity_s):
        stop = len(prefix) - 1
    else:
        target = prefix[start] + budget / device.speed
        stop = bisect_right(prefix, target + 1e-12 * abs(target)) - 1
    first_blocked = bisect_left(device.unsupported, start)
    if first_blocked < len(device.unsupported):
        stop = min(stop, device.unsupported[first_blocked])
    stop = _memory_stop(ctx, device, start, stop, stage_index)
    while stop > start + 1 and work(device, start, stop) + _outbound_s(ctx, outbound, stop) > budget:
        stop -= 1
    return _cheapest_cut_nearby(ctx, device, start, stop, outbound)


def _cheapest_cut_nearby(ctx: FillContext, device: FillDevice, start: int, stop: int, outbound: Link | None) -> int:
    """Among stops keeping at least ``1 - cut_slack`` of the stage's compute, the one with the cheapest cut.

    The next stage pays the same cut again on its way in, which the furthest stop does not see.
    """
    if ctx.cut_slack <= 0 or outbound is None or stop >= len(ctx.problem.blocks):
        return stop
    prefix = device.work_prefix
    floor = prefix[start] + (1 - ctx.cut_slack) * (prefix[stop] - prefix[start])
    first = max(bisect_left(prefix, floor), start + 1)
    return min(range(first, stop + 1), key=lambda k: (_outbound_s(ctx, outbound, k), -k))


def _memory_stop(ctx: FillContext, device: FillDevice, start: int, stop: int, stage_index: int) -> int:
    """Largest ``k`` in ``(start, stop]`` with blocks ``[start, k)`` in memory (bisection; memory grows with k)."""
    terms = _memory_terms(ctx, stage_index)
    lo, hi = start + 1, stop
    if _memory_bytes(ctx, start, hi, terms) <= device.memory_bytes:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _memory_bytes(ctx, start, mid, terms) <= device.memory_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def inflight_at(ctx: FillContext, stage_index: int) -> int:
    """Micro-batches whose activations the stage at ``stage_index`` holds at its peak (cost model's rule)."""
    problem = ctx.problem
    return inflight_microbatches(problem.schedule, stage_index, ctx.assumed_stages, problem.microbatches)


def _memory_terms(ctx: FillContext, stage_index: int) -> tuple[int, int]:
    """What a stage at ``stage_index`` keeps per byte of its blocks, besides their static bytes: micro-batches in
    flight (per saved byte) and an asynchronous schedule's weight copies (per parameter byte,
    ``cost.stage_stash_bytes_t``'s ``version_copies``)."""
    problem = ctx.problem
    stages_to_end = max(ctx.assumed_stages - stage_index, 1)
    return inflight_at(ctx, stage_index), version_copies(problem.schedule, stages_to_end, problem.microbatches)


def _memory_bytes(ctx: FillContext, start: int, stop: int, terms: tuple[int, int]) -> int:
    """Static bytes + saved activations x micro-batches in flight + weight versions of blocks ``[start, stop)``
    (``terms`` from ``_memory_terms``)."""
    inflight, copies = terms
    params = stage_param_bytes_t(ctx.problem.tables, start, stop)
    return params * (ctx.static_per_param_byte + copies) + stage_activation_need_t(ctx.problem.tables, start, stop,
                                                                                   inflight)


def work(device: FillDevice, start: int, stop: int) -> float:
    return (device.work_prefix[stop] - device.work_prefix[start]) * device.speed


def _blocked(device: FillDevice, start: int, stop: int) -> bool:
    i = bisect_left(device.unsupported, start)
    return i < len(device.unsupported) and device.unsupported[i] < stop


# --- the search over T ----------------------------------------------------------------------------
