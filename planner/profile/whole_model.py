"""The whole model as training runs it (``planner.profile.measure``, steps 3-6), and the warm-up before any op is timed.

- ``warm_whole``: a few whole training micro-batches before any op is timed, so that the first op timed does
  not pay for the allocator's growth, cold caches and one-off kernel setup (a first block measured 15% to 4x
  its identical twins without it).
- ``measure_whole``: the whole model's forward and backward, timed like the ops (the check on the per-op sum).
- ``measure_training``: one training micro-batch, backward accumulating into ``.grad``: what the cost model
  calibrates the per-op times to (docs/cost-model.md, "Calibration"); ``time_training`` is the same for
  ``--colocate`` (``planner.profile.colocate``).
- ``measure_rows_scaling``: one training micro-batch of twice the rows: the share of the time that does not grow
  with the rows, with which the planner rescales times to other micro-batch sizes.
- ``measure_update``: one optimizer step per optimizer ``plan run`` offers (lr 0: parameters unchanged).
- ``measure_split_backward``: the backward fused, and split as torch's zero-bubble runtime splits it (``I`` then ``W``);
  ``measure_split_points`` takes it on the model and on its later half.
- ``measure_loss``: ``plan run``'s default loss on the model's output, forward and backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from planner.optim import OPTIMIZERS, build_optimizer
from planner.profile.capture import Captured
from planner.profile.loader import batch_size, rescale_batch
from planner.profile.memory import differentiable, nbytes
from planner.profile.timer import Timer

log = logging.getLogger(__name__)

__all__ = ["WholeModel", "warm_whole", "probe", "measure_whole", "time_training", "measure_training",
           "measure_rows_scaling", "UPDATE_OPTIMIZERS", "measure_update", "measure_update_per_tensor", "measure_split_backward",
           "measure_split_points", "measure_loss", "num_threads"]


@dataclass(frozen=True)
class WholeModel:
    fwd_s: float
    bwd_s: float
    sum_ops_fwd_s: float
    sum_ops_bwd_s: float
    train_s: float = 0.0
    """One training micro-batch of the whole model: forward + backward accumulating into ``.grad``
    (0 when the model has no trainable parameter)."""
    update_s: Mapping[str, float] = field(default_factory=dict)
    """Optimizer name -> seconds of one step over every trainable parameter (empty without any)."""
    update_param_bytes: int = 0
    """Bytes of the parameters that step updated."""
    update_tensor_s: Mapping[str, float] = field(default_factory=dict)
    """Optimizer name -> seconds of its step per parameter tensor, whatever the tensor's size
    (``measure_update_per_tensor``): the part of ``update_s`` a stage pays per tensor it holds, not per byte."""
    update_param_tensors: int = 0
    """How many parameter tensors the step of ``update_s`` updated."""
    version_s: float = 0.0
    """Seconds of the asynchronous pipeline's version bookkeeping at one update over the same parameters
    (``measure_versions``; 0 without any)."""
    split_backward: Sequence[Mapping[str, float]] = ()
    """One micro-batch's backward fused, and its two halves as the zero-bubble runtime runs them, on the model and
    on its later half (``measure_split_points``): ``{"saved_bytes", "fused_s", "input_s", "weight_s"}`` each
    (empty without trainable parameters)."""
    loss: Mapping[str, Any] = field(default_factory=dict)
    """The default loss on the model's output: ``{"name", "fwd_s", "bwd_s", "output_bytes"}`` (empty if none)."""
    rows_scaling: Mapping[str, Any] = field(default_factory=dict)
    """How the training micro-batch's time grows with its rows (``measure_rows_scaling``): ``{"rows": [b, 2b],
    "train_s": [t_b, t_2b], "fixed_fraction": f}``, where ``f`` is the share of ``t_b`` that does not grow with
    the rows (empty where the doubled micro-batch could not be timed)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "sum_ops_fwd_s": self.sum_ops_fwd_s,
                               "sum_ops_bwd_s": self.sum_ops_bwd_s}
        if self.train_s > 0:
            out["train_s"] = self.train_s
        if self.update_s:
            out["update_s"] = dict(self.update_s)
            out["update_param_bytes"] = self.update_param_bytes
        if self.update_tensor_s:
            out["update_tensor_s"] = dict(self.update_tensor_s)
            out["update_param_tensors"] = self.update_param_tensors
        if self.version_s > 0:
            out["version_s"] = self.version_s
        if self.split_backward:
            out["split_backward"] = [dict(point) for point in self.split_backward]
        if self.loss:
            out["loss"] = dict(self.loss)
        if self.rows_scaling:
            out["rows_scaling"] = dict(self.rows_scaling)
        return out


def warm_whole(module: nn.Module, inputs: Sequence[Any], steps: int) -> None:
    """A few whole training micro-batches (forward and backward), gradients dropped afterwards."""
    for _ in range(max(steps, 1)):
        outputs = differentiable(module(*inputs))
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    module.zero_grad(set_to_none=True)


def probe(module: nn.Module, inputs: Sequence[Any]) -> tuple[Any, list[torch.Tensor]]:
    """One untimed forward of the whole model with gradients on: its output (detached, so the graph is
    freed) and random output gradients for its differentiable outputs (empty if none)."""
    with torch.enable_grad():
        output = module(*inputs)
    grads_out = [torch.randn_like(t) for t in differentiable(output)]
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, output), grads_out


def measure_whole(module: nn.Module, inputs: Sequence[Any], grads_out: list[torch.Tensor],
                   timer: Timer) -> tuple[float, float]:
    """Forward and backward seconds of the whole model, timed like the ops (``grads_out`` from :func:`probe`)."""
    params = [p for p in module.parameters() if p.requires_grad]
    with torch.enable_grad():
        fwd_s = timer.time(lambda _: module(*inputs))
        if not grads_out or not params:
            return fwd_s, 0.0
        bwd_s = timer.time(lambda outs: torch.autograd.grad(outs, params, grads_out, allow_unused=True),
                           lambda: differentiable(module(*inputs)))
    return fwd_s, bwd_s


def time_training(module: nn.Module, inputs: Sequence[Any], device: torch.device, repeats: int, warmup: int,
                  threads: int | None) -> float:
    """One training micro-batch of the whole model, timed as ``measure`` times it (for ``--colocate``)."""
    with num_threads(threads if device.type == "cpu" else None):
        timer = Timer(device, repeats, warmup)
        _, grads_out = probe(module, inputs)
        return measure_training(module, inputs, grads_out, timer)


def measure_training(module: nn.Module, inputs: Sequence[Any], grads_out: list[torch.Tensor], timer: Timer) -> float:
    """Seconds of one training micro-batch: forward, then backward into the parameters' ``.grad``.

    Gradients accumulate across the repeats, as over the micro-batches of a step; the parameters'
    ``.grad`` are restored afterwards (the model is left as it was given)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or not grads_out:
        return 0.0

    def step(_: Any) -> None:
        outs = differentiable(module(*inputs))
        torch.autograd.backward(outs, grads_out[: len(outs)])

    with torch.enable_grad(), _grads_restored(params):
        return timer.time(step)


