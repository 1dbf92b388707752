"""One training step of a plan: a pipeline, or replica pipelines and their sync, on cores that may be shared.

``simulate_step`` is what every figure of a plan's step time comes from (``cost.evaluate`` for placers,
polish, the guard and re-plans; ``report.replay`` for saved plans): ``simulate`` for one pipeline,
``simulate_hybrid`` for replicas, then the shared-cores stretch below.

Shared cores: ranks that are processes on one host's CPU cores cannot all compute at once.

The simulator gives every device its own processor, as GPUs have. CPU ranks share their host's cores
(``runtime.host_cores``): the operating system gives ``n`` busy processes on ``c < n`` cores ``c / n`` of a core
each. Where a real step falls between one in which every rank runs at full speed (the simulator's) and one in which
all run at ``cores / ranks`` of it throughout depends on how much the ranks overlap, so the overlap is simulated:

1. **Shares** (``shared_stretch``): on a host with more of the plan's devices than cores, each device's times are
   stretched by the mean number of the host's devices busy while it is busy, over the cores (at least 1), and
   the step simulated again; the shares move with the stretch they cause, so this repeats, half-way each time,
   until they move by under 0.1% (3 or 4 rounds). A pass that overlaps four busy ranks on two cores takes twice as
   long; one that runs while the others wait in a bubble keeps its speed.
2. **The processor-sharing bound**: a host whose devices are busy ``W`` processor-seconds per step (compute,
   copies, the optimizer step and the sync are all work of those cores) needs at least ``W / cores`` seconds of
   wall time; when the simulated step is shorter, every time of that host's devices is stretched by
   ``W / (cores * step)`` on top and the step simulated again (two rounds at most).

Measured on the 2-core machine this was developed on, 2-stage x 2-replica plans of ``gpt_small`` on 4 ranks ran
1.14-1.16x the bound alone (docs/bench-run.md, 2026-11-26); the shares predict 1.10x of it on such a plan, and the
runs then measured 1.5-8.6% above the prediction with them (2026-11-27).
"""

from __future__ import annotations

import math
from dataclasses import replace
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

import numpy as np

from planner.formats.cluster import Cluster
from planner.formats.plan import ASYNC_SCHEDULES
from planner.partition.sim.hybrid import simulate_async_replicas, simulate_hybrid
from planner.partition.sim.simulate import SimResult, SimStage, simulate

__all__ = ["core_stretch", "settle", "shared_stretch", "simulate_step"]

ROUNDS = 2
"""Re-simulations at most; the first stretch leaves a few percent (unscaled copies and per-pass costs)."""


def host_work(result: SimResult, cluster: Cluster) -> dict[str, float]:
    """Host -> processor-seconds its devices are busy in ``result`` (compute, copies, updates, sync)."""
    work: dict[str, float] = {}
    for device, stats in result.devices.items():
        host = cluster.device(device).host
        work[host] = work.get(host, 0.0) + stats.busy_s
    return work


def core_stretch(work: Mapping[str, float], step_s: float, cluster: Cluster) -> dict[str, float]:
    """Host -> the factor by which its devices' times must grow so that ``work`` (host -> processor-seconds, as
    profiled) fits in its cores over a step of ``step_s``; hosts that keep up are absent."""
    if not cluster.host_cores or step_s <= 0:
        return {}
    capacity = cluster.host_cores * step_s
    return {host: w / capacity for host, w in work.items() if w > capacity * (1 + 1e-6)}


def settle(run: Callable[[Mapping[str, float], bool], SimResult], cluster: Cluster, devices: Sequence[str],
           record_events: bool = True) -> SimResult:
    """``run(stretch, events)`` (device -> factor on its times, empty: as profiled; whether to record events) until
    each device of a host crowded with ``devices`` runs at its share of the cores (``shared_stretch``), and every
    host's work, as profiled, fits in its cores over the step (the processor-sharing bound)."""
    crowded = _crowded(cluster, devices)
    result = run({}, crowded or record_events)
    if not cluster.host_cores:
        return result
    work = host_work(result, cluster)
    stretch: dict[str, float] = {}
    for _ in range(SHARE_ROUNDS if crowded else 0):
        target = shared_stretch(result, cluster)
        # half-way (geometrically) from the last stretch: the shares move with the stretch they cause
        new = {d: math.sqrt(stretch.get(d, f) * f) for d, f in target.items()}
        settled = bool(stretch) and all(abs(new[d] / stretch.get(d, 1.0) - 1) < SHARE_TOLERANCE for d in new)
        stretch = new
        result = run(stretch, True)
        if settled:
            break
    for _ in range(ROUNDS):
        more = core_stretch(work, result.step_time_s, cluster)
        if not more:
            break
        stretch = {d.id: stretch.get(d.id, 1.0) * more.get(d.host, 1.0) for d in cluster.devices
                   if d.id in stretch or d.host in more}
        result = run(stretch, record_events)
    return replace(result, core_stretch=MappingProxyType({d: f for d, f in stretch.items()
                                                          if d in result.devices and f != 1.0}))


SHARE_ROUNDS = 6
"""Re-simulations at most for the cores' shares to settle (3 or 4 move them by under ``SHARE_TOLERANCE`` on the
plans measured)."""
SHARE_TOLERANCE = 1e-3


def _crowded(cluster: Cluster, devices: Sequence[str]) -> bool:
    """Whether some host runs more of ``devices`` than it has cores (``runtime.host_cores``; 0: not said)."""
    if not cluster.host_cores:
        return False
    per_host: dict[str, int] = {}
    for device in set(devices):
        host = cluster.device(device).host
        per_host[host] = per_host.get(host, 0) + 1
    return any(n > cluster.host_cores for n in per_host.values())


