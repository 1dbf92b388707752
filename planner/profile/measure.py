"""Measure every op of a captured graph on the local device: times, bytes and FLOPs (the orchestration).

The steps, and the module that decides each: 1 ``memory`` (saved activations, bytes), 2 ``op_timing`` (one op
alone), 3-6 ``whole_model`` (warm-up, the whole model, a training micro-batch, the optimizer step, the loss);
co-location (``--colocate``) is ``colocate``.


1. One recorded run of the whole graph (``torch.fx.Interpreter``, gradients on) gives the real
   inputs of every node, which values require grad, and the tensors autograd saves for backward
   (``torch.autograd.graph.saved_tensors_hooks``; each storage counted once, at the node that saved
   it first; parameters and buffers excluded).
2. Per op, forward time = median of calling the op's target on detached copies of its real inputs
   (same ``requires_grad`` as in the model, live parameters), timer overhead removed. Backward time =
   median of ``torch.autograd.grad`` from the op's outputs to the inputs and parameters that require
   grad, after an untimed forward. FLOPs come from ``FlopCounterMode`` around one extra call of each.
3. The whole model's forward and backward are timed the same way, so the profile can report the
   sum of the per-op times next to the whole (a check on the per-op method).
4. One *training* micro-batch of the whole model is timed as training runs it: forward, then
   ``torch.autograd.backward`` accumulating into the parameters' ``.grad`` (the second and later
   micro-batches of a step add into existing gradients). The cost model scales the per-op times so
   that they sum to it (docs/cost-model.md, "Calibration"): isolated ops run with warm caches and
   without the gradient accumulation, the Python dispatch between ops and the allocator traffic of a
   real step, so their sum falls 2-20 % short of a real micro-batch on CPU. A second training micro-batch of
   twice the rows gives the share of that time that does not grow with the rows (``rows_scaling``), with which
   the planner rescales times to another micro-batch size.
5. One optimizer step over all parameters (the gradients divided by the micro-batch count, then
   ``step()``), for each optimizer ``plan run`` offers, with a learning rate of 0 so that the
   parameters stay as they were. The cost model charges each stage its share by parameter bytes.
6. The default loss of ``plan run`` (``planner.data.factory``: next-token cross-entropy for a language
   model, mean squared error otherwise) on the model's output, forward and backward to the output: the
   last stage pays it. Models whose output ``plan run`` cannot train on by default get none.
7. The backward fused and split into the input gradient and the weight gradient as torch's zero-bubble runtime
   runs them, on the whole model and on its later half (``whole_model.measure_split_points``): the split's extra
   cost, which the cost model charges the zero-bubble schedules' stages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from planner.profile.capture import Captured
from planner.profile.memory import nbytes, record
from planner.profile.op_timing import OpMeasurement, grad_call_overhead, measure_op
from planner.profile.timer import Timer, steady_cpu_allocator
from planner.profile.whole_model import (WholeModel, measure_loss, measure_rows_scaling, measure_split_points,
                                         measure_training, measure_update, measure_update_per_tensor, measure_versions,
                                         measure_whole, num_threads, probe, time_training, warm_whole)

__all__ = ["Measurement", "OpMeasurement", "WholeModel", "Progress", "measure", "time_training"]

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Measurement:
    ops: tuple[OpMeasurement, ...]
    whole: WholeModel
    timer_overhead_s: float
    grad_overhead_s: float
    """Fixed cost of one ``autograd.grad`` call (engine start-up), taken out of every per-op backward."""
    threads: int
    clock: str
    """``thread_cpu``, ``wall`` or ``cuda_events`` (see :mod:`planner.profile.timer`)."""
    allocator: str
    """How host memory was allocated while timing (see :func:`planner.profile.timer.steady_cpu_allocator`)."""


def measure(captured: Captured, module: nn.Module, inputs: Sequence[Any], *, device: torch.device,
            repeats: int = 5, warmup: int = 2, threads: int | None = 1, progress: Progress | None = None) -> Measurement:
    """Measure every op of ``captured`` (see the module docstring); ``threads`` pins intra-op threads on CPU."""
    allocator = steady_cpu_allocator() if device.type == "cpu" else "cuda caching allocator"
    with num_threads(threads if device.type == "cpu" else None) as used:
        timer = Timer(device, repeats, warmup)
        grad_overhead_s = grad_call_overhead(timer, device)
        run = record(captured, module, inputs)
        params = {id(p) for p in module.parameters()} | {id(b) for b in module.buffers()}
        # Warm every op before timing any: the first op timed used to pay for the allocator's growth,
        # cold caches and one-off kernel setup (a first block measured 15% to 4x its identical twins).
        warm_whole(module, inputs, warmup)
        for op in captured.ops:
            measure_op(captured, op, run, None, params, grad_overhead_s)
        results = []
        total = len(captured.ops) + 1
        for i, op in enumerate(captured.ops):
            if progress:
                progress(i, total, op.name)
            measured = measure_op(captured, op, run, timer, params, grad_overhead_s)
            assert measured is not None
            results.append(measured)
        if progress:
            progress(total - 1, total, "whole model")
        output, grads_out = probe(module, inputs)
        whole = measure_whole(module, inputs, grads_out, timer)
        train_s = measure_training(module, inputs, grads_out, timer)
        rows_scaling = measure_rows_scaling(module, inputs, train_s, timer)
        update_s = measure_update(module, timer)
        trainable = [p for p in module.parameters() if p.requires_grad]
        update_tensor_s = measure_update_per_tensor(len(trainable), timer)
        version_s = measure_versions(module, timer)
        split_backward = measure_split_points(captured, module, inputs, run.saved, timer)
        loss = measure_loss(inputs, output, timer)
        if progress:
            progress(total, total, "done")
    summed = WholeModel(whole[0], whole[1], sum(r.fwd_s for r in results), sum(r.bwd_s for r in results), train_s,
                        update_s, sum(nbytes(p) for p in trainable), version_s=version_s,
                        split_backward=split_backward, loss=loss, update_tensor_s=update_tensor_s,
                        update_param_tensors=len(trainable), rows_scaling=rows_scaling)
    return Measurement(tuple(results), summed, timer.overhead_s, grad_overhead_s, used, timer.clock, allocator)
