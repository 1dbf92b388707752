"""Re-planning between rounds with the project's placer, fed the measured speed factors (pure).

``RoundModel`` holds what the rebalancer needs from the plan's profile and cluster: the cost model's
compute prediction for a round on each device (without speed factors: the denominator of a speed
factor) and the simulated step time of any plan under given speed factors. ``propose`` asks the
placer for a new plan and keeps it only if it runs on the same devices as the job, differs from
the plan in force, and is predicted at least ``min_improvement`` faster than it under the same
speed factors; otherwise the plan in force stays (and the round counts as unchanged for S6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from planner.errors import PlannerError
from planner.formats.catalog import DeviceSpec
from planner.formats.cluster import Cluster
from planner.formats.plan import STALENESS_SYNCS, Plan
from planner.formats.profile import Profile
from planner.partition import partition
from planner.partition.placers import registry as methods
from planner.partition.model.cost import evaluate, stage_fwd_bwd_s, step_time_s
from planner.partition.model.convert import partition_of
from planner.partition.model.problem import Problem, build_problem, with_sync
from planner.partition.search.rebalance import RebalanceState, placer_weights, plans_equal
from planner.partition.search.settings import rescaled
from planner.partition.search.speed import Held
from planner.partition.sim.simulate import SimResult

__all__ = ["RoundModel", "Proposal", "propose", "device_order", "replan_method", "start_weights", "stage_keys",
           "DEVICE_RANKS"]

DEVICE_RANKS = "device_ranks"
"""Plan field: device ids in rank order. A re-planned plan carries the job's, so ranks keep their devices."""


def device_order(plan: Plan) -> tuple[str, ...]:
    """Device ids by rank (``planner.runtime.pipeline.stages.rank_devices``: ``device_ranks`` if present, else by
    first appearance over the stages, replica by replica)."""
    from planner.runtime.pipeline.stages import rank_devices

    return rank_devices(plan)


def start_weights(plan: Plan) -> dict[str, float]:
    """The plan's device weights (S3) for the devices it runs on: a placer records one for every device of the
    cluster, and a plan that leaves some idle (one device of two was fastest for a small model) would otherwise
    start the runtime's loop with weights for devices that have no rank."""
    ranks = set(device_order(plan))
    return {d: w for d, w in (plan.extra.get("weights") or {}).items() if d in ranks}


def stage_keys(plan: Plan) -> list[tuple[str, tuple[str, ...]]]:
    """``(holder, nodes)`` per stage, what the rebalancer and a resume compare plans by: the holder is the stage's
    device, or for a hybrid plan its replicas, the replicas' shares and the sync mode (``ParallelShape.key``;
    moving only the shares is a new plan)."""
    return [(holder, tuple(stage.nodes)) for holder, stage in zip(plan.shape().key(), plan.stages)]


def replan_method(plan: Plan, requested: str | None) -> str:
    """The placer for re-plans: the one asked for, else the plan's own if it is registered, else ``dp``
    (hand-made or imported plans name methods no placer implements)."""
    if requested:
        methods.get(requested)  # UsageError listing the methods when unknown
        return requested
    return plan.method if plan.method in methods.names() else "dp"


