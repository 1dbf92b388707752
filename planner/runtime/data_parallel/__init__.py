"""The data-parallel layer: the replicas of this rank's stages and how they combine their updates.

A rank trains the stages the plan gives it; with a plan's ``data_parallel.degree`` d > 1 the same stages
also live on d - 1 other ranks, and after every step (or every few, for local steps) the replicas combine
their updates. The worker calls one ``UpdateSync`` per rank at two points of a step:

- ``after_backward(params)``: the step's gradients are complete (accumulated over this replica's
  micro-batches and averaged by ``pipeline.stages.average_grads``); a synchronous mode averages them here;
- ``after_step(params)``: the optimizer has stepped; a mode that averages parameters does it here;

and at every round's end ``round_figures(compute_s)`` (what this rank adds to the worker's one round-end exchange,
given its compute seconds per step) and ``after_round(losses, figures)`` (the round's step losses and every rank's
figures, the same on every rank), ``finish(params)`` before anything reads the model (evaluation, a
re-plan, the end of the run), ``report()`` for the run summary.

Modes: ``SingleReplica`` (degree 1: pure pipelines), ``Synchronous`` (``ssgd``: gradients averaged every
step, weighted by each replica's samples), and in ``local.py`` ``LocalSGD`` (``local-sgd``) and ``Adaptive``
(``adaptive``, docs/sync.md). ``sync_for`` refuses any other ``data_parallel.sync`` in one line, the
parameter-server modes included (``planner.runtime.parameter_server`` runs those, with a server rank).

How ``ssgd`` averages: after the schedule, each replica's gradients are the *sum* over its own micro-batches
(``scale_grads=False``); ``Synchronous.after_backward`` divides them by the step's global micro-batch count and
sums them over the stage's ``dp`` group in one flat all-reduce per rank, so replica ``r`` weighs ``m_r / m`` and
one step equals one step of single-process training on the global batch, for any shares.

Why not DDP: ``torch.distributed.pipelining`` drives DDP by hand (``no_sync`` for every
micro-batch but the last, then ``reducer.prepare_for_backward``). On torch 2.13 with our graph-split stage modules
that broke DDP's bucket rebuild after the first step (an internal assert on the rebuilt parameter indices);
``static_graph=True`` avoids the assert but deadlocked with uneven shares (3 micro-batches on one replica, 1 on
the other) and gave gradients 0.1% off the reference with even ones. DDP's default hook also averages over the
group, which is wrong for uneven shares. The flat all-reduce after the schedule is what the cost model assumes
(the sync starts when every replica has finished its backward passes; no overlap). torch's composable
``replicate`` (FSDP-based) was not tried.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import PlanMismatchError
from planner.formats.plan import SERVER_SYNCS, SYNC_MODES, Plan
from planner.runtime.data_parallel.local import (Adaptive, AdaptiveOptions, LocalSGD, QuietRounds, aggregation_report,
                                                 whole_run_report)

if TYPE_CHECKING:
    from planner.runtime.pipeline.stages import RankStages

__all__ = ["UpdateSync", "SingleReplica", "Synchronous", "LocalSGD", "Adaptive", "AdaptiveOptions", "SYNC_MODES",
           "sync_for", "sync_of", "whole_run_report"]


class UpdateSync(Protocol):
    """How the replicas of a rank's stages combine their updates (see the module docstring)."""

    mode: str
    reduces_in_backward: bool
    """True when ``after_backward`` itself averages over micro-batches (and replicas); the worker then does not."""
    moves_weights: bool
    """True when ``after_backward`` or ``after_step`` changes the parameters themselves (an averaging, a pull), not
    only their gradients: the asynchronous engine then takes a version's delta from the optimizer's step alone."""

    def after_backward(self, params: Mapping[str, nn.Parameter]) -> None: ...

    def after_step(self, params: Mapping[str, nn.Parameter]) -> None: ...

    def round_figures(self, compute_s: float) -> tuple[float, ...]: ...

    def after_round(self, losses: Sequence[float], figures: Sequence[Sequence[float]]) -> None: ...

    def finish(self, params: Mapping[str, nn.Parameter]) -> None: ...

    def carry(self, previous: "UpdateSync") -> None:
        """Take over what the run learnt from ``previous``, the sync this one replaces (a re-plan)."""
        ...

    def report(self) -> dict[str, Any]: ...