def measure_rows_scaling(module: nn.Module, inputs: Sequence[Any], train_s: float, timer: Timer) -> dict[str, Any]:
    """Time a training micro-batch of twice the rows, beside ``train_s`` at the profiled rows: the share of the
    time that stays fixed as rows grow (per-kernel launches and the framework's dispatch) is
    ``f = (2 t_b - t_2b) / t_b``, clamped to [0, 1]; the planner rescales times to other micro-batch sizes
    as ``t_b (f + (1 - f) k)``, on a GPU at least the roofline's work (``partition.search.settings.time_growth``). On a GPU small micro-batches are mostly
    fixed cost (on an H200 gpt_small's 8-row micro-batch trained no slower than its 4-row one), where a purely
    linear rescale predicted 4.5x the measured step. Empty where the model has no trainable parameter or the
    doubled micro-batch does not fit in memory."""
    rows = batch_size(inputs)
    if train_s <= 0:
        return {}
    doubled = rescale_batch(inputs, 2 * rows)
    try:
        _, grads_out = probe(module, doubled)
        twice = measure_training(module, doubled, grads_out, timer)
    except torch.cuda.OutOfMemoryError:
        log.warning("a micro-batch of %d rows does not fit: times rescale in proportion to the rows", 2 * rows)
        return {}
    if twice <= 0:
        return {}
    fixed = min(max((2 * train_s - twice) / train_s, 0.0), 1.0)
    return {"rows": [rows, 2 * rows], "train_s": [train_s, twice], "fixed_fraction": fixed}


UPDATE_OPTIMIZERS = {name: functools.partial(build_optimizer, name, lr=0.0) for name in OPTIMIZERS}
"""The optimizers ``plan run`` offers, built as it builds them (``planner.optim.build_optimizer``) but with lr 0."""


