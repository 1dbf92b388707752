"""The per-rank training loop of ``plan run``: check the model against the plan, build this rank's stages,
train in rounds, report.

Every rank runs ``run_rank`` (started by ``plan run`` through torch's elastic launcher, or by ``torchrun``).
Everything that can be refused is checked *before* ``init_process_group`` -- plan/profile/model mismatch,
world size -- and every rank reaches the same verdict, so a bad run ends with one clear error rather than a
hang; collectives carry ``timeout_s``.

Hooks (issue 5, for rebalancing, migration and checkpoints):

(a) training runs in rounds of ``round_steps`` steps; after each round every rank calls
    ``RunHooks.on_round(run, stats)`` (``on_start`` before the first step, ``on_end`` after the last);
    ``run_rank`` takes the hooks (``planner.runtime.launch.main`` passes the rebalancing hooks and any
    ``RunConfig.plugins``), which read their options from ``RunConfig.options``;
(b) ``RankRun.build(plan)`` cuts the graph for another plan mid-run; ``RankRun.install`` switches to it
    (moving parameter values and optimizer state between ranks is the hook's job);
(c) ``RankRun.stages.stages`` are plain ``PipelineStage`` s whose compute methods a hook may wrap
    (``planner.runtime.timing.instrument_stage``); ``before_round`` runs just before a round starts and
    ``RoundEnd`` carries the round's wall time and losses, and to each hook the numbers it returned from
    ``round_figures`` on every rank (they travel with the losses in one all-gather, ``exchange_rows``);
(d) the optimizer is built from canonical parameter names (``RankStages.params``), so state moves by name;
(e) ``RankRun.step`` is the next step to run and ``RankRun.batch(step)`` a pure function of (seed, step).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from planner.profile.timer import steady_cpu_allocator
from planner.errors import DistributedError, PlannerError
from planner.formats.plan import ASYNC_SCHEDULES, Plan
from planner.data import factory as data_mod
from planner.runtime import netem
from planner.runtime.links import process_group_backend, rank_device
from planner.runtime.data_parallel import sync_of, whole_run_report
from planner.runtime.options import parse_link, parse_target
from planner.runtime.timing import device_clock
from planner.runtime.launch.config import RoundEnd, RunConfig, RunHooks
from planner.runtime.launch.prepare import Prepared, prepare
from planner.runtime.pipeline.stages import (RankStages, average_grads, build_rank_stages, build_schedule, sync_tied_grads,
                                    sync_tied_params, training_step_kwargs)
from planner.runtime.pipeline.asynchronous import AsyncEngine, correction_of
from planner.runtime.pipeline.training import make_optimizer

__all__ = ["FAILURES_ENV", "RankRun", "exchange_rows", "note_failure", "run_rank", "steady_step_time_s"]

log = logging.getLogger(__name__)


class RankRun:
    """One rank's training state: what it holds, which step is next, the losses so far."""

    def __init__(self, config: RunConfig, prepared: Prepared, rank: int, device: torch.device) -> None:
        self.config = config
        self.prepared = prepared
        self.rank = rank
        self.device = device
        self.clock = device_clock(device)
        """The host clock, after the device's queued work (``runtime.timing.device_clock``)."""
        self.step = 0
        self.update_s = 0.0
        """Seconds spent in optimizer steps (with gradient averaging) so far; hooks read differences."""
        self.losses: list[float] = []
        self.rounds: list[RoundEnd] = []
        self.report: dict[str, Any] = {}
        """What hooks add to this rank's summary (the rebalancing hooks: ``calibration`` on rank 0)."""
        self.stages: RankStages
        self.optimizer: torch.optim.Optimizer
        self.install(self.build(prepared.plan))
        sync_tied_params(self.stages)

    @property
    def plan(self) -> Plan:
        return self.stages.plan

    def build(self, plan: Plan) -> RankStages:
        """This rank's stages for ``plan`` (collective: every rank calls it with the same plan)."""
        return build_rank_stages(self.prepared.captured, self.prepared.module, plan, self.rank, self.device)

    def land_in_flight(self) -> None:
        """Land what still travels on the current stages: an aggregation, the tied weights' last sums. A re-plan calls
        it before the weights and the optimizer state move to their new owners (landing after would write the
        landed values where they no longer live), and ``install`` before it replaces the stages."""
        if getattr(self, "sync", None) is not None:
            self.sync.finish(self.stages.params)
        if getattr(self, "engine", None) is not None:
            self.engine.close()

    def install(self, stages: RankStages, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Train with ``stages`` from now on; a fresh optimizer over its parameters unless one is given."""
        self.land_in_flight()
        previous = getattr(self, "sync", None)
        if previous is not None:
            self.sync_reports.append(previous.report())  # the summary counts the whole run
        else:
            self.sync_reports: list[dict[str, Any]] = []
        self.stages = stages
        criterion = data_mod.loss_fn(self.prepared.spec, self.prepared.custom_loss)
        self.schedule = build_schedule(stages, criterion)
        self.sync = sync_of(stages, self.prepared.sync_options)
        if previous is not None:
            self.sync.carry(previous)
        settings = self.prepared.settings
        self.optimizer = optimizer or make_optimizer(stages.params, settings.optimizer, settings.lr)
        before: AsyncEngine | None = getattr(self, "engine", None)  # landed above
        self.engine: AsyncEngine | None = None
        if stages.plan.schedule in ASYNC_SCHEDULES:  # seed 000: no flush between steps (docs/async.md)
            self.engine = AsyncEngine(stages, self.optimizer, criterion, correction_of(stages.plan), before=before,
                                      sync=self.sync, clock=self.clock, receives=self.config.async_receives)

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Inputs and target of ``step`` (a pure function of seed and step), on this rank's device: the step's
        global batch, drawn as single-process training draws it, cut to this replica's rows."""
        inputs, target = self._rows(self.prepared.batch(step))
        return tuple(x.to(self.device) for x in inputs), target.to(self.device)

    def _rows(self, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """This replica's micro-batches of a global batch (all of it in a pure pipeline)."""
        stages, (inputs, target) = self.stages, batch
        if stages.degree == 1:
            return inputs, target
        rows = target.shape[0] // self.plan.microbatches
        first, count = stages.first_microbatch * rows, stages.microbatches * rows
        return tuple(x[first:first + count] for x in inputs), target[first:first + count]

    def train_step(self) -> float | None:
        """Run step ``self.step``; return on a last stage's rank its micro-batches' losses summed and divided by
        the step's micro-batch count (summed over replicas, the step's mean loss), else None."""
        inputs, target = self.batch(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.stages.has_last else {}
        kwargs.update(training_step_kwargs(self.schedule))
        self.schedule.step(*(inputs if self.stages.has_first else ()), **kwargs)
        start = self.clock()
        if not self.sync.reduces_in_backward:
            average_grads(self.stages.params, self.plan.microbatches)
        sync_tied_grads(self.stages)
        self.sync.after_backward(self.stages.params)
        self.optimizer.step()
        self.sync.after_step(self.stages.params)
        self.update_s += self.clock() - start
        self.step += 1
        return float(torch.stack([x.detach().float() for x in losses]).sum()) / self.plan.microbatches if losses else None

    def evaluate(self, batches: int) -> dict[str, Any]:
        """Loss (and accuracy, where the task has one) on the first ``batches`` validation batches, forward only
        through the same stages; parameters and buffers are as they were before (a training-mode BatchNorm's
        running statistics are restored). Collective; every rank returns the same numbers."""
        assert self.prepared.val_batch is not None
        self.sync.finish(self.stages.params)
        spec = self.prepared.spec
        buffers = [b for module in self.stages.modules for b in module.buffers()]
        saved = [b.detach().clone() for b in buffers]
        criterion = data_mod.loss_fn(spec, self.prepared.custom_loss)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss x rows, correct, rows
        with torch.no_grad():
            for index in range(batches):
                inputs, target = self._rows(self.prepared.val_batch(index))
                inputs, target = tuple(x.to(self.device) for x in inputs), target.to(self.device)
                kwargs: dict[str, Any] = {"target": target} if self.stages.has_last else {}
                out = self.schedule.eval(*(inputs if self.stages.has_first else ()), **kwargs)
                if self.stages.has_last and isinstance(out, torch.Tensor):
                    rows = float(target.shape[0])
                    sums[0] += float(criterion(out, target)) * rows
                    sums[2] += rows
                    if data_mod.has_accuracy(spec):
                        sums[1] += float((out.argmax(-1) == target).float().mean()) * rows
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)
        dist.all_reduce(sums)  # the last stage of each replica contributes its rows
        loss, correct, rows = sums.tolist()
        return {"loss": loss / max(rows, 1.0),
                "accuracy": correct / max(rows, 1.0) if data_mod.has_accuracy(spec) else None}

    def train_round(self, steps: int, hooks: Sequence[RunHooks] = ()) -> tuple[RoundEnd, list[RoundEnd]]:
        """``steps`` steps, then the round's one exchange (``exchange_rows``): every rank's step losses (summed over the
        replicas' last stages), its sync's ``round_figures`` and each hook's. Returns the round and, per hook, the
        round with that hook's figures from every rank."""
        first, local = self.step, []
        start, exposed = self.clock(), self.sync.report().get("exposed_s", 0.0)
        if self.engine is not None:
            before = self.engine.update_s
            local = self.engine.run_round(self.step, steps, self.batch)
            self.update_s += self.engine.update_s - before
            self.step += steps
        else:
            for index in range(steps):
                local.append(self.train_step())
                for hook in hooks:
                    hook.after_step(self, index, steps)
        wall_s = self.clock() - start
        waited = self.sync.report().get("exposed_s", 0.0) - exposed
        parts = [tuple(x if x is not None else 0.0 for x in local), self.sync.round_figures((wall_s - waited) / steps),
                 *(hook.round_figures(self) for hook in hooks)]
        rows = exchange_rows([x for part in parts for x in part], self.device)
        split = [[row[i:j] for row in rows] for i, j in _bounds([len(part) for part in parts])]
        losses = tuple(float(sum(column)) for column in zip(*split[0]))
        stats = RoundEnd(len(self.rounds), first, steps, wall_s, losses)
        self.sync.after_round(stats.losses, split[1])
        self.losses.extend(stats.losses)
        self.rounds.append(stats)
        return stats, [dataclasses.replace(stats, figures=tuple(rows)) for rows in split[2:]]


def exchange_rows(row: Sequence[float], device: torch.device | None = None) -> list[tuple[float, ...]]:
    """Every rank's ``row`` (float64, the same length on every rank), by rank: one all-gather. A round's end needs
    several small things from every rank (losses, timings, a sync rule's figures); on a slow link each collective
    costs a latency or two, so they travel together."""
    mine = torch.tensor(list(row), dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [tuple(t.tolist()) for t in everyone]


def _bounds(lengths: Sequence[int]) -> list[tuple[int, int]]:
    """``[(start, end)]`` of consecutive parts of the given lengths."""
    ends = list(itertools.accumulate(lengths))
    return list(zip([0, *ends[:-1]], ends))


FAILURES_ENV = "PLANNER_FAILURE_NOTES"
"""A directory the launcher makes per job (``elastic.launch``): each rank that raises notes there its error and when,
so the launcher names the rank that failed first. torch's agent reports one failed rank, whichever exit it saw first:
a rank that crashed and the neighbour whose transfer then broke on the closed connection race, and the neighbour's
"Connection closed by peer" once reached the user instead of the crash."""


def note_failure(exc: BaseException) -> None:
    """Note this rank's error (its first line, the time, the restart attempt) where the launcher reads it, once: the
    first note of an attempt stands. A rank that cannot write it is reported as torch's agent saw it."""
    directory = os.environ.get(FAILURES_ENV)
    if not directory:
        return
    rank = int(os.environ.get("RANK", 0))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    text = str(exc).strip()
    line = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
    note = {"rank": rank, "time": time.time(), "attempt": attempt, "line": line}
    try:
        with open(Path(directory, f"rank{rank}-attempt{attempt}.json"), "x") as out:
            out.write(json.dumps(note))
    except OSError:  # FileExistsError included: noted already
        pass


def run_rank(config: RunConfig, hooks: Sequence[RunHooks] = ()) -> dict[str, Any]:
    """Train on this rank (environment from torchrun / the elastic launcher) calling ``hooks``; return its summary."""
    rank, world = _env()
    device = rank_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Train in the allocator regime the profile measured (freed memory reused, as the CUDA
        # caching allocator does); glibc's default mmap/munmap of large activations made small
        # models' steps 40-80% slower than their profiles predicted.
        steady_cpu_allocator()
    prepared = prepare(config, world, device)  # everything that can be refused, before any collective
    dist.init_process_group(process_group_backend(device), rank=rank, world_size=world,
                            timeout=timedelta(seconds=config.timeout_s))
    link = parse_link(config.emulate_link)
    try:
        with netem.instrument(netem.Traffic(), link) as traffic:
            if prepared.plan.shape().served:
                from planner.runtime.parameter_server.run import run_served

                summary = run_served(config, prepared, rank, world)
            else:
                summary = _train(config, prepared, rank, device, hooks)
        sent = torch.tensor([traffic.bytes_sent, traffic.emulated_s], dtype=torch.float64, device=device)
        dist.all_reduce(sent)  # after the instrumented part: the totals do not count themselves
        summary.update(bytes_sent=int(sent[0]), emulated_link=link.to_dict() if link else None,
                       emulated_link_s=float(sent[1]))
        dist.barrier()  # leave together: gloo aborts a peer torn down mid-transfer
        return summary
    except Exception as exc:
        if not isinstance(exc, PlannerError):
            note_failure(exc)  # before the group goes: tearing it down fails the neighbours' transfers
        raise
    finally:
        dist.destroy_process_group()


def _train(config: RunConfig, prepared: Prepared, rank: int, device: torch.device,
           hooks: Sequence[RunHooks]) -> dict[str, Any]:
    run = RankRun(config, prepared, rank, device)
    for hook in hooks:
        hook.on_start(run)
    first_step = run.step  # above 0 when a hook resumed from a checkpoint
    target = parse_target(config.target)
    evals: list[dict[str, Any]] = []
    eval_s = 0.0
    reached: float | None = None
    start = time.perf_counter()

    def evaluate() -> bool:
        """Evaluate (time excluded from training), tell the hooks; True when the run should stop at the target."""
        nonlocal eval_s, reached
        began = time.perf_counter()
        result = {"step": run.step, "wall_s": began - start - eval_s, **run.evaluate(config.eval_batches)}
        eval_s += time.perf_counter() - began
        evals.append(result)
        for hook in hooks:
            hook.on_eval(run, result)
        if target is not None and reached is None and target.reached(result["loss"], result["accuracy"]):
            reached = result["wall_s"]
            return config.stop_at_target
        return False

    stop = bool(config.eval_every) and evaluate()
    while run.step < config.steps and not stop:
        for hook in hooks:
            hook.before_round(run)
        stats, seen = run.train_round(min(config.round_steps, config.steps - run.step), hooks)
        log.info("rank %d round %d: loss %.6f wall %.3fs", rank, stats.index, stats.losses[-1], stats.wall_s)
        for hook, round_end in zip(hooks, seen):
            hook.on_round(run, round_end)
        every = config.eval_every
        if every and (run.step // every > stats.first_step // every or run.step >= config.steps):
            stop = evaluate()
    run.sync.finish(run.stages.params)
    if run.engine is not None:
        run.engine.close()
    wall_s = time.perf_counter() - start - eval_s
    for hook in hooks:
        hook.on_end(run)
    if config.params_out:
        out = Path(config.params_out)
        out.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in run.stages.params.items()}, out / f"rank{rank}.pt")
    return {
        "rank": rank, "world_size": run.stages.world_size, "backend": dist.get_backend(),
        "schedule": run.plan.schedule, "microbatches": run.plan.microbatches,
        "microbatch_size": prepared.settings.microbatch_size, "optimizer": prepared.settings.optimizer,
        "lr": prepared.settings.lr, "loss": prepared.spec.loss, "steps": run.step, "losses": run.losses,
        "first_step": first_step,
        "resumed": prepared.resume.to_dict() if prepared.resume is not None and first_step else None,
        "wall_s": wall_s, "eval_s": eval_s, "eval": evals,
        "target": target.to_dict() if target is not None else None, "time_to_target_s": reached,
        "bytes_sent": None,  # filled in by run_rank (every rank's, summed)
        "data": {"source": config.data or "synthetic", "task": prepared.spec.loss,
                 "fingerprint": prepared.data_fingerprint},
        "sync": {"mode": run.sync.mode, "degree": run.stages.degree, "shares": list(run.stages.shares),
                 **whole_run_report([*run.sync_reports, run.sync.report()])},
        "replica": run.stages.replica,
        "step_time_s": steady_step_time_s(run.rounds, run.engine.warmup if run.engine is not None else 0),
        "predicted_step_time_s": run.plan.step_time_s,
        "device_mismatch": list(prepared.device_mismatch),
        "rounds": [dataclasses.asdict(r) for r in run.rounds],
        "stages": [s.stage_index for s in run.stages.stages],
        "async": run.engine.report() if run.engine is not None else None,
        "plan": run.plan.to_dict(),
        **run.report,
    }


STEADY_ROUNDS = 3
"""Rounds the steady step time is averaged over: the last ones, never the first (its steps pay one-off costs)."""


def steady_step_time_s(rounds: Sequence[RoundEnd], warmup: int = 0) -> float | None:
    """Mean step time of this rank over the last ``STEADY_ROUNDS`` rounds after the first (``None``: none ran) and,
    where any ran, after an asynchronous schedule's synchronous warm-up (steps before ``warmup``, which drain)."""
    later = [r for r in rounds[1:] if r.first_step >= warmup] or list(rounds[1:] or rounds)
    later = later[-STEADY_ROUNDS:]
    steps = sum(r.steps for r in later)
    return sum(r.wall_s for r in later) / steps if steps else None


def _env() -> tuple[int, int]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise DistributedError("RANK and WORLD_SIZE are not set; start ranks with `plan run` or "
                               "`torchrun --nproc-per-node K -m planner.run PLAN MODEL`") from None