class SingleReplica(QuietRounds):
    """Degree 1: nothing to combine."""

    mode = "none"
    reduces_in_backward = False
    moves_weights = False

    def after_backward(self, params: Mapping[str, nn.Parameter]) -> None:
        return None

    def after_step(self, params: Mapping[str, nn.Parameter]) -> None:
        return None


class Synchronous(QuietRounds):
    """``ssgd``: gradients summed over micro-batches, divided by the global count and summed over the replicas."""

    mode = "ssgd"
    reduces_in_backward = True
    """The micro-batch average is part of ``after_backward`` (the worker does not divide again)."""
    moves_weights = False

    def __init__(self, group: Any, microbatches: int) -> None:
        self.group = group
        self.microbatches = microbatches
        self.aggregations = 0
        self.blocked_s = 0.0
        """Seconds the all-reduces blocked training (all of their time: they do not overlap)."""

    def after_backward(self, params: Mapping[str, nn.Parameter]) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params.values()]
        for p, g in zip(params.values(), grads):
            p.grad = g
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.microbatches)
        began = time.perf_counter()
        dist.all_reduce(flat, group=self.group)
        self.blocked_s += time.perf_counter() - began
        self.aggregations += 1
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def after_step(self, params: Mapping[str, nn.Parameter]) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return aggregation_report(1, self.aggregations, self.blocked_s, self.blocked_s)


def sync_for(plan: Plan, group: Any = None, *, replica: int = 0, buffers: Sequence[torch.Tensor] = (),
             options: AdaptiveOptions | None = None) -> UpdateSync:
    """The ``UpdateSync`` of ``plan`` for this rank (``replica``, holding ``buffers``) over its ``dp`` ``group``; a
    sync mode this runtime does not have is refused in one line (before any rank starts: ``group`` may be ``None``
    there)."""
    shape = plan.shape()
    if not shape.replicated:
        return SingleReplica()
    mode = shape.sync
    own = [m for m in SYNC_MODES if m not in SERVER_SYNCS]
    if mode not in SYNC_MODES:
        raise PlanMismatchError(f"the plan's data_parallel.sync is {mode!r}, but this version of plan run synchronises "
                                f"replicas with {', '.join(SYNC_MODES)} only; set data_parallel.sync to ssgd or "
                                f"re-partition")
    if shape.served:
        raise PlanMismatchError(f"the plan's data_parallel.sync is {mode!r}, which trains through a parameter server "
                                f"rank that `plan run` starts (planner.runtime.parameter_server); the pipeline "
                                f"runtime combines replicas with {', '.join(own)} only; run the plan with plan run, "
                                f"or re-partition with --sync ssgd")
    if mode == "local-sgd":
        return LocalSGD(group, shape.shares[replica], plan.microbatches, shape.period, buffers)
    if mode == "adaptive":
        return Adaptive(group, shape.shares[replica], plan.microbatches, shape.period, buffers,
                        options or AdaptiveOptions())
    return Synchronous(group, plan.microbatches)


def sync_of(stages: "RankStages", options: AdaptiveOptions | None = None) -> UpdateSync:
    """The ``UpdateSync`` of a rank's ``stages``: their plan's mode over their ``dp`` group, with their buffers."""
    return sync_for(stages.plan, stages.mesh.get_group("dp") if stages.mesh is not None else None,
                    replica=stages.replica, buffers=[b for module in stages.modules for b in module.buffers()],
                    options=options)
