"""One training step of a plan: a pipeline, or replica pipelines and their sync, on cores that may be shared.

``simulate_step`` is what every figure of a plan's step time comes from (``cost.evaluate`` for placers,
polish, the guard and re-plans; ``report.replay`` for saved plans): ``simulate`` for one pipeline,
``simulate_hybrid`` for replicas, then the shared-cores stretch below.

Shared cores: ranks that are processes on one host's CPU cores cannot all compute at once.

The simulator gives every device its own processor, as GPUs have. CPU ranks share their host's cores
(``runtime.host_cores``): four ranks on a 2-core host compute at half speed whenever all four are busy.
Between a step in which every rank runs at full speed (the simulator's) and one in which all run at
``cores / ranks`` of it, where a real step falls depends on how much the ranks overlap. The model used
here is the processor-sharing bound: a host whose devices are busy ``W`` processor-seconds per step
(compute, copies, the optimizer step and the sync are all work of those cores) needs at least ``W / cores``
seconds of wall time; when the simulated step is shorter than that, every time of that host's devices is
stretched by ``W / (cores * step)`` and the step simulated again, which keeps the schedule's dependencies
and its bubbles (an idle rank gives its core to the others). Two rounds settle it: the second corrects
for the copies and per-pass costs the stretch leaves unscaled.

Measured on the 2-core machine this was developed on, a 2-stage x 2-replica plan of ``gpt_small`` on 4
ranks ran 1.71x its unstretched prediction, and the bound predicts 1.59x of it (docs/bench-run.md).
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

from planner.formats.cluster import Cluster
from planner.formats.plan import ASYNC_SCHEDULES
from planner.partition.sim.hybrid import simulate_async_replicas, simulate_hybrid
from planner.partition.sim.simulate import SimResult, SimStage, simulate

__all__ = ["core_stretch", "settle", "simulate_step"]

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


def settle(run: Callable[[Mapping[str, float]], SimResult], cluster: Cluster) -> SimResult:
    """``run(stretch)`` (device -> factor on its times; empty: as profiled) until every host's work, as profiled,
    fits in its cores over the step."""
    result = run({})
    if not cluster.host_cores:
        return result
    work = host_work(result, cluster)
    factor: dict[str, float] = {}
    stretch: dict[str, float] = {}
    for _ in range(ROUNDS):
        more = core_stretch(work, result.step_time_s, cluster)
        if not more:
            break
        factor = {host: factor.get(host, 1.0) * more.get(host, 1.0) for host in set(factor) | set(more)}
        stretch = {d.id: factor[d.host] for d in cluster.devices if d.host in factor}
        result = run(stretch)
    return replace(result, core_stretch=MappingProxyType({d: f for d, f in stretch.items() if d in result.devices}))


def simulate_step(pipelines: Sequence[Sequence[SimStage]], shares: Sequence[int], sync_s: Sequence[float],
                  cluster: Cluster, schedule: str, *, period: int = 1, overlap: bool = False,
                  record_events: bool = True, drain_every: int | None = None) -> SimResult:
    """One step of replica pipelines ``pipelines[r]`` with ``shares[r]`` micro-batches each (one pipeline: the
    plain pipeline simulation, ``sync_s`` unused), then ``sync_s[s]`` to all-reduce stage ``s``; settled on
    shared cores. With ``period`` local steps between aggregations (``local-sgd``, ``adaptive``) the step is the
    mean step: each aggregation's time is spread over the ``period`` steps it serves. With ``overlap``
    (``adaptive``: the aggregation travels during the next step), only what outlasts a step's compute is
    charged (``exposed_sync_s``). ``drain_every``: an asynchronous pipeline's steps between drains (``simulate``);
    asynchronous replicas: ``simulate_async_replicas``."""
    if overlap and len(pipelines) > 1:
        sync_s = exposed_sync_s(sync_s, compute_only_s(pipelines, shares, cluster, schedule))
    sync_s = [s / period for s in sync_s]
    if len(pipelines) == 1:
        return settle(lambda stretch: simulate(_stretched(pipelines[0], stretch), cluster, schedule, shares[0],
                                               record_events=record_events, drain_every=drain_every), cluster)

    def run(stretch: Mapping[str, float]) -> SimResult:
        synced = [s * max(stretch.get(p[i].device, 1.0) for p in pipelines) for i, s in enumerate(sync_s)]
        if schedule in ASYNC_SCHEDULES:
            return simulate_async_replicas([_stretched(p, stretch) for p in pipelines], shares, synced, cluster,
                                           schedule, drain_every=drain_every, record_events=record_events)
        return simulate_hybrid([_stretched(p, stretch) for p in pipelines], shares, synced, cluster, schedule,
                               record_events=record_events)

    return settle(run, cluster)


def compute_only_s(pipelines: Sequence[Sequence[SimStage]], shares: Sequence[int], cluster: Cluster,
                   schedule: str) -> float:
    """The replicas' step without any sync: the compute an overlapped aggregation can hide behind."""
    return simulate_step(pipelines, shares, [0.0] * len(pipelines[0]), cluster, schedule, record_events=False).step_time_s


def exposed_sync_s(sync_s: Sequence[float], compute_s: float) -> list[float]:
    """Each stage's aggregation time that ``compute_s`` of the next step's compute does not hide."""
    return [max(s - compute_s, 0.0) for s in sync_s]


def _stretched(sims: Sequence[SimStage], stretch: Mapping[str, float]) -> tuple[SimStage, ...]:
    """The stages with their device's stretch applied to compute and update times (a zero-bubble stage's weight
    gradient with the rest of its backward)."""
    if not stretch:
        return tuple(sims)
    return tuple(replace(st, fwd_s=st.fwd_s * f, bwd_s=st.bwd_s * f, update_s=st.update_s * f,
                         bwd_weight_s=st.bwd_weight_s * f)
                 if (f := stretch.get(st.device, 1.0)) != 1.0 else st for st in sims)
