"""Measure every op of a captured graph on the local device: times, bytes and FLOPs.

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
   real step, so their sum falls 2-20 % short of a real micro-batch on CPU.
5. One optimizer step over all parameters (the gradients divided by the micro-batch count, then
   ``step()``), for each optimizer ``plan run`` offers, with a learning rate of 0 so that the
   parameters stay as they were. The cost model charges each stage its share by parameter bytes.
6. The default loss of ``plan run`` (``planner.data.factory``: next-token cross-entropy for a language
   model, mean squared error otherwise) on the model's output, forward and backward to the output: the
   last stage pays it. Models whose output ``plan run`` cannot train on by default get none.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from planner.profile.capture import Captured, CapturedOp
from planner.roofline import classify
from planner.profile.timer import Timer, steady_cpu_allocator

log = logging.getLogger(__name__)
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class OpMeasurement:
    """What was measured for one op (times in seconds, sizes in bytes)."""

    name: str
    fwd_s: float
    bwd_s: float
    output_bytes: int
    saved_bytes: int
    bytes_moved: int
    flops: int
    bwd_flops: int
    op_class: str
    dtype: str
    grad: bool
    """Whether the op takes part in backward (some input or parameter requires grad)."""
    error: str = ""
    """Why timing failed ("" when it did not); the times are then 0."""


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
    loss: Mapping[str, Any] = field(default_factory=dict)
    """The default loss on the model's output: ``{"name", "fwd_s", "bwd_s", "output_bytes"}`` (empty if none)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fwd_s": self.fwd_s, "bwd_s": self.bwd_s, "sum_ops_fwd_s": self.sum_ops_fwd_s,
                               "sum_ops_bwd_s": self.sum_ops_bwd_s}
        if self.train_s > 0:
            out["train_s"] = self.train_s
        if self.update_s:
            out["update_s"] = dict(self.update_s)
            out["update_param_bytes"] = self.update_param_bytes
        if self.loss:
            out["loss"] = dict(self.loss)
        return out


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
    with _num_threads(threads if device.type == "cpu" else None) as used:
        timer = Timer(device, repeats, warmup)
        grad_overhead_s = _grad_call_overhead(timer, device)
        run = _record(captured, module, inputs)
        params = {id(p) for p in module.parameters()} | {id(b) for b in module.buffers()}
        # Warm every op before timing any: the first op timed used to pay for the allocator's growth,
        # cold caches and one-off kernel setup (a first block measured 15% to 4x its identical twins).
        _warm_whole(module, inputs, warmup)
        for op in captured.ops:
            _measure_op(captured, op, run, None, params, grad_overhead_s)
        results = []
        total = len(captured.ops) + 1
        for i, op in enumerate(captured.ops):
            if progress:
                progress(i, total, op.name)
            measured = _measure_op(captured, op, run, timer, params, grad_overhead_s)
            assert measured is not None
            results.append(measured)
        if progress:
            progress(total - 1, total, "whole model")
        output, grads_out = _probe(module, inputs)
        whole = _measure_whole(module, inputs, grads_out, timer)
        train_s = _measure_training(module, inputs, grads_out, timer)
        update_s = _measure_update(module, timer)
        loss = _measure_loss(inputs, output, timer)
        if progress:
            progress(total, total, "done")
    summed = WholeModel(whole[0], whole[1], sum(r.fwd_s for r in results), sum(r.bwd_s for r in results), train_s,
                        update_s, sum(_nbytes(p) for p in module.parameters() if p.requires_grad), loss)
    return Measurement(tuple(results), summed, timer.overhead_s, grad_overhead_s, used, timer.clock, allocator)


@dataclass
class _Run:
    interpreter: fx.Interpreter
    env: dict[fx.Node, Any]
    saved: dict[str, int]


