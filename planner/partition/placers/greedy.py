"""Greedy earliest-finish-time placement for pipelines (the rebalancing patent's S2, with the device weights of S3).

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
smallest feasible value; the promising distinct cut sets are simulated, each also re-mapped onto
devices by ``mapping.map_stages`` (the fill cannot look ahead to put slow devices where they suit),
and the smallest simulated step time wins (ties: smaller bottleneck, then the order found).
Deterministic: equal finish times go to the device listed first in the cluster file.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping, Sequence

from planner.errors import InfeasibleError, UsageError
from planner.partition.model.cost import step_time_s, transfer_s
from planner.partition.model.feasibility import max_stages, no_fit_message, shape_violations
from planner.partition.placers.fill import FillContext, FillDevice, fill, work
from planner.partition.placers.mapping import exact_mapping_fits, map_stages
from planner.partition.model.problem import Partition, Problem

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
MAP_STAGES = True
"""Also simulate each simulated candidate re-mapped by ``mapping.map_stages`` (exact DP only)."""
SIMULATE_WITHIN = 1.25
"""Only candidates whose quick estimate is within this factor of the best estimate are simulated."""


def place(problem: Problem, *, weights: Mapping[str, float] | None = None, **options: Any) -> Partition:
    """Greedy EFT placement; see the module docstring. Raises ``InfeasibleError`` when nothing fits."""
    if options:
        raise UsageError(f"method 'greedy' takes no options, found {', '.join(sorted(options))}")
    ctx = _context(problem, weights or {})
    widest = fill(ctx, math.inf)
    if widest is None:
        ctx = _fewer_assumed_stages(ctx)
        widest = fill(ctx, math.inf) if ctx is not None else None
    if widest is None:
        raise InfeasibleError(no_fit_message(problem, "greedy"))
    assert ctx is not None
    candidates: dict[Partition, float] = {}
    for weight, slack in SEARCHES:
        for bottleneck, found in _bisect(replace(ctx, transfer_weight=weight, cut_slack=slack), widest):
            candidates.setdefault(found, bottleneck)
    # The feasibility rule bounds the stage count (1F1B runs at most m stages); the fill's wider periods
    # give fewer stages, so the bisection's ladder usually holds candidates within the bound.
    limit = max_stages(problem.schedule, problem.microbatches, len(problem.cluster.devices))
    allowed = [(bottleneck, found) for found, bottleneck in candidates.items() if len(found) <= limit]
    if not allowed:
        fewest = min(candidates, key=len)
        raise InfeasibleError(f"greedy found placements of {len(fewest)} or more stages only, but "
                              + shape_violations(problem.schedule, problem.microbatches, [s.device for s in fewest])[0])
    return _best_by_simulation(ctx, allowed)


def _context(problem: Problem, weights: Mapping[str, float]) -> FillContext:
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
        devices.append(FillDevice(device.id, prefix, speed, share, device.memory_bytes, unsupported, order, kind,
                               device.host))
    return FillContext(problem, tuple(devices), tables.static_per_param_byte, len(ids))


def _work_prefix(works: Sequence[float]) -> tuple[list[float], list[int]]:
    """Prefix sums of per-block fwd + bwd with non-finite times left out, and the list of those blocks."""
    prefix, unsupported, running = [0.0], [], 0.0
    for b, block_s in enumerate(works):
        if math.isfinite(block_s):
            running += block_s
        else:
            unsupported.append(b)
        prefix.append(running)
    return prefix, unsupported


def _fewer_assumed_stages(ctx: FillContext) -> FillContext | None:
    """Under 1F1B a fill with fewer stages keeps fewer micro-batches in flight; retry with smaller counts."""
    if ctx.problem.schedule == "gpipe":
        return None
    for assumed in range(ctx.assumed_stages - 1, 0, -1):
        trial = FillContext(ctx.problem, ctx.devices, ctx.static_per_param_byte, assumed)
        if fill(trial, math.inf) is not None:
            return trial
    return None


# --- one fill at a fixed period T -----------------------------------------------------------------

def _bottleneck(ctx: FillContext, partition: Partition) -> float:
    """The smallest period at which every stage fits its device's share: max over stages of work / share."""
    by_id = {d.id: d for d in ctx.devices}
    return max(work(by_id[s.device], s.start, s.stop) / by_id[s.device].share for s in partition)


