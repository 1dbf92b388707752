"""One training step of a hybrid plan: ``d`` replica pipelines with their shares, then each stage's sync.

Each replica pipeline runs its own share of the step's micro-batches on its own devices (``simulate`` with
``updates=False``); the pipelines share no device and no directed link, so they are simulated one by one.
Then every stage's replicas all-reduce their gradients (``planner.partition.model.allreduce``), starting when
the last of them has finished its backward passes -- the runtime reduces in the last micro-batch's backward
(DDP buckets, ``planner.runtime.data_parallel``), and the model starts the sync at that backward's end, which
leaves out the overlap of the buckets with that one backward. A device holding several stages syncs them
one after another, the last stage's first (it finishes its backward first). Each device then steps its
optimizer. The sync occupies the devices of the group (on CPU ranks gloo moves the bytes with the
processors); its events are drawn on the devices and on the ring's links.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Sequence

from planner.errors import PlannerError
from planner.formats.cluster import Cluster
from planner.partition.sim.simulate import BY_TIME, DeviceStats, Event, SimResult, SimStage, simulate

__all__ = ["simulate_hybrid", "simulate_async_replicas"]


def simulate_hybrid(pipelines: Sequence[Sequence[SimStage]], shares: Sequence[int], sync_s: Sequence[float],
                    cluster: Cluster, schedule: str, *, record_events: bool = True,
                    tied: Sequence[tuple[Sequence[int], int]] = ()) -> SimResult:
    """Simulate one step of replica pipelines ``pipelines[r]`` (stages in order) with ``shares[r]`` micro-batches
    each, and ``sync_s[s]`` seconds to all-reduce stage ``s``'s gradients over its replicas; each pipeline first
    all-reduces its ``tied`` parameter sets within itself (``simulate``)."""
    if len(pipelines) != len(shares) or not pipelines:
        raise PlannerError(f"{len(pipelines)} replica pipelines but {len(shares)} shares; give one share per replica")
    if any(len(p) != len(pipelines[0]) for p in pipelines) or len(sync_s) != len(pipelines[0]):
        raise PlannerError("every replica pipeline needs the same stages, and every stage one sync time")
    runs = [simulate(p, cluster, schedule, m, record_events=record_events, updates=False, tied=tied)
            for p, m in zip(pipelines, shares)]
    free = {dev: stats.end_s for run in runs for dev, stats in run.devices.items()}
    busy = {dev: stats.busy_s for run in runs for dev, stats in run.devices.items()}
    synced = {dev: 0.0 for dev in free}
    events: list[Event] = [e for run in runs for e in run.events]
    for s in reversed(range(len(sync_s))):
        group = [p[s].device for p in pipelines]
        start = max(free[dev] for dev in group)
        end = start + sync_s[s]
        if sync_s[s] <= 0:
            continue
        for i, dev in enumerate(group):
            free[dev] = end
            busy[dev] += sync_s[s]
            synced[dev] += sync_s[s]
            if record_events:
                events.append(Event(dev, "sync", s, -1, start, end))
                events.append(Event(f"{dev}->{group[(i + 1) % len(group)]}", "sync", s, -1, start, end))
    update = {dev: 0.0 for dev in free}
    for p in pipelines:
        for s, stage in enumerate(p):
            update[stage.device] += stage.update_s
    for dev in free:
        if update[dev] > 0 and record_events:
            events.append(Event(dev, "update", min(s for p in pipelines for s, st in enumerate(p) if st.device == dev),
                                -1, free[dev], free[dev] + update[dev]))
        free[dev] += update[dev]
        busy[dev] += update[dev]
    step = max(free.values())
    devices = {}
    for run in runs:
        for dev, stats in run.devices.items():
            devices[dev] = replace(stats, busy_s=busy[dev], idle_s=max(step - busy[dev], 0.0),
                                   update_s=update[dev], sync_s=synced[dev])
    return _replicas_result(step, devices, events if record_events else [], runs, sync_s)


def simulate_async_replicas(pipelines: Sequence[Sequence[SimStage]], shares: Sequence[int], sync_s: Sequence[float],
                            cluster: Cluster, schedule: str, *, drain_every: int | None = None,
                            record_events: bool = True) -> SimResult:
    """Replica pipelines under an asynchronous schedule (seed 000 with replicas, docs/async.md): each runs its share
    without a flush, and every stage's update waits for the all-reduce of its gradients with its replicas (the
    runtime's ``AsyncEngine._update`` blocks on it). So each replica pipeline is simulated with every stage's update
    lengthened by that stage's ``sync_s``, and since the replicas meet at every update, the step is the slowest
    replica's. ``drain_every``: the steps between drains (``simulate``)."""
    if len(pipelines) != len(shares) or not pipelines:
        raise PlannerError(f"{len(pipelines)} replica pipelines but {len(shares)} shares; give one share per replica")
    runs = [simulate([replace(st, update_s=st.update_s + sync_s[i]) for i, st in enumerate(p)], cluster, schedule, m,
                     record_events=record_events, drain_every=drain_every) for p, m in zip(pipelines, shares)]
    step = max(run.step_time_s for run in runs)
    devices = {}
    for pipe, run in zip(pipelines, runs):
        for i, st in enumerate(pipe):
            stats = run.devices[st.device]
            devices[st.device] = replace(stats, idle_s=max(step - stats.busy_s, 0.0),
                                         update_s=stats.update_s - sync_s[i], sync_s=sync_s[i])
    return _replicas_result(step, devices, [e for run in runs for e in run.events], runs, sync_s)


def _replicas_result(step: float, devices: dict[str, DeviceStats], events: Sequence[Event], runs: Sequence[SimResult],
                     sync_s: Sequence[float]) -> SimResult:
    """The step of replica pipelines from their devices' figures (idle against ``step``), their events and each
    stage's most micro-batches in flight over the replicas' runs."""
    idle = sum(d.idle_s for d in devices.values())
    inflight = tuple(max(run.stage_inflight[s] for run in runs) for s in range(len(sync_s)))
    return SimResult(step_time_s=step, devices=MappingProxyType(devices),
                     bubble_fraction=idle / (len(devices) * step) if step > 0 else 0.0,
                     events=tuple(sorted(events, key=BY_TIME)),
                     stage_inflight=inflight, sync_s=tuple(sync_s),
                     orders=MappingProxyType({dev: order for run in runs for dev, order in run.orders.items()}))
