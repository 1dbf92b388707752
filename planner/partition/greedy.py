"""Greedy earliest-finish-time placement for pipelines (seed 003 S2, with the device weights of S3).

Seed 003 S2 walks the graph in topological order and gives each op to the device, among those that
implement it, on which it would finish earliest: the work already queued there plus the time to
bring its inputs from other devices. A pipeline needs two changes to make that executable and
meaningful (docs/placers.md has the full mapping):

1. *Pipeline constraint.* An op may go only to the current stage's device or to a device not used
   yet, so stages stay contiguous runs of the topological order and each device holds one stage.
2. *A period to finish by.* In a pipeline every device works all the time, so "earliest finish" is
   judged against a target period ``T``: device ``d`` may queue ``capacity_d = T * w_d * n / sum(w)``
   seconds of forward + backward work per micro-batch (``w``: the S3 weights, ``n``: devices). An op
   stays on the current device while it finishes within that capacity and memory allows (static
   bytes + activations in flight for the stage's position under the schedule); otherwise it goes
   to the unused device where it finishes earliest: input transfer over the actual link plus its
   compute time there. Stage extension bisects the cost model's prefix sums (O(log n) per stage).

The search runs with three load models (``SEARCHES``: cut transfers counted in full, the same with
some slack to reach a cheaper cut, compute only), because how much transfers delay a pipeline
depends on the schedule and links; all their cut sets are candidates. In each, ``T`` is bisected
between a lower bound and the period of the memory-only fill, then tried on a ladder just above the
smallest feasible value; the promising distinct cut sets are simulated and the smallest simulated
step time wins (ties: smaller bottleneck, then the order found).
Deterministic: equal finish times go to the device listed first in the cluster file.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from planner.errors import InfeasibleError, UsageError
from planner.formats.cluster import Link
from planner.partition.cost import evaluate, inflight_microbatches, infeasible_reason, transfer_s
from planner.partition.methods import register
from planner.partition.problem import Partition, Problem, StageSpec

BISECTION_STEPS = 40
"""Upper bound on bisection steps over ``T``; it also stops once ``T`` is known to 1e-4 relative."""
LADDER, LADDER_STEP = 8, 0.02
"""Extra fills at 2%, 4%, ... 16% above the smallest feasible period found."""
MAX_SIMULATED = 10
"""How many distinct candidate cut sets the simulator judges at most."""
SEARCHES = ((1.0, 0.0), (1.0, 0.1), (0.0, 0.0))
"""(transfer weight, cut slack) of each search; the cut sets of all of them are candidates. Transfers
counted in full at both cuts (the 1F1B round trip), the same with a stage allowed to give up 10% of
its compute to end at a cheaper cut, and compute only (the simulator overlaps transfers with compute,
so the full count can overstate them)."""
SIMULATE_WITHIN = 1.25
"""Only candidates whose quick estimate is within this factor of the best estimate are simulated."""


@dataclass(frozen=True)
class _Device:
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
class _Context:
    problem: Problem
    devices: tuple[_Device, ...]
    param_prefix: Sequence[int]
    saved_prefix: Sequence[int]
    static_per_param_byte: int
    assumed_stages: int
    """Stage count used for the 1F1B in-flight count (an upper bound on the stages the fill makes)."""
    transfer_weight: float = 1.0
    """Weight of the cut transfers in a stage's load (1: counted in full; 0: compute only)."""
    cut_slack: float = 0.0
    """A stage may give up this fraction of its compute to end at a cheaper cut (``_cheapest_cut_nearby``)."""


def place(problem: Problem, *, weights: Mapping[str, float] | None = None, **options: Any) -> Partition:
    """Greedy EFT placement; see the module docstring. Raises ``InfeasibleError`` when nothing fits."""
    if options:
        raise UsageError(f"method 'greedy' takes no options, found {', '.join(sorted(options))}")
    ctx = _context(problem, weights or {})
    widest = _fill(ctx, math.inf)
    if widest is None:
        ctx = _fewer_assumed_stages(ctx)
        widest = _fill(ctx, math.inf) if ctx is not None else None
    if widest is None:
        reason = infeasible_reason(problem)
        raise InfeasibleError(reason or _no_fit_message(problem))
    assert ctx is not None
    candidates: dict[Partition, float] = {}
    for weight, slack in SEARCHES:
        for bottleneck, found in _bisect(replace(ctx, transfer_weight=weight, cut_slack=slack), widest):
            candidates.setdefault(found, bottleneck)
    return _best_by_simulation(ctx, [(bottleneck, found) for found, bottleneck in candidates.items()])


