"""The run-time hooks of ``plan run``: rebalancing rounds (the rebalancing patent's S3-S6), checkpoints and resume.

Installed on every rank by ``planner.runtime.launch.main.rank_main``; options come from ``RunConfig.options``
(``OPTIONS`` lists them). Per round, on every rank:

1. ``before_round``: the rank's ``RankTimer`` starts; the stages' compute methods are timed (and
   stretched by ``--emulate-slowdown``), the schedules' p2p waits counted as blocked time.
2. ``round_figures``: the rank's compute and wait, which travel in the worker's one round-end exchange
   (``worker.exchange_rows``, with the losses); ``on_round``: a monitored barrier (a rank that stopped
   answering is named, not waited for); rank 0 judges the balance, updates weights and speed factors
   (``rebalance.decide``), re-plans (``replan.propose``), does the S6 bookkeeping and broadcasts a new plan
   (one number says whether one follows: ``_share_decision``); every rank migrates what changed owner
   (``migrate.migrate``) and installs the new stages; rank 0 logs the round; a checkpoint is written when a
   multiple of ``checkpoint_every`` steps was reached (rank 0's rebalancer state travels with the decision
   then). Three collectives end a round that keeps its plan: the exchange, the barrier and that number; where the
   speed fit runs, every rank times the speed probe at the next round's start and passes one more barrier.
3. ``on_start`` resumes from the newest complete checkpoint (the plan in force there, its weights,
   optimizer state, step, losses and rebalancer state); ``on_end`` writes the final plan.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from planner.errors import DistributedError, PlannerError
from planner.formats.catalog import load_catalog
from planner.formats.cluster import cluster_from_dict
from planner.formats.plan import Plan, plan_from_dict, save_plan
from planner.runtime import checkpoint as ckpt
from planner.runtime.pipeline.graph_split import canonical_param_names
from planner.runtime.migrate import load_optimizer_state, migrate, optimizer_state_by_name
from planner.partition.search.rebalance import RebalanceState, decide, initial_state, is_spike, observe, settle
from planner.runtime.rebalancing.replan import (DEVICE_RANKS, RoundModel, device_order, propose, replan_method,
                                                stage_keys, start_weights)
from planner.runtime.rebalancing.roundlog import RoundLog, round_record
from planner.runtime.options import OPTIONS, rebalance_config
from planner.runtime.links import usable_cores
from planner.runtime.slowdown import Slowdown, parse_slowdowns, touch_pages
from planner.runtime.pipeline.stages import RankStages
from planner.runtime.timing import (RankTimer, compute_cpu_clock, instrument_schedule, instrument_stage, round_row,
                                    speed_probe, stats_from_rows, timed_p2p)
from planner.runtime.pipeline.training import make_optimizer
from planner.runtime.launch.config import RoundEnd, RunConfig, RunHooks
from planner.runtime.launch.resume import IDENTITY_KEY
from planner.runtime.launch.worker import RankRun

__all__ = ["DynamicHooks", "make_hooks"]

log = logging.getLogger(__name__)


def make_hooks(config: RunConfig) -> "DynamicHooks":
    unknown = sorted(set(config.options) - set(OPTIONS))
    if unknown:
        raise DistributedError(f"unknown run option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
    return DynamicHooks(config, {**OPTIONS, **dict(config.options)})


class DynamicHooks(RunHooks):
    def __init__(self, config: RunConfig, options: Mapping[str, Any]) -> None:
        self.config, self.opt = config, options
        self.rebalance = rebalance_config(options)
        self.round_index = 0
        self.saved_step = 0
        self.warm_up = True
        """The round after the stages were built pays one-off costs: at the start (or a resume) it is logged, not
        judged; after a mid-run switch it is judged from its second step (``after_step``), where it has one."""
        self.switched = False
        """The plan changed at the end of the last round (the stages were rebuilt mid-run, the processes kept)."""
        self.skipped_steps = 0
        """Steps at the start of this round that its figures leave out (the first, after a switch)."""
        self.last_judged_s: float | None = None
        """Rank 0: the step time of the last judged round on the plan in force (None after a switch)."""
        self.spiked = False
        """Rank 0: the last round was a transient (``is_spike``), measured but not judged."""
        self.calibration_rounds: list[tuple[dict[str, float], dict[str, float]]] = []
        """Rank 0: (measured, predicted) compute seconds per device of every steady round."""

    # ------------------------------------------------------------------ start / end

    def on_start(self, run: RankRun) -> None:
        world = dist.get_world_size()
        self.ranks = device_order(run.plan)
        slow = parse_slowdowns(self.opt["emulate_slowdown"], world)
        slowdown = Slowdown.for_rank(slow, run.rank)
        if slowdown.factor > 1.0:
            slowdown.keep_warm = lambda: touch_pages(_training_state(run))
            slowdown.busy = int(os.environ.get("LOCAL_WORLD_SIZE", world)) <= usable_cores()
        self.timer = RankTimer(run.rank, self.ranks[run.rank], slowdown, clock=run.clock,
                               cpu_clock=compute_cpu_clock(run.device))
        self._p2p = timed_p2p(self.timer)
        self._p2p.__enter__()
        self.state = initial_state(self.ranks, start_weights(run.plan))
        self.model, self.no_model = self._round_model(run)
        self.probe = speed_probe(run.device) if self.model is not None else None
        """The speed fit's probe, timed at each round's start; None where nothing is fitted."""
        self.method = replan_method(run.plan, self.opt["replan_method"])
        self.log = RoundLog(self.opt["log"], json_stdout=bool(self.opt["json"]), live=bool(self.opt["live"])) \
            if run.rank == 0 else None
        if self.log is not None:
            self.log.__enter__()
        if self.opt["checkpoint_dir"]:
            self._resume(run)

    @staticmethod
    def _round_model(run: RankRun) -> tuple[RoundModel | None, str]:
        """The cost model for re-plans: the plan's profile and the cluster embedded in the plan."""
        raw = run.plan.extra.get("cluster")
        if not isinstance(raw, Mapping):
            return None, "the plan embeds no cluster (plan partition writes one): rounds measured, no re-plan"
        try:
            cluster = cluster_from_dict(dict(raw), "the plan's cluster")
            return RoundModel.build(run.prepared.profile, cluster, run.plan, run.prepared.settings.microbatch_size,
                                    load_catalog(), drain_every=run.config.round_steps), ""
        except PlannerError as exc:
            return None, f"cannot re-plan ({exc}): rounds measured, no re-plan"

    def on_end(self, run: RankRun) -> None:
        self._p2p.__exit__(None, None, None)
        if run.rank == 0 and self.model is not None and self.calibration_rounds:
            run.report["calibration"] = self._calibrate(run)
        if self.log is not None:
            self.log.close()
        if run.rank == 0 and self.opt["output"]:
            extra = dict(run.plan.extra)
            extra.update({DEVICE_RANKS: list(self.ranks), "weights": dict(self.state.weights),
                          "rebalance": self.state.to_dict()})
            save_plan(Plan(run.plan.method, run.plan.schedule, run.plan.microbatches, run.plan.stages,
                           run.plan.predicted, extra), self.opt["output"])

    def _calibrate(self, run: RankRun) -> dict[str, Any]:
        """The cost model calibrated on this machine: each device's compute factor (measured over predicted,
        summed over the steady rounds; emulated slowdowns included) and the plan's step time re-simulated
        with them, beside the prediction before calibration."""
        measured: dict[str, float] = {}
        predicted: dict[str, float] = {}
        for got, want in self.calibration_rounds:
            for device, seconds in got.items():
                measured[device] = measured.get(device, 0.0) + seconds
                predicted[device] = predicted.get(device, 0.0) + want.get(device, 0.0)
        factors = {d: measured[d] / predicted[d] for d in sorted(measured) if predicted.get(d, 0.0) > 0}
        assert self.model is not None
        before = self.model.step_time_s(run.plan, dict(run.plan.extra.get("speed_factors") or {}))
        return {"rounds": len(self.calibration_rounds), "compute_factors": factors,
                "predicted_step_time_s": before, "calibrated_step_time_s": self.model.step_time_s(run.plan, factors)}

    # ------------------------------------------------------------------ rounds

    def before_round(self, run: RankRun) -> None:
        for stage in run.stages.stages:  # new stages after a switch or resume get timed; the others already are
            instrument_stage(stage, self.timer)
        instrument_schedule(run.schedule, self.timer)
        if run.engine is not None:  # the asynchronous pipeline times its own passes (docs/async.md)
            run.engine.timer = self.timer
        if self.probe is not None:  # every rank at once, after the last round's closing collective
            self.timer.probe(self.probe)
            # a slowed rank's probe takes longer: without the barrier, the other rank would count the difference as
            # wait in the round's first transfer (at 3x, 24 ms of a 1.4 s round of resnet_small: 1.7% of imbalance)
            _monitored_barrier(self.config.timeout_s)
        self.timer.begin_round()
        self._update_mark = run.update_s
        self.skipped_steps = 0

    def after_step(self, run: RankRun, index: int, steps: int) -> None:
        """After a mid-run switch, the round's first step builds what the new stages first need (buffers, the
        allocator's blocks, the new peers' connections); its second step runs as the plan will. So the round is
        judged from its second step: every rank restarts its timer after the first, behind a barrier, so that every
        rank's window starts where a round's would (without it, the rank that ends a step first would count as wait
        the others' last backward). At the start of a run the first round stays a warm-up round whole: its
        processes' one-off costs (first collectives, caches) last beyond one step."""
        if not (self.switched and index == 0 and steps > 1):
            return
        _monitored_barrier(self.config.timeout_s)
        self.timer.begin_round()
        self._update_mark = run.update_s
        self.skipped_steps = 1

    def round_figures(self, run: RankRun) -> tuple[float, ...]:
        """This rank's timings of the round, for the worker's round-end exchange."""
        self.timer.add_update(run.update_s - self._update_mark)
        return round_row(self.timer.end_round())

    def on_round(self, run: RankRun, stats: RoundEnd) -> None:
        _monitored_barrier(self.config.timeout_s)
        stats_all = stats_from_rows(stats.figures, self.ranks, round_index=self.round_index,
                                    first_step=stats.first_step + self.skipped_steps,
                                    steps=stats.steps - self.skipped_steps)
        if self.skipped_steps:
            self.warm_up = False  # judged from its second step (``after_step``)
        if run.rank == 0 and self.model is not None and not self.warm_up:  # what the first steady rounds calibrate
            predicted = self.model.predicted_compute_s(run.plan, stats_all.steps)
            self.calibration_rounds.append(({d.device: d.compute_s for d in stats_all.devices}, predicted))
        every = int(self.opt["checkpoint_every"] or 0)
        saving = bool(self.opt["checkpoint_dir"]) and every > 0 and run.step // every > self.saved_step // every
        decision = self._decide_safely(run, stats_all) if run.rank == 0 else None
        if decision is not None and not self.warm_up:  # S6 bookkeeping, on the plan in force after the round
            plan = plan_from_dict(decision["plan"]) if decision["plan"] else run.plan
            decision["state"] = settle(RebalanceState.from_dict(decision["state"]), stage_keys(plan),
                                       self.rebalance).to_dict()
        new_plan, state = _share_decision(decision, with_state=saving)
        moved, moved_bytes = (self._switch(run, new_plan) if new_plan is not None else (0, 0))
        if state is not None:
            self.state = RebalanceState.from_dict(state)
        self.warm_up = self.switched = new_plan is not None
        if self.switched:  # a transient is judged against rounds of the plan in force: none yet (the one place this
            self.last_judged_s, self.spiked = None, False  # is forgotten; a run starts without one)
        if self.log is not None and decision is not None:
            self.log.write(round_record(
                stats_all, self.state, imbalance=decision["imbalance"], balanced=decision["balanced"],
                plan_changed=new_plan is not None, reason=decision["reason"], loss=stats.losses[-1],
                moved_tensors=moved, moved_bytes=moved_bytes, held=decision.get("held"),
                stages=[{"device": s.device, "nodes": len(s.nodes), "first": s.nodes[0], "last": s.nodes[-1]}
                        for s in run.plan.stages]))
        self.round_index += 1
        if saving:
            self._save(run)

    def on_eval(self, run: RankRun, result: Mapping[str, Any]) -> None:
        if self.log is not None:
            self.log.write({"eval": dict(result)})

    def _decide_safely(self, run: RankRun, stats: Any) -> dict[str, Any]:
        """Rank 0 must always answer the broadcast: a failed decision keeps the plan and says why."""
        try:
            return self._decide(run, stats)
        except PlannerError as exc:
            return {"plan": None, "imbalance": 0.0, "balanced": True, "state": self.state.to_dict(),
                    "warm_up": self.warm_up, "reason": f"rebalancing skipped this round: {exc}"}

    def _decide(self, run: RankRun, stats: Any) -> dict[str, Any]:
        """Rank 0: S5 judgement, and a re-plan when unbalanced."""
        result = {"plan": None, "imbalance": 0.0, "balanced": True, "reason": "rebalancing off",
                  "state": self.state.to_dict(), "warm_up": self.warm_up}
        if self.model is None:
            result["reason"] = self.no_model
            return result
        predicted = self.model.predicted_compute_s(run.plan, stats.steps)
        if not self.warm_up:  # a round whose figures include building stages is no measure of speed
            if self.opt["rebalance"] and is_spike(stats.step_time_s, self.last_judged_s, self.spiked, self.rebalance):
                self.spiked = True
                result["reason"] = (f"transient: step {stats.step_time_s / self.last_judged_s:.2f}x the last judged "
                                    f"round's on the same plan; measured, not judged (judged next round if it lasts)")
                return result
            self.last_judged_s, self.spiked = stats.step_time_s, False
            held = self.model.held(run.plan, stats.steps, {d.device: d.fitted_compute_s for d in stats.devices},
                                   {d.device: d.probe_s for d in stats.devices}, self.probe.name if self.probe else "")
            self.state = observe(self.state, held, self.model.predict_s, self.rebalance)
            result.update(state=self.state.to_dict(), held=[h.to_list() for h in held])
        if not self.opt["rebalance"]:
            decision = decide(self.state, stats, predicted, replace(self.rebalance, threshold=float("inf")))
            result.update(imbalance=decision.imbalance, balanced=decision.imbalance <= self.rebalance.threshold,
                          state=decision.state.to_dict())
            return result
        if self.warm_up:
            result["reason"] = "warm-up round after the stages were built: measured, not judged"
            return result
        decision = decide(self.state, stats, predicted, self.rebalance)
        judged = decision.reason + (" (from the round's second step: its first built the new stages)"
                                    if self.skipped_steps else "")
        result.update(imbalance=decision.imbalance, balanced=decision.balanced, reason=judged,
                      state=decision.state.to_dict())
        if decision.replan:
            proposal = propose(self.model, run.plan, decision.state, method=self.method,
                               min_improvement=self.rebalance.min_improvement, ranks=self.ranks,
                               fixed_order=False, profile_ref=run.plan.extra.get("profile"))
            result["reason"] = f"{judged}; {proposal.reason}"
            if proposal.plan is not None:
                result["plan"] = proposal.plan.to_dict()
        return result

    def _switch(self, run: RankRun, plan: Plan) -> tuple[int, int]:
        """Every rank: land what still travels (on the stages it left from, before their weights move), build the new
        stages, move what changed owner, continue from the same step."""
        run.land_in_flight()
        module = run.prepared.module
        tensors = _named_tensors(module)
        name_of = canonical_param_names(module)
        before = _owned(run.stages)
        state = optimizer_state_by_name([run.optimizer], name_of)
        stages = run.build(plan)
        after = _owned(stages)
        new_state, report = migrate(run.rank, tensors, before, after, state)
        settings = run.prepared.settings
        optimizer = make_optimizer(stages.params, settings.optimizer, settings.lr)
        load_optimizer_state([optimizer], new_state, name_of)
        run.install(stages, optimizer)
        return report.moved, report.sent_bytes

    # ------------------------------------------------------------------ checkpoints

    def _save(self, run: RankRun) -> None:
        module = run.prepared.module
        tensors = _named_tensors(module)
        owned = _owned(run.stages)
        name_of = canonical_param_names(module)
        plan = dict(run.plan.to_dict(), **{DEVICE_RANKS: list(self.ranks)})
        ckpt.save_checkpoint(self.opt["checkpoint_dir"], step=run.step, rank=run.rank, world_size=dist.get_world_size(),
                             tensors={n: tensors[n] for n in owned},
                             optim=optimizer_state_by_name([run.optimizer], name_of), plan=plan,
                             extra={"rebalance": self.state.to_dict(), "round": self.round_index,
                                    "losses": list(run.losses), IDENTITY_KEY: dict(run.prepared.identity)},
                             keep=int(self.opt["keep_checkpoints"]))
        self.saved_step = run.step

    def _resume(self, run: RankRun) -> None:
        resume = run.prepared.resume  # found and checked against this run by ``prepare``
        if resume is None:
            return
        info, plan = resume.info, resume.plan
        run.install(run.build(plan))
        tensors, optim = ckpt.load_owned(info, _owned(run.stages))
        live = _named_tensors(run.prepared.module)
        with torch.no_grad():
            for name, value in tensors.items():
                live[name].copy_(value)
        name_of = canonical_param_names(run.prepared.module)
        load_optimizer_state([run.optimizer], optim, name_of)
        run.step = self.saved_step = info.step
        run.losses[:] = [float(x) for x in info.extra.get("losses", [])][: info.step]
        self.state = RebalanceState.from_dict(info.extra["rebalance"])
        self.warm_up = True
        self.round_index = int(info.extra.get("round", 0))
        log.info("rank %d resumed from %s at step %d", run.rank, info.path, info.step)


