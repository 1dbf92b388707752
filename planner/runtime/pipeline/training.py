"""What a training step is, shared by the pipelined workers and the single-process reference.

* optimizers are built from *named* parameters (canonical FQNs, see ``graph_split.canonical_param_names``)
  so their state can be saved, compared and moved between ranks by name;
* ``train_reference`` is the single-process baseline the pipeline must equal: the whole model, the same
  batches, the same micro-batches with gradients averaged over them (what ``torch.distributed.pipelining``
  schedules do with ``scale_grads=True``), the same optimizer;
* ``check_graph`` compares a fresh capture with the plan's profile before any training starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from planner.errors import PlanMismatchError, UsageError
from planner.formats.plan import Plan
from planner.formats.profile import INPUT_OP, Profile
from planner.optim import OPTIMIZERS, build_optimizer
from planner.profile.capture import Captured
from planner.data.factory import DataSpec, loss_fn

__all__ = ["OPTIMIZERS", "DEFAULT_LR", "TrainSettings", "make_optimizer", "train_reference", "check_graph",
           "check_plan_nodes"]

DEFAULT_LR = {"sgd": 0.01, "adam": 1e-3}

BatchFn = Callable[[int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]


@dataclass(frozen=True)
class TrainSettings:
    """The knobs that define a training run's arithmetic (everything parity depends on)."""

    optimizer: str
    """``sgd`` or ``adam`` (torch.optim defaults besides the learning rate)."""
    lr: float
    microbatches: int
    """Micro-batches per step; the batch is ``microbatches * microbatch_size`` rows."""
    microbatch_size: int
    seed: int


def resolve_optimizer(plan: Plan, optimizer: str | None, lr: float | None) -> tuple[str, float]:
    """``--optimizer`` or the plan's optimizer (its memory figures assume it), else sgd; default lr per optimizer."""
    name = optimizer or str(plan.extra.get("optimizer", "sgd")).lower()
    if name not in OPTIMIZERS:
        if optimizer is None:
            name = "sgd"
        else:
            raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, found {optimizer!r}")
    rate = DEFAULT_LR[name] if lr is None else lr
    if not rate > 0:
        raise UsageError(f"--lr must be positive, found {lr}")
    return name, rate


def make_optimizer(named_params: Mapping[str, nn.Parameter], name: str, lr: float) -> torch.optim.Optimizer:
    """An optimizer over ``named_params`` (sorted by name); its state_dict carries the names."""
    params = sorted(named_params.items())
    if not params:  # a stage without parameters still steps (a no-op) so every rank runs the same loop
        params = [("_none", nn.Parameter(torch.zeros(0)))]
    if name not in OPTIMIZERS:
        raise UsageError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, found {name!r}")
    return build_optimizer(name, params, lr)  # Adam fused on CPU and CUDA (planner.optim)


@dataclass(frozen=True)
class ReferenceResult:
    losses: tuple[float, ...]
    """Mean micro-batch loss per step."""
    params: dict[str, torch.Tensor]
    """Canonical name -> parameter value after the last step."""


def train_reference(module: nn.Module, spec: DataSpec, settings: TrainSettings, batch: BatchFn,
                    steps: int) -> ReferenceResult:
    """Train ``module`` in one process exactly as the pipeline does (see module docstring)."""
    named = dict(module.named_parameters())
    optimizer = make_optimizer(named, settings.optimizer, settings.lr)
    criterion = loss_fn(spec)
    losses = []
    for step in range(steps):
        inputs, target = batch(step)
        optimizer.zero_grad(set_to_none=True)
        chunks = [x.chunk(settings.microbatches) for x in inputs]
        targets = target.chunk(settings.microbatches)
        total = 0.0
        for i in range(settings.microbatches):
            loss = criterion(module(*(c[i] for c in chunks)), targets[i])
            loss.backward()  # summed over micro-batches, then averaged: the pipeline's arithmetic
            total += float(loss.detach())
        for p in named.values():
            if p.grad is not None:
                p.grad.div_(settings.microbatches)
        optimizer.step()
        losses.append(total / settings.microbatches)
    return ReferenceResult(tuple(losses), {k: v.detach().clone() for k, v in named.items()})


def check_graph(captured: Captured, profile: Profile, microbatch_size: int, where: str) -> None:
    """Raise ``PlanMismatchError`` unless the captured graph has the profile's nodes, ops and sizes.

    Sizes (``output_bytes``) are compared only when the run uses the profile's micro-batch size.
    """
    ops = {op.name: op for op in captured.ops}
    names = [n.name for n in profile.nodes]
    missing = [n for n in names if n not in ops]
    known = set(names)
    extra = [n for n in ops if n not in known]
    if missing or extra:
        first = f"the profile's {missing[0]!r} is not in the graph" if missing else f"the graph's {extra[0]!r} is not in the profile"
        traced = str(profile.extra.get("tracer") or "")
        tracer = (f"; the profile was traced with {traced}, this graph with {captured.tracer}, and the two tracers "
                  f"name nodes differently" if traced and traced != captured.tracer else "")
        raise PlanMismatchError(
            f"the model's graph does not match {where}: {len(missing)} profile node(s) missing, {len(extra)} "
            f"unexpected ({first}){tracer}; profile and partition this model again, or pass the right MODEL")
    same_batch = int(profile.model.get("microbatch_size", microbatch_size)) == microbatch_size
    for node in profile.nodes:
        op = ops[node.name]
        if op.op != node.op:
            raise PlanMismatchError(f"the model's graph does not match {where}: node {node.name!r} is {op.op}, "
                                    f"the profile says {node.op}; profile and partition this model again")
        if same_batch and node.op != INPUT_OP and _output_bytes(op.node) not in (0, node.output_bytes):
            raise PlanMismatchError(
                f"the model's graph does not match {where}: node {node.name!r} outputs {_output_bytes(op.node)} "
                f"bytes, the profile says {node.output_bytes}; the shapes changed: profile the model again")


def check_plan_nodes(plan: Plan, profile: Profile, where: str) -> None:
    """Every profile node on exactly one stage of the plan (docs/formats.md)."""
    seen: dict[str, int] = {}
    for stage in plan.stages:
        for name in stage.nodes:
            if name in seen:
                raise PlanMismatchError(f"the plan puts node {name!r} on stages {seen[name]} and {stage.index}; "
                                        f"re-partition")
            seen[name] = stage.index
    missing = [n.name for n in profile.nodes if n.name not in seen]
    known = {p.name for p in profile.nodes}
    unknown = [n for n in seen if n not in known]
    if missing or unknown:
        what = f"{missing[0]!r} is on no stage" if missing else f"{unknown[0]!r} is not in the profile"
        raise PlanMismatchError(f"the plan does not match {where}: {what}; partition this profile again")


def _output_bytes(node: Any) -> int:
    val = node.meta.get("val")
    return sum(t.numel() * t.element_size() for t in tree_leaves(val) if isinstance(t, torch.Tensor))


def split_batch(inputs: Sequence[torch.Tensor], microbatches: int) -> None:
    """Raise unless every input's batch dimension divides into ``microbatches`` equal parts."""
    for x in inputs:
        if x.dim() == 0 or x.shape[0] % microbatches:
            raise UsageError(f"the batch dimension ({tuple(x.shape)[:1]}) must split into {microbatches} equal "
                             f"micro-batches; change --microbatch-size or the plan's microbatches")