def _context(problem: Problem, weights: Mapping[str, float]) -> _Context:
    tables = problem.tables
    ids = problem.cluster.device_ids
    raw = [float(weights.get(d, 1.0)) for d in ids]
    total = sum(raw)
    by_type: dict[str, tuple[list[float], list[int]]] = {}
    devices = []
    for order, (device, weight) in enumerate(zip(problem.cluster.devices, raw)):
        if device.type not in by_type:
            by_type[device.type] = _work_prefix([sum(block.time_s[device.type]) for block in problem.blocks])
        prefix, unsupported = by_type[device.type]
        share, speed = weight * len(ids) / total, tables.speed[device.id]
        # Without per-pair links, a device's links are fixed by its host; with them, every device is its own kind.
        kind = (device.id,) if problem.cluster.pairs else (device.type, speed, share, device.memory_bytes)
        devices.append(_Device(device.id, prefix, speed, share, device.memory_bytes, unsupported, order, kind,
                               device.host))
    return _Context(problem, tuple(devices), tables.param_prefix, tables.saved_prefix,
                    tables.static_per_param_byte, len(ids))


def _work_prefix(works: Sequence[float]) -> tuple[list[float], list[int]]:
    """Prefix sums of per-block fwd + bwd with non-finite times left out, and the list of those blocks."""
    prefix, unsupported, running = [0.0], [], 0.0
    for b, work in enumerate(works):
        if math.isfinite(work):
            running += work
        else:
            unsupported.append(b)
        prefix.append(running)
    return prefix, unsupported


def _fewer_assumed_stages(ctx: _Context) -> _Context | None:
    """Under 1F1B a fill with fewer stages keeps fewer micro-batches in flight; retry with smaller counts."""
    if ctx.problem.schedule == "gpipe":
        return None
    for assumed in range(ctx.assumed_stages - 1, 0, -1):
        trial = _Context(ctx.problem, ctx.devices, ctx.param_prefix, ctx.saved_prefix, ctx.static_per_param_byte,
                         assumed)
        if _fill(trial, math.inf) is not None:
            return trial
    return None


# --- one fill at a fixed period T -----------------------------------------------------------------

def _fill(ctx: _Context, period_s: float) -> Partition | None:
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

    def __init__(self, devices: Sequence[_Device], *, by_host: bool) -> None:
        self._by_host = by_host
        self._pools: dict[tuple[Any, ...], dict[str, deque[_Device]]] = {}
        self._left_on_host: dict[str, int] = {}
        for device in devices:
            self._pools.setdefault(device.kind, {}).setdefault(device.host, deque()).append(device)
            self._left_on_host[device.host] = self._left_on_host.get(device.host, 0) + 1
        self._left = len(devices)

    def candidates(self, previous: _Device | None) -> list[_Device]:
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

    def take(self, device: _Device) -> None:
        pool = self._pools[device.kind][device.host]
        assert pool[0] is device
        pool.popleft()
        self._left_on_host[device.host] -= 1
        self._left -= 1

    def outbound_link(self, ctx: _Context, device: _Device) -> Link | None:
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


def _inbound_s(ctx: _Context, previous: str | None, device: str, start: int) -> float:
    """Seconds per micro-batch on the link from the previous stage: activations in, gradients back."""
    if previous is None or start == 0:
        return 0.0
    problem = ctx.problem
    return ctx.transfer_weight * (transfer_s(problem.tables, previous, device, problem.cut_fwd_bytes[start - 1])
                                  + transfer_s(problem.tables, device, previous, problem.cut_bwd_bytes[start - 1]))


def _outbound_s(ctx: _Context, link: Link | None, stop: int) -> float:
    """Seconds per micro-batch to send the cut after block ``stop - 1`` onwards and take its gradients back."""
    if link is None or stop >= len(ctx.problem.blocks):
        return 0.0
    problem = ctx.problem
    return ctx.transfer_weight * (link.transfer_s(problem.cut_fwd_bytes[stop - 1])
                                  + link.transfer_s(problem.cut_bwd_bytes[stop - 1]))


