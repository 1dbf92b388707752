"""Interleaved stages: split a one-stage-per-device plan into ``v`` model chunks per device.

Under ``interleaved-1f1b`` (Narayanan et al., SC 2021) each of the ``p`` devices holds ``v`` chunks, stage
``c * p + r`` on the ``r``-th device, and the pipeline bubble shrinks by about ``v`` at the price of ``v``
times the point-to-point transfers. The placers choose devices and one stage per device (the schedule's
one-chunk case, which the exact methods' objective describes); ``interleave`` then tries ``v = 2, 3, ...``
on the same devices in the same order and keeps the ``v`` with the lowest simulated step time that fits
in memory, ``v = 1`` (the placer's plan, run as 1F1B) included. The chunk cuts balance the devices:
chunk ``k`` runs on its own device, and the cuts are the smallest per-chunk time ``T`` for which filling
each chunk up to ``T`` on its device covers the model in ``p * v`` chunks (bisection, as
``baselines.min_max_split`` does for one device type), so each device does about ``v * T``.

Under ``zbv`` (ZB-V, Qi et al., 2024), ``dualpipev`` and ``zb-planned`` each device may hold exactly two chunks in a V (stage ``r``
and ``2p - 1 - r`` on the ``r``-th device, ``planner.partition.sim.schedules.stage_ranks``), cut the same way; the
one-chunk case (``zb-h1``'s order, or ``zb-planned``'s own on one stage per device) is kept when the V does not
simulate faster or does not fit.

What was tried and why the choice is recorded in the plan as ``interleave`` (``chunks``, the simulated
step time of each ``v``, and a sentence), so a plan that stays at one chunk says why.
"""

from __future__ import annotations

from typing import Any, Sequence

from planner.formats.plan import V_SCHEDULES
from planner.partition.model.cost import stage_compute_s, step_time_s
from planner.partition.model.feasibility import violations
from planner.partition.model.problem import Partition, Problem, StageSpec
from planner.partition.sim.schedules import stage_ranks

__all__ = ["INTERLEAVED", "MAX_CHUNKS", "interleave", "chunked"]

INTERLEAVED = "interleaved-1f1b"
MAX_CHUNKS = 4
"""The most chunks per device tried (Megatron-LM's published runs use 2-4 per device)."""


def interleave(problem: Problem, base: Partition, max_chunks: int = MAX_CHUNKS) -> tuple[Partition, dict[str, Any]]:
    """The best of ``base`` and its ``v``-chunk versions (``v <= max_chunks``), and the record of the choice.

    ``base`` must have one stage per device; other partitions (a hand-made interleaved plan) are returned
    as they are."""
    devices = [s.device for s in base]
    if problem.schedule not in (INTERLEAVED,) + V_SCHEDULES or len(set(devices)) != len(devices):
        return base, {}
    one_chunk = {INTERLEAVED: "1F1B", "zbv": "zb-h1's order", "dualpipev": "zb-h1's order"}.get(problem.schedule, "its order on one stage per device")
    times = {1: step_time_s(problem, base)}
    best, best_v = base, 1
    skipped: dict[int, str] = {}
    for v in range(2, (max_chunks if problem.schedule == INTERLEAVED else 2) + 1):
        candidate = chunked(problem, devices, v)
        if candidate is None:
            skipped[v] = f"the model has fewer than {len(devices) * v} blocks"
            break
        broken = violations(problem, candidate)
        if broken:
            skipped[v] = broken[0]
            continue
        times[v] = step_time_s(problem, candidate)
        if times[v] < times[best_v] * (1 - 1e-9):
            best, best_v = candidate, v
    tried = ", ".join(f"{v}: {t * 1e3:.3f} ms" for v, t in sorted(times.items()))
    if best_v > 1:
        why = f"{best_v} chunks per device simulate fastest ({tried})"
    elif len(times) > 1:
        why = (f"one chunk per device simulates fastest ({tried}): the extra transfers of more chunks cost more "
               f"than the bubble they save, so the plan runs as {one_chunk}")
    else:
        reason = next(iter(skipped.values()), "no other chunk count was possible")
        why = f"one chunk per device: 2 chunks per device cannot run ({reason}); the plan runs as {one_chunk}"
    record = {"chunks": best_v, "step_time_s": {str(v): t for v, t in sorted(times.items())}, "reason": why}
    if skipped:
        record["skipped"] = {str(v): text for v, text in sorted(skipped.items())}
    return best, record


def chunked(problem: Problem, devices: Sequence[str], v: int) -> Partition | None:
    """``len(devices) * v`` contiguous chunks, chunk ``k`` on ``devices[k % p]`` (under a V schedule, in a V), cut so
    that the largest chunk time on its own device is smallest (``None`` when there are fewer blocks than chunks)."""
    p, n = len(devices), len(problem.blocks)
    parts = p * v
    if n < parts:
        return None
    tables = problem.tables
    owner = [devices[r] for r in stage_ranks(problem.schedule, p, parts)]

    def fill(limit: float) -> list[int] | None:
        """Cuts when every chunk takes blocks while it stays within ``limit`` (and leaves one block for each
        chunk after it); ``None`` when the model is not covered in ``parts`` chunks."""
        bounds = [0]
        for k in range(parts):
            start, stop = bounds[-1], bounds[-1] + 1
            last_allowed = n - (parts - k - 1)
            if k == parts - 1:
                stop = n
            else:
                while stop < last_allowed and stage_compute_s(tables, owner[k], start, stop + 1) <= limit:
                    stop += 1
            bounds.append(stop)
        return bounds if all(stage_compute_s(tables, owner[k], bounds[k], bounds[k + 1]) <= limit
                             for k in range(parts)) else None

    lo = max(min(stage_compute_s(tables, d, b, b + 1) for d in set(owner)) for b in range(n))
    hi = max(stage_compute_s(tables, d, 0, n) for d in set(owner))
    bounds = fill(hi)
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        found = fill(mid)
        if found is not None:
            hi, bounds = mid, found
        else:
            lo = mid
    if bounds is None:
        return None
    return tuple(StageSpec(a, b, owner[k]) for k, (a, b) in enumerate(zip(bounds, bounds[1:])))