def _record(captured: Captured, module: nn.Module, inputs: Sequence[Any]) -> _Run:
    """Run the graph once with gradients on, keeping every value and attributing saved tensors to nodes."""
    skip = {_storage_key(t) for t in list(module.parameters()) + list(module.buffers())}
    seen: set[int] = set()
    saved: dict[str, int] = defaultdict(int)
    interpreter = fx.Interpreter(captured.graph_module, garbage_collect_values=False)
    current = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key and key not in skip and key not in seen:
            seen.add(key)
            saved[current[0]] += t.untyped_storage().nbytes()
        return t

    original = interpreter.run_node

    def run_node(node: fx.Node) -> Any:
        current[0] = node.name
        return original(node)

    interpreter.run_node = run_node  # type: ignore[method-assign]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        interpreter.run(*captured.graph_args(module, inputs))
    return _Run(interpreter, interpreter.env, dict(saved))


def _warm_whole(module: nn.Module, inputs: Sequence[Any], steps: int) -> None:
    """A few whole training micro-batches (forward and backward), gradients dropped afterwards."""
    for _ in range(max(steps, 1)):
        outputs = _differentiable(module(*inputs))
        if outputs:
            torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
    module.zero_grad(set_to_none=True)


def _measure_op(captured: Captured, op: CapturedOp, run: _Run, timer: Timer | None, param_ids: set[int],
                grad_overhead_s: float) -> OpMeasurement | None:
    """Time ``op`` forward and backward (``timer=None``: run each once, untimed, to warm it; returns None)."""
    value = run.env[op.node]
    out_bytes = _nbytes(value)
    dtype = _dtype(value)
    saved = run.saved.get(op.name, 0)
    if op.node.op == "placeholder":
        return OpMeasurement(op.name, 0.0, 0.0, out_bytes, saved, 0, 0, 0, "input", dtype, False)
    args, kwargs = run.interpreter.fetch_args_kwargs_from_env(op.node)
    target = captured.call_target(op.node)
    module_params = list(target.parameters()) if isinstance(target, nn.Module) else []
    mutable = _is_mutable(op)
    in_bytes = sum(_nbytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    in_bytes += sum(_nbytes(p) for p in module_params)
    cls = "view" if not mutable and _aliases(value, (args, kwargs), module_params) else classify(op.op)
    moved = 0 if cls == "view" else in_bytes + out_bytes
    leaves_args, leaves_kwargs = tree_map(lambda x: _leaf(x, param_ids), (args, kwargs))
    grad_inputs = [t for t in tree_leaves((leaves_args, leaves_kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad]
    grad_inputs += [p for p in module_params if p.requires_grad]
    grad_inputs = list({id(t): t for t in grad_inputs}.values())

    def fresh() -> tuple[Any, Any]:
        if not mutable:
            return leaves_args, leaves_kwargs
        return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, (leaves_args, leaves_kwargs))

    def forward(state: tuple[Any, Any]) -> Any:
        return target(*state[0], **state[1])

    if timer is None:
        try:
            outs = _differentiable(forward(fresh()))
            if outs and grad_inputs:
                torch.autograd.grad(outs, grad_inputs, [torch.randn_like(t) for t in outs], allow_unused=True)
        except Exception:  # timed (and reported) below
            pass
        return None
    try:
        kept = _Keeper()  # outputs stay alive across repeats, as activations do in training, so each
        fwd_s = timer.time(lambda state: kept.add(forward(state)), fresh)  # call allocates fresh memory
        kept.clear()
        flops = _count(lambda: forward(fresh()))
        bwd_s, bwd_flops, has_grad = _time_backward(forward, fresh, grad_inputs, timer)
        bwd_s = max(0.0, bwd_s - grad_overhead_s) if has_grad else 0.0
    except Exception as exc:  # an op that cannot run alone: keep going, report it
        log.warning("could not time %s (%s): %s", op.name, op.op, exc)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        return OpMeasurement(op.name, 0.0, 0.0, out_bytes, saved, moved, 0, 0, cls, dtype, bool(grad_inputs), error)
    return OpMeasurement(op.name, fwd_s, bwd_s, out_bytes, saved, moved, flops, bwd_flops, cls, dtype, has_grad)


def _time_backward(forward: Callable[[Any], Any], fresh: Callable[[], Any], grad_inputs: list[torch.Tensor],
                   timer: Timer) -> tuple[float, int, bool]:
    """Median time and FLOPs of ``autograd.grad`` from the op's outputs to ``grad_inputs``."""
    if not grad_inputs:
        return 0.0, 0, False
    probe = _differentiable(forward(fresh()))
    if not probe:
        return 0.0, 0, False
    grads_out = [torch.randn_like(t) for t in probe]

    def setup() -> list[torch.Tensor]:
        return _differentiable(forward(fresh()))

    def backward(outs: list[torch.Tensor]) -> Any:
        return torch.autograd.grad(outs, grad_inputs, grads_out, allow_unused=True)

    kept = _Keeper()  # gradients stay alive across repeats, as parameter gradients do in training
    bwd_s = timer.time(lambda outs: kept.add(backward(outs)), setup)
    kept.clear()
    outs = setup()
    bwd_flops = _count(lambda: backward(outs))
    return bwd_s, bwd_flops, True


class _Keeper:
    """Holds the results of timed calls alive, up to ``limit_bytes`` (the oldest are dropped beyond it),
    so that big models do not run out of memory while their repeats keep outputs alive."""

    def __init__(self, limit_bytes: int = 1 << 30) -> None:
        self.limit_bytes = limit_bytes
        self.items: list[tuple[Any, int]] = []

    def add(self, value: Any) -> None:
        self.items.append((value, _nbytes(value)))
        while len(self.items) > 1 and sum(n for _, n in self.items) > self.limit_bytes:
            self.items.pop(0)

    def clear(self) -> None:
        self.items.clear()


def _grad_call_overhead(timer: Timer, device: torch.device) -> float:
    """Median time of ``autograd.grad`` through a one-element view: the per-call engine start-up that a
    per-op backward pays once per op but the whole model's backward pays only once."""
    leaf = torch.zeros(1, device=device, requires_grad=True)
    grad = torch.ones(1, device=device)
    return timer.time(lambda out: torch.autograd.grad(out, leaf, grad), lambda: leaf.view(1))


def _probe(module: nn.Module, inputs: Sequence[Any]) -> tuple[Any, list[torch.Tensor]]:
    """One untimed forward of the whole model with gradients on: its output (detached, so the graph is
    freed) and random output gradients for its differentiable outputs (empty if none)."""
    with torch.enable_grad():
        output = module(*inputs)
    grads_out = [torch.randn_like(t) for t in _differentiable(output)]
    return tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, output), grads_out


def _measure_whole(module: nn.Module, inputs: Sequence[Any], grads_out: list[torch.Tensor],
                   timer: Timer) -> tuple[float, float]:
    """Forward and backward seconds of the whole model, timed like the ops (``grads_out`` from :func:`_probe`)."""
    params = [p for p in module.parameters() if p.requires_grad]
    with torch.enable_grad():
        fwd_s = timer.time(lambda _: module(*inputs))
        if not grads_out or not params:
            return fwd_s, 0.0
        bwd_s = timer.time(lambda outs: torch.autograd.grad(outs, params, grads_out, allow_unused=True),
                           lambda: _differentiable(module(*inputs)))
    return fwd_s, bwd_s


def time_training(module: nn.Module, inputs: Sequence[Any], device: torch.device, repeats: int, warmup: int,
                  threads: int | None) -> float:
    """One training micro-batch of the whole model, timed as ``measure`` times it (for ``--colocate``)."""
    with _num_threads(threads if device.type == "cpu" else None):
        timer = Timer(device, repeats, warmup)
        _, grads_out = _probe(module, inputs)
        return _measure_training(module, inputs, grads_out, timer)


def _measure_training(module: nn.Module, inputs: Sequence[Any], grads_out: list[torch.Tensor], timer: Timer) -> float:
    """Seconds of one training micro-batch: forward, then backward into the parameters' ``.grad``.

    Gradients accumulate across the repeats, as over the micro-batches of a step; the parameters'
    ``.grad`` are restored afterwards (the model is left as it was given)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params or not grads_out:
        return 0.0
    before = [p.grad for p in params]
    with torch.enable_grad():

        def step(_: Any) -> None:
            outs = _differentiable(module(*inputs))
            torch.autograd.backward(outs, grads_out[: len(outs)])

        try:
            return timer.time(step)
        finally:
            for p, grad in zip(params, before):
                p.grad = grad


UPDATE_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.0),
    "adam": lambda params: torch.optim.Adam(params, lr=0.0),
}
"""The optimizers ``plan run`` offers, built as it builds them (torch defaults) but with lr 0."""


def _measure_update(module: nn.Module, timer: Timer, microbatches: int = 8) -> dict[str, float]:
    """Seconds of one optimizer step over every trainable parameter, per optimizer, as ``plan run``
    takes it: gradients divided by the micro-batch count, then ``step()`` (lr 0: parameters unchanged).

    Gradients are random stand-ins and the optimizer state is made by the warm-up steps; the
    parameters' own ``.grad`` are restored afterwards."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return {}
    before = [p.grad for p in params]
    try:
        for p in params:
            p.grad = torch.randn_like(p)
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
    finally:
        for p, grad in zip(params, before):
            p.grad = grad


def _measure_loss(inputs: Sequence[Any], output: Any, timer: Timer) -> dict[str, Any]:
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
    return {"name": spec.loss, "fwd_s": fwd_s, "bwd_s": bwd_s, "output_bytes": _nbytes(output)}


def _cpu_sdpa_flops(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_flop_count(q, k, v))


def _cpu_sdpa_backward_flops(grad: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    return int(flop_counter.sdpa_backward_flop_count(grad, q, k, v))


EXTRA_FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward_flops,
}
"""FlopCounterMode has formulas for the CUDA attention kernels but not for the CPU flash-attention
kernel; we register the same formulas (torch's ``sdpa_flop_count``) for it."""


def _count(fn: Callable[[], Any]) -> int:
    with torch.enable_grad(), FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        fn()
    return int(counter.get_total_flops())


def _leaf(x: Any, param_ids: set[int]) -> Any:
    """A detached copy of ``x`` with the same ``requires_grad`` (parameters are passed through as they are)."""
    if not isinstance(x, torch.Tensor) or id(x) in param_ids:
        return x
    return x.detach().requires_grad_(bool(x.requires_grad and (x.is_floating_point() or x.is_complex())))


def _differentiable(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]


def _aliases(value: Any, inputs: Any, params: list[torch.Tensor]) -> bool:
    """True when the op produced no new tensor: every output shares storage with an input, or there is none."""
    outs = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    if not outs:
        return True
    sources = {_storage_key(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    sources |= {_storage_key(p) for p in params}
    return all(key != 0 and key in sources for key in map(_storage_key, outs))


def _is_mutable(op: CapturedOp) -> bool:
    target = op.node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    return isinstance(target, str) and target.endswith("_") and not target.endswith("__")


def _storage_key(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s storage, or 0 for a tensor without one (sparse, meta): unknown,
    so such a tensor is neither counted as saved nor taken for an alias of anything."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _dtype(value: Any) -> str:
    tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    pick = next((t for t in tensors if t.is_floating_point()), tensors[0] if tensors else None)
    return str(pick.dtype).replace("torch.", "") if pick is not None else ""


@contextlib.contextmanager
def _num_threads(threads: int | None) -> Iterator[int]:
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