def _lower_bound(ctx: FillContext) -> float:
    """A period no fill can beat: every block at its fastest, spread over all shares (they sum to n).

    Each block runs somewhere, so the devices' loads add up to at least the sum of per-block minimum
    times, and device ``d`` carries at most ``T * share_d``.
    """
    kinds = list({(id(d.work_prefix), d.speed): d for d in ctx.devices}.values())
    fastest = sum(min(work(d, b, b + 1) for d in kinds) for b in range(len(ctx.problem.blocks)))
    return fastest / sum(d.share for d in ctx.devices)


def _bisect(ctx: FillContext, widest: Partition) -> list[tuple[float, Partition]]:
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
        found = fill(ctx, mid)
        if found is None:
            lo = mid
            continue
        smallest = mid
        seen.setdefault(found, _bottleneck(ctx, found))
        hi = min(mid, seen[found])
    for k in range(1, LADDER + 1) if math.isfinite(smallest) else ():
        found = fill(ctx, smallest * (1 + k * LADDER_STEP))
        if found is not None:
            seen.setdefault(found, _bottleneck(ctx, found))
    return [(bottleneck, partition) for partition, bottleneck in seen.items()]


def _best_by_simulation(ctx: FillContext, candidates: list[tuple[float, Partition]]) -> Partition:
    """Simulate the promising candidates and their re-mapped variants; the smallest step time wins.

    Promising: by either quick pipeline estimate (``_estimate``: compute only, or with the cut
    transfers counted in full) within ``SIMULATE_WITHIN`` of the best candidate by that estimate;
    the ``MAX_SIMULATED`` closest are simulated. Each of those also gets its stages re-mapped onto
    devices by ``mapping.map_stages`` (the exact device-class DP on the shared objective, only where
    its state space fits: the fill keeps fast devices first and cannot look ahead to put the slow ones
    where a light stage or a small cut suits them), and the variant is simulated too. The originals
    stay in the race, so the mapping can only lower the step time. Ties: smaller bottleneck, then
    discovery order (originals before variants).
    """
    lean = [_estimate(ctx, partition, 0.0) for _, partition in candidates]
    full = [_estimate(ctx, partition, 1.0) for _, partition in candidates]
    best_lean, best_full = min(lean), min(full)
    score = [min(lean[i] / best_lean if best_lean > 0 else 1.0, full[i] / best_full if best_full > 0 else 1.0)
             for i in range(len(candidates))]
    ranked = sorted((score[i], i) for i in range(len(candidates)) if score[i] <= SIMULATE_WITHIN)[:MAX_SIMULATED]
    chosen = [candidates[order][1] for _, order in ranked]
    orders = [order for _, order in ranked]
    if MAP_STAGES and len(ctx.devices) > 1 and exact_mapping_fits(ctx.problem):
        seen = set(chosen)
        for partition in list(chosen):
            mapped = map_stages(ctx.problem, partition, local_search=False)
            if mapped not in seen:
                seen.add(mapped)
                chosen.append(mapped)
                orders.append(len(candidates) + len(orders))
    scored = []
    for order, partition in zip(orders, chosen):
        step = step_time_s(ctx.problem, partition)
        scored.append((step, _bottleneck(ctx, partition), order, partition))
    return min(scored, key=lambda item: item[:3])[3]


def _estimate(ctx: FillContext, partition: Partition, transfer_weight: float) -> float:
    """Quick step time: every stage's load once plus (m - 1) times the largest load.

    A stage's load is its compute plus ``transfer_weight`` times its cut transfers (both cuts, both
    directions, on the links the partition uses).
    """
    by_id = {d.id: d for d in ctx.devices}
    tables, problem = ctx.problem.tables, ctx.problem
    loads = [work(by_id[s.device], s.start, s.stop) for s in partition]
    for i in range(1, len(partition)) if transfer_weight else ():
        a, b, cut = partition[i - 1].device, partition[i].device, partition[i].start - 1
        pair = (transfer_s(tables, a, b, problem.cut_fwd_bytes[cut])
                + transfer_s(tables, b, a, problem.cut_bwd_bytes[cut])) * transfer_weight
        loads[i - 1] += pair
        loads[i] += pair
    return sum(loads) + (problem.microbatches - 1) * max(loads)



