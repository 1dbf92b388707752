"""Timing one op alone (``planner.profile.measure``, step 2): forward and backward, FLOPs, op class.

Forward time is the median of calling the op's target on detached copies of its real inputs (same
``requires_grad`` as in the model, live parameters), timer overhead removed. Backward time is the median of
``torch.autograd.grad`` from the op's outputs to the inputs and parameters that require grad, after an
untimed forward, less the fixed cost of one ``autograd.grad`` call (``grad_call_overhead``). An op that has both
parameters and inputs that need gradients also times the two halves alone (the input gradient ``I`` and the weight
gradient ``W`` that zero-bubble schedules run apart) and splits its backward in their ratio; an op without
parameters is all ``I``, one whose only gradients are its parameters' all ``W``. Outputs and
gradients stay alive across repeats, as activations and gradients do in training. FLOPs come from
``FlopCounterMode`` around one extra call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

from planner.profile.capture import Captured, CapturedOp
from planner.profile.memory import Run, aliases, differentiable, dtype_of, nbytes
from planner.profile.timer import Timer
from planner.roofline import classify

__all__ = ["OpMeasurement", "measure_op", "grad_call_overhead", "count_flops", "EXTRA_FLOP_FORMULAS"]

log = logging.getLogger(__name__)


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
    bwd_weight_s: float = 0.0
    """The weight-gradient part of ``bwd_s`` (module docstring)."""
    split_s: tuple[float, float] | None = None
    """The input-gradient and weight-gradient halves as timed alone, where both exist (their sum is close to the
    whole backward's time but not equal: each call pays the engine's start-up)."""


def measure_op(captured: Captured, op: CapturedOp, run: Run, timer: Timer | None, param_ids: set[int],
                grad_overhead_s: float) -> OpMeasurement | None:
    """Time ``op`` forward and backward (``timer=None``: run each once, untimed, to warm it; returns None)."""
    value = run.env[op.node]
    out_bytes = nbytes(value)
    dtype = dtype_of(value)
    saved = run.saved.get(op.name, 0)
    if op.node.op == "placeholder":
        return OpMeasurement(op.name, 0.0, 0.0, out_bytes, saved, 0, 0, 0, "input", dtype, False)
    args, kwargs = run.interpreter.fetch_args_kwargs_from_env(op.node)
    target = captured.call_target(op.node)
    module_params = list(target.parameters()) if isinstance(target, nn.Module) else []
    mutable = _is_mutable(op)
    in_bytes = sum(nbytes(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    in_bytes += sum(nbytes(p) for p in module_params)
    cls = "view" if not mutable and aliases(value, (args, kwargs), module_params) else classify(op.op)
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
            outs = differentiable(forward(fresh()))
            if outs and grad_inputs:
                torch.autograd.grad(outs, grad_inputs, [torch.randn_like(t) for t in outs], allow_unused=True)
        except Exception:  # timed (and reported) below
            pass
        return None
    try:
        kept = _Keeper()  # outputs stay alive across repeats, as activations do in training, so each
        fwd_s = timer.time(lambda state: kept.add(forward(state)), fresh)  # call allocates fresh memory
        kept.clear()
        flops = count_flops(lambda: forward(fresh()))
        bwd_s, bwd_flops, has_grad = _time_backward(forward, fresh, grad_inputs, timer)
        bwd_s = max(0.0, bwd_s - grad_overhead_s) if has_grad else 0.0
        weights = [t for t in grad_inputs if id(t) in param_ids or any(t is p for p in module_params)]
        split = None
        if not has_grad or not weights:
            weight_s = 0.0
        elif len(weights) == len(grad_inputs):
            weight_s = bwd_s
        else:
            inputs = [t for t in grad_inputs if not any(t is w for w in weights)]
            split = tuple(max(0.0, _time_backward(forward, fresh, part, timer)[0] - grad_overhead_s)
                          for part in (inputs, weights))
            total = split[0] + split[1]
            weight_s = bwd_s * (split[1] / total if total > 0 else 0.5)
    except Exception as exc:  # an op that cannot run alone: keep going, report it
        log.warning("could not time %s (%s): %s", op.name, op.op, exc)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        return OpMeasurement(op.name, 0.0, 0.0, out_bytes, saved, moved, 0, 0, cls, dtype, bool(grad_inputs), error)
    return OpMeasurement(op.name, fwd_s, bwd_s, out_bytes, saved, moved, flops, bwd_flops, cls, dtype, has_grad,
                         bwd_weight_s=weight_s, split_s=split)


def _time_backward(forward: Callable[[Any], Any], fresh: Callable[[], Any], grad_inputs: list[torch.Tensor],
                   timer: Timer) -> tuple[float, int, bool]:
    """Median time and FLOPs of ``autograd.grad`` from the op's outputs to ``grad_inputs``."""
    if not grad_inputs:
        return 0.0, 0, False
    probe = differentiable(forward(fresh()))
    if not probe:
        return 0.0, 0, False
    grads_out = [torch.randn_like(t) for t in probe]

    def setup() -> list[torch.Tensor]:
        return differentiable(forward(fresh()))

    def backward(outs: list[torch.Tensor]) -> Any:
        return torch.autograd.grad(outs, grad_inputs, grads_out, allow_unused=True)

    kept = _Keeper()  # gradients stay alive across repeats, as parameter gradients do in training
    bwd_s = timer.time(lambda outs: kept.add(backward(outs)), setup)
    kept.clear()
    outs = setup()
    bwd_flops = count_flops(lambda: backward(outs))
    return bwd_s, bwd_flops, True


class _Keeper:
    """Holds the results of timed calls alive, up to ``limit_bytes`` (the oldest are dropped beyond it),
    so that big models do not run out of memory while their repeats keep outputs alive."""

    def __init__(self, limit_bytes: int = 1 << 30) -> None:
        self.limit_bytes = limit_bytes
        self.items: list[tuple[Any, int]] = []

    def add(self, value: Any) -> None:
        self.items.append((value, nbytes(value)))
        while len(self.items) > 1 and sum(n for _, n in self.items) > self.limit_bytes:
            self.items.pop(0)

    def clear(self) -> None:
        self.items.clear()


def grad_call_overhead(timer: Timer, device: torch.device) -> float:
    """Median time of ``autograd.grad`` through a one-element view: the per-call engine start-up that a
    per-op backward pays once per op but the whole model's backward pays only once."""
    leaf = torch.zeros(1, device=device, requires_grad=True)
    grad = torch.ones(1, device=device)
    return timer.time(lambda out: torch.autograd.grad(out, leaf, grad), lambda: leaf.view(1))


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


def count_flops(fn: Callable[[], Any]) -> int:
    with torch.enable_grad(), FlopCounterMode(display=False, custom_mapping=EXTRA_FLOP_FORMULAS) as counter:
        fn()
    return int(counter.get_total_flops())


def _leaf(x: Any, param_ids: set[int]) -> Any:
    """A detached copy of ``x`` with the same ``requires_grad`` (parameters are passed through as they are)."""
    if not isinstance(x, torch.Tensor) or id(x) in param_ids:
        return x
    return x.detach().requires_grad_(bool(x.requires_grad and (x.is_floating_point() or x.is_complex())))


def _is_mutable(op: CapturedOp) -> bool:
    target = op.node.target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    return isinstance(target, str) and target.endswith("_") and not target.endswith("__")