@dataclass(frozen=True)
class RoundModel:
    profile: Profile
    cluster: Cluster
    problem: Problem
    """Op-granularity problem without speed factors (one block per profile node, in order)."""
    index: Mapping[str, int]
    catalog: Mapping[str, DeviceSpec] | None = None
    """The device catalog, for device types the profile did not time."""

    @staticmethod
    def build(profile: Profile, cluster: Cluster, plan: Plan, microbatch_size: int | None = None,
              catalog: Mapping[str, DeviceSpec] | None = None, drain_every: int | None = None) -> "RoundModel":
        """The model of ``plan``'s rounds; ``drain_every``: the run's round length, where an asynchronous pipeline
        drains (``Problem.drain_every``), so predictions, calibration and re-plans price the rounds the run runs."""
        if microbatch_size and microbatch_size != int(profile.model.get("microbatch_size", 0) or 0):
            profile = rescaled(profile, microbatch_size, catalog)  # the run's rows, as --microbatches auto planned them
        problem = _synced(build_problem(profile, cluster, microbatches=plan.microbatches, schedule=plan.schedule,
                                        optimizer=str(plan.extra.get("optimizer", "adam")), catalog=catalog,
                                        recompute=any(plan.recomputed()), drain_every=drain_every), plan)
        return RoundModel(profile, cluster, problem, profile.node_index(), catalog)

    def predicted_compute_s(self, plan: Plan, steps: int) -> dict[str, float]:
        """Per device: forward + backward seconds the profile predicts for ``steps`` steps of ``plan``
        (the profile rescaled to the run's micro-batch rows when they differ from the profile's); each
        replica's devices for that replica's share of the micro-batches; plus the runtime's own cost inside the
        passes it times (``Cluster.pass_compute_overhead_s`` per pass), which a rank's measured compute holds; on
        ranks that share their host's cores, stretched as the simulator stretches them (``core_stretch``), since a
        rank's wall clock sees that."""
        overhead = self.cluster.pass_overhead_s
        inner = self.cluster.pass_compute_overhead_s / overhead if overhead else 0.0
        simulated = self._simulated(plan) if inner or self.cluster.host_cores else None
        stretch = simulated.core_stretch if simulated is not None else {}
        out: dict[str, float] = {}
        for stage, devices, again in zip(plan.stages, plan.replicas(), plan.recomputed()):
            runs = _runs(sorted(self.index[name] for name in stage.nodes))
            for device, share in zip(devices, plan.replica_shares()):
                total = sum(self.predict_s(device, a, b, again) for a, b in runs)
                out[device] = out.get(device, 0.0) + total * share * steps * stretch.get(device, 1.0)
        if simulated is not None and inner:
            # the simulator charges every pass its runtime's figure (Cluster.pass_overhead_for: a zero-bubble
            # schedule's its own, taken to hold the same part inside the passes): its passes per step, times the part
            for device in out:
                out[device] += simulated.devices[device].overhead_s * inner * steps * stretch.get(device, 1.0)
        return out

    def core_stretch(self, plan: Plan) -> Mapping[str, float]:
        """Device -> how much slower the simulator runs it because its host's ranks share fewer cores than they
        are (``planner.partition.sim.step``); empty on GPUs and on hosts with a core per rank."""
        if not self.cluster.host_cores:
            return {}
        return self._simulated(plan).core_stretch

    def _simulated(self, plan: Plan) -> SimResult:
        return evaluate(self.problem, partition_of(self.problem, plan), record_events=False)

    def held(self, plan: Plan, steps: int, measured_s: Mapping[str, float], probe_s: Mapping[str, float] | None = None,
             probe: str = "") -> list[Held]:
        """Per device that computed: its measured seconds and the profile node ranges behind them, each run
        (its replica's share x ``steps``) times: the speed fit's observation of one round. With ``probe_s``, each
        device's seconds for the kernel named ``probe`` (``runtime.timing.speed_probe``) follow as probe rows, named
        with the device's type (the work is the same only on devices of one type); none for a device whose host's
        ranks outnumber its cores in the step (``core_stretch``): all of them probe at once, which that stretch does not
        describe."""
        shares = plan.replica_shares()
        stretch = self.core_stretch(plan)  # the fit sees each device's own speed, not its share of the cores
        ranges: dict[str, list[tuple[int, int, float]]] = {}
        for stage, devices, again in zip(plan.stages, plan.replicas(), plan.recomputed()):
            for run_start, run_stop in _runs(sorted(self.index[name] for name in stage.nodes)):
                for device, share in zip(devices, shares):
                    # the fit prices a range as the problem does (every stage recomputing, or none): a stage that
                    # differs counts as that many runs of it, so its measured seconds are not misread as speed
                    as_priced = self.predict_s(device, run_start, run_stop)
                    own = self.predict_s(device, run_start, run_stop, again)
                    ranges.setdefault(device, []).append(
                        (run_start, run_stop, share * steps * (own / as_priced if as_priced > 0 else 1.0)))
        work = [Held(d, float(measured_s[d]) / stretch.get(d, 1.0), tuple(r)) for d, r in sorted(ranges.items())
                if measured_s.get(d, 0.0) > 0]
        probes = [Held(h.device, float(probe_s[h.device]), (), f"{probe}:{self.cluster.device(h.device).type}")
                  for h in work if probe and (probe_s or {}).get(h.device, 0.0) > 0 and h.device not in stretch]
        return work + probes

    def predict_s(self, device: str, start: int, stop: int, recompute: bool | None = None) -> float:
        """The cost model's forward + backward seconds for one run of profile nodes ``[start, stop)`` on ``device``
        (``recompute``: with the forward run again inside the backward or not; ``None``: as the problem prices it)."""
        return sum(stage_fwd_bwd_s(self.problem.tables, device, start, stop, recompute))

    def step_time_s(self, plan: Plan, speed_factors: Mapping[str, float],
                    corrections: Sequence[tuple[int, int, float]] = ()) -> float:
        problem = build_problem(self.profile, self.cluster, microbatches=plan.microbatches, schedule=plan.schedule,
                                optimizer=self.problem.optimizer, speed_factors=speed_factors, catalog=self.catalog,
                                corrections=corrections, recompute=self.problem.recompute,
                                drain_every=self.problem.drain_every)
        return step_time_s(_synced(problem, plan), partition_of(problem, plan))