def _earliest_finish(ctx: _Context, unused: Sequence[_Device], block: int, previous: _Device | None,
                     period_s: float, stage_index: int) -> _Device | None:
    """S2: among unused devices that implement ``block`` and can hold it, the one where it finishes first.

    Finish time = its inputs' transfer over the actual link from the previous stage's device + its
    compute time there (an unused device has nothing queued), free ops folded into the next costly
    one (``_first_costly``). Ties keep the earlier device.
    """
    problem = ctx.problem
    links = problem.tables.links
    fwd_bytes = problem.cut_fwd_bytes[block - 1] if previous is not None else 0
    bwd_bytes = problem.cut_bwd_bytes[block - 1] if previous is not None else 0
    need_bytes = _memory_bytes(ctx, block, block + 1, _inflight(ctx, stage_index))  # the same on every device
    best, best_finish = None, math.inf
    for device in unused:
        if need_bytes > device.memory_bytes or _blocked(device, block, block + 1):
            continue
        arrival = links[(previous.id, device.id)].transfer_s(fwd_bytes) if previous is not None else 0.0
        back = links[(device.id, previous.id)].transfer_s(bwd_bytes) if previous is not None else 0.0
        if _work(device, block, block + 1) + ctx.transfer_weight * (arrival + back) > period_s * device.share:
            continue
        finish = arrival + _work(device, block, _first_costly(device, block) + 1)
        if finish < best_finish or (finish == best_finish and best is not None and device.order < best.order):
            best, best_finish = device, finish
    return best


def _first_costly(device: _Device, block: int) -> int:
    """The first block at or after ``block`` with non-zero work on ``device`` (the last block if none).

    Free ops (model inputs, views) finish at once everywhere; judging a device by them would make
    every choice a tie, so the finish time is that of the run up to the next op that costs something.
    """
    prefix = device.work_prefix
    return min(bisect_right(prefix, prefix[block]) - 1, len(prefix) - 2)


