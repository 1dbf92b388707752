"""A parameter-server worker: pull the model, compute one iteration's gradient on this worker's share of the
step's batch, push it, wait for the reply, until the server says stop.

Iteration ``c`` of a worker reads its rows of the global batch of step ``c`` (a pure function of seed and step,
as every ``plan run`` mode reads them), so under ``bsp`` the workers' iteration ``c`` together is exactly step
``c`` of ``ssgd``. The gradient is the mean over the worker's micro-batches of each micro-batch's mean loss, as
the pipeline's replicas compute it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from planner.runtime.parameter_server.wire import ModelTensors, Push, recv_reply, send_push
from planner.runtime.slowdown import Slowdown, SlowdownPattern, touch_pages

__all__ = ["WorkerSetup", "work"]

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True)
class WorkerSetup:
    server: int
    share: int
    """This worker's micro-batches per iteration."""
    slowdown: SlowdownPattern | None = None


def work(setup: WorkerSetup, module: nn.Module, rows: Callable[[int], Batch],
         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
         sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """Train against the server until it says stop (``rows(c)``: this worker's inputs and target of step ``c``);
    what this worker did."""
    tensors = ModelTensors(module)
    model, out = tensors.empty(), tensors.empty()
    version = recv_reply(setup.server, model)
    clock, waited, compute_total, waited_total, slept = 0, 0.0, 0.0, 0.0, 0.0
    while version is not None:
        tensors.load(model)
        began = time.perf_counter()
        for p in tensors.params:
            p.grad = None
        inputs, target = rows(clock)
        loss_sum = 0.0
        for x, y in zip(zip(*(t.chunk(setup.share) for t in inputs)), target.chunk(setup.share)):
            loss = loss_fn(module(*x), y) / setup.share
            loss.backward()
            loss_sum += float(loss.detach())
        compute = time.perf_counter() - began
        if setup.slowdown is not None:  # the stretch keeps the worker's memory in use, as a slower device would
            extra = Slowdown(setup.slowdown.factor_at(clock), sleep=sleep, keep_warm=lambda: touch_pages(
                [*tensors.params, *(p.grad for p in tensors.params if p.grad is not None)])).stretch(compute)
            slept += extra
            compute += extra
        compute_total += compute
        send_push(setup.server, Push(clock, version, loss_sum, compute, waited), tensors.grads_and_buffers(out))
        clock += 1
        began = time.perf_counter()
        version = recv_reply(setup.server, model)
        waited = time.perf_counter() - began
        waited_total += waited
    return {"iterations": clock, "compute_s": compute_total, "waited_s": waited_total, "slept_s": slept}