def _synced(problem: Problem, plan: Plan) -> Problem:
    """``problem`` with ``plan``'s sync mode and period, so its step is simulated as the run aggregates."""
    shape = plan.shape()
    return with_sync(problem, shape.sync, shape.period, shape.staleness if shape.sync in STALENESS_SYNCS else None)


def _runs(indices: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted node indices as maximal ``[start, stop)`` runs."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


@dataclass(frozen=True)
class Proposal:
    plan: Plan | None
    """The plan to switch to, or None to keep the plan in force."""
    reason: str
    predicted_now_s: float = 0.0
    predicted_new_s: float = 0.0


def propose(model: RoundModel, current: Plan, state: RebalanceState, *, method: str, min_improvement: float,
            ranks: Sequence[str], fixed_order: bool, profile_ref: Mapping[str, Any] | None = None) -> Proposal:
    """Ask placer ``method`` for a plan under the state's speed factors (and residual weights)."""
    factors = {d: f for d, f in state.speed_factors.items() if d in set(model.cluster.device_ids)}
    try:
        weights = placer_weights(state.weights, factors) if methods.takes_weights(method) else None
        plan = partition(model.profile, model.cluster, method=method, microbatches=current.microbatches,
                         schedule=current.schedule, optimizer=model.problem.optimizer, weights=weights,
                         speed_factors=factors, corrections=state.corrections, profile_ref=profile_ref,
                         catalog=model.catalog, sync=current.shape().sync, sync_period=current.shape().period,
                         data_parallel=current.shape().degree,  # a hybrid plan keeps its degree; cuts and shares move
                         recompute=current.recompute_mode(), drain_every=model.problem.drain_every,
                         whole_polish=False)  # between rounds: the placer's plan, not the finalists' polish
    except PlannerError as exc:
        return Proposal(None, f"placer {method!r} failed ({exc}); plan kept")
    now = model.step_time_s(current, factors, state.corrections)
    new = plan.step_time_s
    order = tuple(dict.fromkeys(d for d in device_order(plan)))
    if set(order) != set(ranks):
        return Proposal(None, f"placer used devices {list(order)}, the job runs {list(ranks)}; plan kept", now, new)
    if fixed_order and order != tuple(ranks):
        return Proposal(None, f"placer ordered devices {list(order)}, ranks run {list(ranks)}; plan kept", now, new)
    if plans_equal(stage_keys(plan), stage_keys(current)):
        return Proposal(None, "placer returned the plan in force", now, new)
    if new > now * (1.0 - min_improvement):
        return Proposal(None, f"new plan predicted {new:.4f} s vs {now:.4f} s in force: gain below "
                              f"{min_improvement:.0%}; plan kept", now, new)
    extra = dict(plan.extra)
    extra[DEVICE_RANKS] = list(ranks)
    extra["weights"] = dict(state.weights)
    adopted = Plan(plan.method, plan.schedule, plan.microbatches, plan.stages, plan.predicted, extra)
    return Proposal(adopted, f"re-planned: predicted {new:.4f} s vs {now:.4f} s in force", now, new)