def _extend(ctx: _Context, device: _Device, start: int, capacity_s: float, inbound_s: float,
            outbound: Link | None, stage_index: int) -> int:
    """The furthest stop such that blocks ``[start, stop)`` fit ``device``'s capacity, memory and kernels.

    The load is the stage's compute plus ``transfer_weight`` times the transfers at both of its cuts
    (seed 003 S2 counts the time to bring inputs; in a 1F1B steady state the outbound cut's round
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
    while stop > start + 1 and _work(device, start, stop) + _outbound_s(ctx, outbound, stop) > budget:
        stop -= 1
    return _cheapest_cut_nearby(ctx, device, start, stop, outbound)


def _cheapest_cut_nearby(ctx: _Context, device: _Device, start: int, stop: int, outbound: Link | None) -> int:
    """Among stops keeping at least ``1 - cut_slack`` of the stage's compute, the one with the cheapest cut.

    The next stage pays the same cut again on its way in, which the furthest stop does not see.
    """
    if ctx.cut_slack <= 0 or outbound is None or stop >= len(ctx.problem.blocks):
        return stop
    prefix = device.work_prefix
    floor = prefix[start] + (1 - ctx.cut_slack) * (prefix[stop] - prefix[start])
    first = max(bisect_left(prefix, floor), start + 1)
    return min(range(first, stop + 1), key=lambda k: (_outbound_s(ctx, outbound, k), -k))


def _memory_stop(ctx: _Context, device: _Device, start: int, stop: int, stage_index: int) -> int:
    """Largest ``k`` in ``(start, stop]`` with blocks ``[start, k)`` in memory (bisection; memory grows with k)."""
    inflight = _inflight(ctx, stage_index)
    lo, hi = start + 1, stop
    if _memory_bytes(ctx, start, hi, inflight) <= device.memory_bytes:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _memory_bytes(ctx, start, mid, inflight) <= device.memory_bytes:
            lo = mid
        else:
            hi = mid
    return lo


def _inflight(ctx: _Context, stage_index: int) -> int:
    """Micro-batches whose activations the stage at ``stage_index`` holds at its peak (cost model's rule)."""
    problem = ctx.problem
    return inflight_microbatches(problem.schedule, stage_index, ctx.assumed_stages, problem.microbatches)


def _memory_bytes(ctx: _Context, start: int, stop: int, inflight: int) -> int:
    """Static bytes + saved activations x micro-batches in flight of blocks ``[start, stop)``."""
    static = (ctx.param_prefix[stop] - ctx.param_prefix[start]) * ctx.static_per_param_byte
    return static + (ctx.saved_prefix[stop] - ctx.saved_prefix[start]) * inflight


def _work(device: _Device, start: int, stop: int) -> float:
    return (device.work_prefix[stop] - device.work_prefix[start]) * device.speed


def _blocked(device: _Device, start: int, stop: int) -> bool:
    i = bisect_left(device.unsupported, start)
    return i < len(device.unsupported) and device.unsupported[i] < stop


# --- the search over T ----------------------------------------------------------------------------

def _bottleneck(ctx: _Context, partition: Partition) -> float:
    """The smallest period at which every stage fits its device's share: max over stages of work / share."""
    by_id = {d.id: d for d in ctx.devices}
    return max(_work(by_id[s.device], s.start, s.stop) / by_id[s.device].share for s in partition)


def _lower_bound(ctx: _Context) -> float:
    """A period no fill can beat: every block at its fastest, spread over all shares (they sum to n).

    Each block runs somewhere, so the devices' loads add up to at least the sum of per-block minimum
    times, and device ``d`` carries at most ``T * share_d``.
    """
    kinds = list({(id(d.work_prefix), d.speed): d for d in ctx.devices}.values())
    fastest = sum(min(_work(d, b, b + 1) for d in kinds) for b in range(len(ctx.problem.blocks)))
    return fastest / sum(d.share for d in ctx.devices)


def _bisect(ctx: _Context, widest: Partition) -> list[tuple[float, Partition]]:
    """Bisect ``T``, then fill on a ladder just above the smallest feasible ``T`` found.

    Returns every distinct feasible cut set met, with its bottleneck, in discovery order. The ladder
    (``T* x (1 + k LADDER_STEP)``) makes the candidates depend on ``T*`` rather than on the bisection's
    path, and offers the simulator slightly looser cut sets, which can pipeline better.
    """
    seen: dict[Partition, float] = {widest: _bottleneck(ctx, widest)}
    lo, hi = _lower_bound(ctx), seen[widest]
    smallest = math.inf
    for _ in range(BISECTION_STEPS):
        if hi - lo <= 1e-4 * hi:
            break
        mid = (lo + hi) / 2
        found = _fill(ctx, mid)
        if found is None:
            lo = mid
            continue
        smallest = mid
        seen.setdefault(found, _bottleneck(ctx, found))
        hi = min(mid, seen[found])
    for k in range(1, LADDER + 1) if math.isfinite(smallest) else ():
        found = _fill(ctx, smallest * (1 + k * LADDER_STEP))
        if found is not None:
            seen.setdefault(found, _bottleneck(ctx, found))
    return [(bottleneck, partition) for partition, bottleneck in seen.items()]


def _best_by_simulation(ctx: _Context, candidates: list[tuple[float, Partition]]) -> Partition:
    """Simulate the promising candidates; the smallest step time wins (ties: bottleneck, discovery order).

    Promising: by either quick pipeline estimate (``_estimate``: compute only, or with the cut
    transfers counted in full) within ``SIMULATE_WITHIN`` of the best candidate by that estimate;
    the ``MAX_SIMULATED`` closest are simulated.
    """
    lean = [_estimate(ctx, partition, 0.0) for _, partition in candidates]
    full = [_estimate(ctx, partition, 1.0) for _, partition in candidates]
    best_lean, best_full = min(lean), min(full)
    score = [min(lean[i] / best_lean if best_lean > 0 else 1.0, full[i] / best_full if best_full > 0 else 1.0)
             for i in range(len(candidates))]
    ranked = sorted((score[i], i) for i in range(len(candidates)) if score[i] <= SIMULATE_WITHIN)[:MAX_SIMULATED]
    scored = []
    for _, order in ranked:
        bottleneck, partition = candidates[order]
        step = evaluate(ctx.problem, partition, record_events=False).step_time_s
        scored.append((step, bottleneck, order, partition))
    return min(scored, key=lambda item: item[:3])[3]


def _estimate(ctx: _Context, partition: Partition, transfer_weight: float) -> float:
    """Quick step time: every stage's load once plus (m - 1) times the largest load.

    A stage's load is its compute plus ``transfer_weight`` times its cut transfers (both cuts, both
    directions, on the links the partition uses).
    """
    by_id = {d.id: d for d in ctx.devices}
    tables, problem = ctx.problem.tables, ctx.problem
    loads = [_work(by_id[s.device], s.start, s.stop) for s in partition]
    for i in range(1, len(partition)) if transfer_weight else ():
        a, b, cut = partition[i - 1].device, partition[i].device, partition[i].start - 1
        pair = (transfer_s(tables, a, b, problem.cut_fwd_bytes[cut])
                + transfer_s(tables, b, a, problem.cut_bwd_bytes[cut])) * transfer_weight
        loads[i - 1] += pair
        loads[i] += pair
    return sum(loads) + (problem.microbatches - 1) * max(loads)


def _no_fit_message(problem: Problem) -> str:
    largest = max(problem.cluster.devices, key=lambda d: (d.memory_bytes, d.id))
    return (f"greedy found no placement that fits in memory on {len(problem.cluster.devices)} devices under "
            f"{problem.schedule} with {problem.microbatches} micro-batches (largest device {largest.id!r}: "
            f"{largest.memory_bytes} bytes); use more or larger devices, fewer micro-batches in flight, or --method ilp")


register("greedy", place, takes_weights=True)