def shared_stretch(result: SimResult, cluster: Cluster) -> dict[str, float]:
    """Device -> how much longer its work takes on its host's cores, shared fairly: over its busy time, the mean
    number of the host's devices busy at once, over the cores (1 where they never outnumber the cores).

    The operating system gives ``n`` busy processes on ``c < n`` cores ``c / n`` of a core each, so a pass that
    overlaps more busy ranks takes longer than one in a bubble of the others. ``result.events`` must be recorded."""
    busy: dict[str, list[tuple[float, float, str]]] = {}
    for e in result.events:
        if "->" not in e.resource and e.end_s > e.start_s:  # a device's busy interval, not a link's
            busy.setdefault(cluster.device(e.resource).host, []).append((e.start_s, e.end_s, e.resource))
    out: dict[str, float] = {}
    for intervals in busy.values():
        starts = np.array([a for a, _, _ in intervals])
        ends = np.array([b for _, b, _ in intervals])
        points = np.unique(np.concatenate([starts, ends]))
        left = points[:-1]
        running = (np.searchsorted(np.sort(starts), left, side="right")
                   - np.searchsorted(np.sort(ends), left, side="right"))  # devices busy on each segment
        overlap = np.concatenate([[0.0], np.cumsum(running * np.diff(points))])  # its integral up to each point
        shared = np.interp(ends, points, overlap) - np.interp(starts, points, overlap)
        totals: dict[str, list[float]] = {}
        for (a, b, device), together in zip(intervals, shared):
            t = totals.setdefault(device, [0.0, 0.0])
            t[0] += together
            t[1] += b - a
        for device, (together, alone) in totals.items():
            out[device] = max(1.0, together / alone / cluster.host_cores)
    return out


def simulate_step(pipelines: Sequence[Sequence[SimStage]], shares: Sequence[int], sync_s: Sequence[float],
                  cluster: Cluster, schedule: str, *, period: int = 1, overlap: bool = False,
                  record_events: bool = True, drain_every: int | None = None,
                  tied: Sequence[tuple[Sequence[int], int]] = ()) -> SimResult:
    """One step of replica pipelines ``pipelines[r]`` with ``shares[r]`` micro-batches each (one pipeline without
    syncs: the plain pipeline simulation), then ``sync_s[s]`` to all-reduce stage ``s``; settled on
    shared cores. With ``period`` local steps between aggregations (``local-sgd``, ``adaptive``) the step is the
    mean step: each aggregation's time is spread over the ``period`` steps it serves. With ``overlap``
    (``adaptive``: the aggregation travels under the next steps, as many as it needs up to the next one), only what
    outlasts ``period`` steps' compute is charged (``exposed_sync_s``). ``drain_every``: an asynchronous pipeline's
    steps between drains (``simulate``);
    asynchronous replicas: ``simulate_async_replicas``. ``tied``: each replica pipeline's tied parameter sets
    (``simulate``), all-reduced within the pipeline before its replicas sync."""
    if overlap and len(pipelines) > 1:
        sync_s = exposed_sync_s(sync_s, compute_only_s(pipelines, shares, cluster, schedule), period)
    sync_s = [s / period for s in sync_s]
    if len(pipelines) == 1 and not any(sync_s):
        return settle(lambda stretch, events: simulate(_stretched(pipelines[0], stretch), cluster, schedule, shares[0],
                                                       record_events=events, drain_every=drain_every, tied=tied),
                      cluster, [st.device for st in pipelines[0]], record_events)

    def run(stretch: Mapping[str, float], events: bool) -> SimResult:
        synced = [s * max(stretch.get(p[i].device, 1.0) for p in pipelines) for i, s in enumerate(sync_s)]
        if schedule in ASYNC_SCHEDULES:
            return simulate_async_replicas([_stretched(p, stretch) for p in pipelines], shares, synced, cluster,
                                           schedule, drain_every=drain_every, record_events=events)
        return simulate_hybrid([_stretched(p, stretch) for p in pipelines], shares, synced, cluster, schedule,
                               record_events=events, tied=tied)

    return settle(run, cluster, [st.device for p in pipelines for st in p], record_events)


def compute_only_s(pipelines: Sequence[Sequence[SimStage]], shares: Sequence[int], cluster: Cluster,
                   schedule: str) -> float:
    """The replicas' step without any sync: the compute an overlapped aggregation can hide behind."""
    return simulate_step(pipelines, shares, [0.0] * len(pipelines[0]), cluster, schedule, record_events=False).step_time_s


def exposed_sync_s(sync_s: Sequence[float], compute_s: float, steps: int = 1) -> list[float]:
    """Each stage's aggregation time that the next ``steps`` steps' compute (``compute_s`` each) does not hide."""
    return [max(s - steps * compute_s, 0.0) for s in sync_s]


def _stretched(sims: Sequence[SimStage], stretch: Mapping[str, float]) -> tuple[SimStage, ...]:
    """The stages with their device's stretch applied to compute and update times (a zero-bubble stage's weight
    gradient with the rest of its backward)."""
    if not stretch:
        return tuple(sims)
    return tuple(replace(st, fwd_s=st.fwd_s * f, bwd_s=st.bwd_s * f, update_s=st.update_s * f,
                         bwd_weight_s=st.bwd_weight_s * f, split_excess_s=st.split_excess_s * f)
                 if (f := stretch.get(st.device, 1.0)) != 1.0 else st for st in sims)