def _share_decision(decision: Mapping[str, Any] | None, *, with_state: bool) -> tuple[Plan | None, Any]:
    """Rank 0's ``decision`` to every rank: the new plan, if any, and the rebalancer's state (every rank: on rank 0
    always; elsewhere only ``with_state``, when a checkpoint saves it this round). One broadcast number says whether
    anything else follows; most rounds keep their plan and save nothing, and pay that one collective."""
    message = None
    if decision is not None:
        message = {"plan": decision["plan"], "state": decision["state"] if with_state else None}
    follows = torch.tensor([float(message is not None and (message["plan"] is not None or with_state))],
                           dtype=torch.float64)
    dist.broadcast(follows, src=0)
    if follows.item():
        box = [message]
        dist.broadcast_object_list(box, src=0)
        message = box[0]
    plan = message["plan"] if message is not None else None
    state = decision["state"] if decision is not None else (message or {}).get("state")
    return (plan_from_dict(plan) if plan else None), state


def _training_state(run: RankRun) -> list[torch.Tensor]:
    """What this rank's training touches every step: its stages' parameters, their gradients, the optimizer's state
    (read at call time, so a re-plan's new stages are the ones kept warm)."""
    params = list(run.stages.params.values())
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in run.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return params + grads + state


def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Canonical name -> live tensor, parameters and buffers (first name of each object)."""
    out: dict[str, torch.Tensor] = dict(module.named_buffers())
    out.update(module.named_parameters())
    return out


def _owned(stages: RankStages) -> set[str]:
    """Names of the parameters and buffers this rank's stages hold (what its values are current for)."""
    return set(stages.params) | {n for module in stages.modules for n, _ in module.named_buffers()}


class RankUnresponsive(RuntimeError):
    """A peer stopped answering mid-run. Deliberately *not* a ``PlannerError``: the worker returns those
    as values (a clean exit), and a clean exit would leave the launcher waiting on the silent rank;
    raising this fails the process, so the launcher stops every rank and reports this message."""


def _monitored_barrier(timeout_s: float) -> None:
    """Gloo's monitored barrier names the rank that did not arrive; other backends get a plain barrier."""
    try:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise RankUnresponsive(f"a rank stopped answering at a round boundary ({detail}); the job ends "
                               f"instead of waiting: check that rank's log, then rerun (checkpoints resume it)") from None
