"""The per-rank training loop of ``plan run``: check the model against the plan, build this rank's stages,
train in rounds, report.

Every rank runs ``run_rank`` (started by ``plan run`` through torch's elastic launcher, or by ``torchrun``).
Everything that can be refused is checked *before* ``init_process_group`` -- plan/profile/model mismatch,
world size -- and every rank reaches the same verdict, so a bad run ends with one clear error rather than a
hang; collectives carry ``timeout_s``.

Hooks (issue 5, for rebalancing, migration and checkpoints):

(a) training runs in rounds of ``round_steps`` steps; after each round every rank calls
    ``RunHooks.on_round(run, stats)`` (``on_start`` before the first step, ``on_end`` after the last);
    hooks are named in ``RunConfig.hooks`` as ``pkg.mod:factory`` with ``factory(config) -> RunHooks``
    and read their options from ``RunConfig.options``;
(b) ``RankRun.build(plan)`` cuts the graph for another plan mid-run; ``RankRun.install`` switches to it
    (moving parameter values and optimizer state between ranks is the hook's job);
(c) ``RankRun.stages.stages`` are plain ``PipelineStage`` s whose compute methods a hook may wrap
    (``planner.runtime.timing.instrument_stage``); ``before_round`` runs just before a round starts and
    ``RoundEnd`` carries the round's wall time and losses;
(d) the optimizer is built from canonical parameter names (``RankStages.params``), so state moves by name;
(e) ``RankRun.step`` is the next step to run and ``RankRun.batch(step)`` a pure function of (seed, step).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from planner.profile.timer import steady_cpu_allocator
from planner.errors import DistributedError, PlannerError
from planner.formats.plan import Plan
from planner.runtime import data as data_mod
from planner.runtime.setup import Prepared, prepare
from planner.runtime.stages import (RankStages, average_grads, build_rank_stages, build_schedule, sync_tied_grads,
                                    sync_tied_params)
from planner.runtime.training import make_optimizer

__all__ = ["RunConfig", "RunHooks", "RoundEnd", "RankRun", "run_rank", "elastic_main"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    """Everything a rank needs; plain values so it pickles across the launcher."""

    plan: str
    """Path of the plan file."""
    model: str
    """``pkg.mod:factory`` or ``file.py:factory`` (the factory the plan's profile was made from)."""
    steps: int
    """Training steps to run (in total, counting resumed ones)."""
    microbatch_size: int | None = None
    """Rows per micro-batch; default: the profile's micro-batch size."""
    optimizer: str | None = None
    """``sgd`` or ``adam``; default: the plan's optimizer, else sgd."""
    lr: float | None = None
    """Learning rate; default 0.01 (sgd) or 1e-3 (adam)."""
    seed: int = 0
    """Seeds the model factory and the synthetic data."""
    data: str | None = None
    """``pkg.mod:factory`` supplying batches instead of synthetic data (see ``planner.runtime.data``)."""
    profile: str | None = None
    """Profile path; default: the plan's ``profile.path``."""
    round_steps: int = 5
    """Steps per round; hooks run after each round."""
    timeout_s: float = 120.0
    """Timeout of the process group's collectives and point-to-point transfers."""
    params_out: str | None = None
    """Directory: each rank writes ``rank{R}.pt`` (its parameters by canonical name) at the end."""
    hooks: tuple[str, ...] = ()
    """``pkg.mod:factory`` specs; ``factory(config)`` returns a ``RunHooks``."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Options for hooks (rebalancing, checkpoints, emulated slowdown), by name."""


@dataclass(frozen=True)
class RoundEnd:
    """One round on this rank."""

    index: int
    first_step: int
    steps: int
    wall_s: float
    """Wall time of the round's steps on this rank (data, schedule, gradient sync, optimizer)."""
    losses: tuple[float, ...]
    """Mean micro-batch loss of each step (broadcast from the last stage's rank)."""


class RunHooks:
    """Extension points; override what you need. Every rank calls every method at the same point."""

    def on_start(self, run: "RankRun") -> None:
        """After the stages are built, before ``run.step`` runs (may load a checkpoint and set ``run.step``)."""

    def before_round(self, run: "RankRun") -> None:
        """Just before each round's first step."""

    def on_round(self, run: "RankRun", stats: RoundEnd) -> None:
        """After each round (may ``run.install(run.build(new_plan))`` after moving parameters)."""

    def on_end(self, run: "RankRun") -> None:
        """After the last step, before results are gathered."""


class RankRun:
    """One rank's training state: what it holds, which step is next, the losses so far."""

    def __init__(self, config: RunConfig, prepared: Prepared, rank: int, device: torch.device) -> None:
        self.config = config
        self.prepared = prepared
        self.rank = rank
        self.device = device
        self.step = 0
        self.update_s = 0.0
        """Seconds spent in optimizer steps (with gradient averaging) so far; hooks read differences."""
        self.losses: list[float] = []
        self.rounds: list[RoundEnd] = []
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

    def install(self, stages: RankStages, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Train with ``stages`` from now on; a fresh optimizer over its parameters unless one is given."""
        self.stages = stages
        self.schedule = build_schedule(stages, data_mod.loss_fn(self.prepared.spec))
        settings = self.prepared.settings
        self.optimizer = optimizer or make_optimizer(stages.params, settings.optimizer, settings.lr)

    def batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Inputs and target of ``step`` (a pure function of seed and step), on this rank's device."""
        inputs, target = self.prepared.batch(step)
        return tuple(x.to(self.device) for x in inputs), target.to(self.device)

    def train_step(self) -> float | None:
        """Run step ``self.step``; return its mean micro-batch loss on the last stage's rank, else None."""
        inputs, target = self.batch(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {"target": target, "losses": losses} if self.stages.has_last else {}
        self.schedule.step(*(inputs if self.stages.has_first else ()), **kwargs)
        start = time.perf_counter()
        average_grads(self.stages.params, self.plan.microbatches)
        sync_tied_grads(self.stages)
        self.optimizer.step()
        self.update_s += time.perf_counter() - start
        self.step += 1
        return float(torch.stack([x.detach().float() for x in losses]).mean()) if losses else None

    def train_round(self, steps: int) -> RoundEnd:
        """``steps`` steps, then the losses broadcast from the last stage's rank."""
        first, local = self.step, []
        start = time.perf_counter()
        for _ in range(steps):
            local.append(self.train_step())
        wall_s = time.perf_counter() - start
        losses = torch.tensor([x if x is not None else 0.0 for x in local], dtype=torch.float64, device=self.device)
        dist.broadcast(losses, src=self.stages.rank_of_stage[-1])
        stats = RoundEnd(len(self.rounds), first, steps, wall_s, tuple(losses.tolist()))
        self.losses.extend(stats.losses)
        self.rounds.append(stats)
        return stats


def run_rank(config: RunConfig) -> dict[str, Any]:
    """Train on this rank (environment from torchrun / the elastic launcher); return its summary."""
    rank, world, local_rank = _env()
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Train in the allocator regime the profile measured (freed memory reused, as the CUDA
        # caching allocator does); glibc's default mmap/munmap of large activations made small
        # models' steps 40-80% slower than their profiles predicted.
        steady_cpu_allocator()
    prepared = prepare(config, world, device)  # everything that can be refused, before any collective
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=config.timeout_s))
    try:
        summary = _train(config, prepared, rank, device)
        dist.barrier()  # leave together: gloo aborts a peer torn down mid-transfer
        return summary
    finally:
        dist.destroy_process_group()


def _train(config: RunConfig, prepared: Prepared, rank: int, device: torch.device) -> dict[str, Any]:
    run = RankRun(config, prepared, rank, device)
    hooks = [_load_hook(spec, config) for spec in config.hooks]
    for hook in hooks:
        hook.on_start(run)
    start = time.perf_counter()
    while run.step < config.steps:
        for hook in hooks:
            hook.before_round(run)
        stats = run.train_round(min(config.round_steps, config.steps - run.step))
        log.info("rank %d round %d: loss %.6f wall %.3fs", rank, stats.index, stats.losses[-1], stats.wall_s)
        for hook in hooks:
            hook.on_round(run, stats)
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
        "wall_s": time.perf_counter() - start,
        "step_time_s": steady_step_time_s(run.rounds),
        "predicted_step_time_s": run.plan.step_time_s,
        "rounds": [dataclasses.asdict(r) for r in run.rounds],
        "stages": [s.stage_index for s in run.stages.stages],
        "plan": run.plan.to_dict(),
    }


STEADY_ROUNDS = 3
"""Rounds the steady step time is averaged over: the last ones, never the first (its steps pay one-off costs)."""


def steady_step_time_s(rounds: Sequence[RoundEnd]) -> float | None:
    """Mean step time of this rank over the last ``STEADY_ROUNDS`` rounds after the first (``None``: none ran)."""
    later = list(rounds[1:] or rounds)[-STEADY_ROUNDS:]
    steps = sum(r.steps for r in later)
    return sum(r.wall_s for r in later) / steps if steps else None


@record
def elastic_main(config: dict[str, Any]) -> dict[str, Any]:
    """Entry point for ``torch.distributed.launcher.api.elastic_launch``: errors come back as values.

    A ``PlannerError`` (bad plan, mismatch) is returned as ``{"error": ..., "exit_code": ...}`` so the
    launcher can print one line; anything else propagates and the launcher reports the failed rank.
    """
    try:
        return run_rank(RunConfig(**config))
    except PlannerError as exc:
        return {"rank": int(os.environ.get("RANK", 0)), "error": str(exc), "exit_code": exc.exit_code,
                "kind": type(exc).__name__}


def _env() -> tuple[int, int, int]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    except (KeyError, ValueError):
        raise DistributedError("RANK and WORLD_SIZE are not set; start ranks with `plan run` or "
                               "`torchrun --nproc-per-node K -m planner.run PLAN MODEL`") from None


def _load_hook(spec: str, config: RunConfig) -> RunHooks:
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(config)