def measure_update(module: nn.Module, timer: Timer, microbatches: int = 8) -> dict[str, float]:
    """Seconds of one optimizer step over every trainable parameter, per optimizer, as ``plan run``
    takes it: gradients divided by the micro-batch count, then ``step()`` (lr 0: parameters unchanged).

    Gradients are random stand-ins and the optimizer state is made by the warm-up steps; the
    parameters' own ``.grad`` are restored afterwards."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return {}
    with _grads_restored(params):
        for p in params:
            p.grad = torch.randn_like(p)
        return _time_steps(params, timer, microbatches)


def measure_update_per_tensor(count: int, timer: Timer, microbatches: int = 8) -> dict[str, float]:
    """Seconds of one optimizer step per parameter tensor, per optimizer, whatever the tensor's size: the same step
    as ``measure_update`` over ``count`` one-element tensors (as many as the model has trainable ones), over
    ``count``.

    A step's cost is a sweep over the bytes plus a fixed cost per tensor (the optimizer's per-parameter
    bookkeeping, one kernel launch or loop iteration each): on one CPU thread about half of Adam's step over the
    digits CNN's 8 tensors (38 k parameters) is that fixed part, so a stage holding a few small tensors pays for
    their count, not only their bytes (``planner.partition.model.times.update_rates``)."""
    if count <= 0:
        return {}
    stand_ins = [nn.Parameter(torch.zeros(1)) for _ in range(count)]
    for p in stand_ins:
        p.grad = torch.randn_like(p)
    return {name: seconds / count for name, seconds in _time_steps(stand_ins, timer, microbatches).items()}


def _time_steps(params: list[nn.Parameter], timer: Timer, microbatches: int) -> dict[str, float]:
    """Per optimizer of ``UPDATE_OPTIMIZERS``: seconds of one step over ``params`` (their ``.grad`` set)."""
    out = {}
    for name, make in UPDATE_OPTIMIZERS.items():
        optimizer = make(params)

        def step(_: Any, optimizer: torch.optim.Optimizer = optimizer) -> None:
            for p in params:
                p.grad.div_(microbatches)
            optimizer.step()

        out[name] = timer.time(step)
        del optimizer
    return out


def measure_versions(module: nn.Module, timer: Timer) -> float:
    """Seconds of the version bookkeeping an asynchronous stage does at each update besides its optimizer step
    (``planner.runtime.pipeline.versions.version_work``: a snapshot of the weights, their delta against the last
    one, a predicted copy, the gradient accumulators zeroed), over every trainable parameter; 0 without any."""
    from planner.runtime.pipeline.versions import Version, version_work

    params = {str(i): p for i, p in enumerate(p for p in module.parameters() if p.requires_grad)}
    if not params:
        return 0.0
    accumulators = [torch.zeros_like(p) for p in params.values()]
    previous = Version.of(0, params, None)
    return timer.time(lambda _: version_work(params, accumulators, previous))


def measure_split_backward(module: nn.Module, inputs: Sequence[Any], timer: Timer) -> dict[str, float]:
    """Seconds of one micro-batch's backward, fused and split, with the model standing for a stage that is not
    the first of its pipeline: ``fused_s`` as 1F1B's ``B`` runs it (``torch.autograd.backward`` into ``.grad``),
    ``input_s`` and ``weight_s`` as torch's zero-bubble runtime runs ``I`` and ``W``
    (``torch.distributed.pipelining._backward.stage_backward_input``, then ``stage_backward_weight`` from the
    intermediate gradients ``I`` kept). ``W`` is one ``autograd.grad`` call per group of weights, so the halves
    together take longer than the fused backward; the cost model charges the excess (docs/cost-model.md).

    The stage's inputs are the model's floating inputs, made to require grad; a model whose inputs are not
    floating (token ids) starts from its first floating activation instead (the first leaf module's output,
    detached), as the next stage's input would. Empty without trainable parameters or a differentiable output;
    the parameters' ``.grad`` are restored afterwards, and a graph torch's split cannot run gets none (a warning)."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return {}

    def forward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        args = [x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
                for x in inputs]
        stage_inputs = [x for x in args if isinstance(x, torch.Tensor) and x.requires_grad]
        with torch.enable_grad(), _first_activation_as_input(module, stage_inputs, enabled=not stage_inputs):
            # outputs of their own, as the runtime's zero-bubble stages return them (``OwnOutputs``): ``I``
            # detaches them in place, and an output that an op also saved would break ``W``
            return [t.clone() for t in differentiable(module(*args))], stage_inputs

    outs, stage_inputs = forward()
    if not outs or not stage_inputs:
        return {}
    grads_out = [torch.randn_like(t) for t in outs]

    def input_half(state: tuple[list[torch.Tensor], list[torch.Tensor]]) -> list[dict[str, Any]]:
        return stage_backward_input(state[0], grads_out, state[1], iter(params))[1]

    try:  # the excess is a difference of two long figures: they take turns, over more rounds than one figure takes
        with _grads_restored(params):
            fused_s, input_s, weight_s = timer.time_turns(
                [(lambda state: torch.autograd.backward(state[0], grads_out), forward), (input_half, forward),
                 (lambda groups: stage_backward_weight(iter(params), groups), lambda: input_half(forward()))],
                rounds=3 * timer.repeats)
    except RuntimeError as exc:  # torch's split cannot run this graph: the cost model then charges nothing
        log.warning("could not time the split backward: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return {}
    return {"fused_s": fused_s, "input_s": input_s, "weight_s": weight_s}


def measure_split_points(captured: Captured, module: nn.Module, inputs: Sequence[Any], saved: Mapping[str, int],
                         timer: Timer) -> list[dict[str, float]]:
    """``measure_split_backward`` at two sizes, each with the bytes its ops save (``saved``: op name -> bytes, from
    ``memory.record``): the whole model, and the stage the runtime cuts from the ops after the one where half of
    the saved bytes are reached (``planner.runtime.pipeline.graph_split``, as ``plan run`` cuts stages). The excess
    grows faster than the bytes (gpt_small: 0.45 ms per MB on a third of the model, 0.8 on all of it), so the cost
    model fits it through both. The half is left out where it cannot be cut or timed."""
    from planner.errors import PlannerError
    from planner.runtime.pipeline.graph_split import assign_nodes, split_graph

    whole = measure_split_backward(module, inputs, timer)
    if not whole:
        return []
    points = [{"saved_bytes": sum(saved.get(op.name, 0) for op in captured.ops), **whole}]
    ops = [op for op in captured.ops if op.node.op != "placeholder"]
    running, cut = 0, len(ops)
    for i, op in enumerate(ops):
        running += saved.get(op.name, 0)
        if 2 * running >= points[0]["saved_bytes"]:
            cut = i + 1
            break
    later = ops[cut:]
    if not later:
        return points
    try:
        stage_of = assign_nodes(captured, {op.name: int(i >= cut) for i, op in enumerate(ops)}, 2)
        first, second = split_graph(captured, module, stage_of, 2)
        with torch.no_grad():
            sent = first.module(*inputs)
        half = measure_split_backward(second.module, tuple(sent) if isinstance(sent, tuple) else (sent,), timer)
    except (PlannerError, RuntimeError) as exc:  # a graph the runtime cannot cut there: the whole model alone
        log.warning("could not time the split backward of the model's later half: %s", exc)
        return points
    if half:
        points.append({"saved_bytes": sum(saved.get(op.name, 0) for op in later), **half})
    return points


@contextlib.contextmanager
def _grads_restored(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """The parameters' ``.grad`` as they were before the block, whatever the timing left in them."""
    before = [p.grad for p in params]
    try:
        yield
    finally:
        for p, grad in zip(params, before):
            p.grad = grad


@contextlib.contextmanager
def _first_activation_as_input(module: nn.Module, stage_inputs: list[torch.Tensor], enabled: bool) -> Iterator[None]:
    """While active, the first floating output of a leaf module is detached and made to require grad, and
    appended to ``stage_inputs``: the rest of the model then runs as a stage that receives it."""
    if not enabled:
        yield
        return

    def hook(_: nn.Module, __: Any, output: Any) -> Any:
        if stage_inputs or not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        stage_inputs.append(output.detach().requires_grad_(True))
        return stage_inputs[-1]

    handles = [m.register_forward_hook(hook) for m in module.modules() if not any(True for _ in m.children())]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def measure_loss(inputs: Sequence[Any], output: Any, timer: Timer) -> dict[str, Any]:
    """Forward and backward seconds of ``plan run``'s default loss on the model's ``output`` (see item 6)."""
    from planner.errors import ModelError
    from planner.data.factory import data_spec, default_target, loss_fn

    cpu_inputs = [x.cpu() if isinstance(x, torch.Tensor) else x for x in inputs]
    try:
        spec = data_spec(cpu_inputs, output)  # raises unless every input is a tensor
    except ModelError:
        return {}
    target = default_target(spec, cpu_inputs, torch.Generator().manual_seed(0)).to(output.device)
    loss = loss_fn(spec)
    logits = output.detach().requires_grad_(True)
    with torch.enable_grad():
        fwd_s = timer.time(lambda _: loss(logits, target))
        bwd_s = timer.time(lambda value: torch.autograd.grad(value, logits), lambda: loss(logits, target))
    return {"name": spec.loss, "fwd_s": fwd_s, "bwd_s": bwd_s, "output_bytes": nbytes(output)}


@contextlib.contextmanager
def num_threads(threads: int | None) -> Iterator[int]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
