"""Training data for ``plan run``: seeded synthetic batches shaped like the example inputs, or ``--data``.

The batch of step ``s`` is a pure function of ``(seed, s)``: every rank, every run and the single-process
reference draw the same tensors, and a run resumed at step ``s`` sees the data it would have seen.

Default objective (documented in docs/run.md):

* **language model** -- the output is ``(..., vocab)`` logits and some integer input has the shape of
  the output without its last dimension (token ids): cross-entropy against the ids shifted left by
  one (next-token prediction); the last position's target is a seeded random id;
* **otherwise** -- mean-squared error against a seeded standard-normal target shaped like the output.

``--data pkg.mod:factory`` replaces the synthetic batches: ``factory(seed=..., step=..., batch_size=...)``
returns ``(inputs, target)`` -- a tensor or tuple of tensors, and a tensor (``None`` for the default
target above). It must be deterministic in its arguments, since every rank calls it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from planner.errors import ModelError, UsageError

__all__ = ["TensorSpec", "DataSpec", "data_spec", "make_batch", "load_data_factory", "loss_fn"]

LM_CROSS_ENTROPY = "lm-cross-entropy"
MSE = "mse"


@dataclass(frozen=True)
class TensorSpec:
    """Shape (per micro-batch), dtype and, for integer tensors, the value range ``[low, high)``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    low: int = 0
    high: int = 2


@dataclass(frozen=True)
class DataSpec:
    """What one micro-batch looks like, and the default objective."""

    inputs: tuple[TensorSpec, ...]
    output: TensorSpec
    loss: str
    """``lm-cross-entropy`` or ``mse``."""
    token_input: int = -1
    """Index of the token-id input the LM targets are shifted from (``lm-cross-entropy`` only)."""


def data_spec(example_inputs: Sequence[Any], example_output: Any) -> DataSpec:
    """Describe the micro-batch from example inputs and the model's output on them."""
    if not isinstance(example_output, torch.Tensor):
        raise ModelError(f"plan run needs a model that returns one tensor, found {type(example_output).__name__}; "
                         f"wrap the model so forward returns the logits or prediction tensor")
    inputs = []
    for x in example_inputs:
        if not isinstance(x, torch.Tensor):
            raise ModelError(f"plan run needs tensor inputs, found {type(x).__name__}; pass tensors from the factory")
        if x.is_floating_point() or x.numel() == 0:
            inputs.append(TensorSpec(tuple(x.shape), x.dtype))
        else:
            inputs.append(TensorSpec(tuple(x.shape), x.dtype, int(x.min()), int(x.max()) + 1))
    out = TensorSpec(tuple(example_output.shape), example_output.dtype)
    if example_output.is_floating_point() and example_output.dim() >= 2:
        for i, spec in enumerate(inputs):
            if not spec.dtype.is_floating_point and spec.shape == out.shape[:-1]:
                return DataSpec(tuple(inputs), out, LM_CROSS_ENTROPY, i)
    return DataSpec(tuple(inputs), out, MSE)


def make_batch(spec: DataSpec, seed: int, step: int, batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The synthetic ``(inputs, target)`` of ``step``: a pure function of ``(seed, step)`` (on CPU)."""
    gen = torch.Generator().manual_seed(_stream(seed, step))
    inputs = tuple(_draw(s, batch_size, gen) for s in spec.inputs)
    return inputs, default_target(spec, inputs, gen)


def default_target(spec: DataSpec, inputs: Sequence[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """Next-token ids for a language model, a standard-normal tensor shaped like the output otherwise."""
    batch = inputs[0].shape[0] if inputs else 1
    if spec.loss == LM_CROSS_ENTROPY:
        ids = inputs[spec.token_input]
        last = torch.randint(0, spec.output.shape[-1], (*ids.shape[:-1], 1), generator=gen, dtype=ids.dtype)
        return torch.cat([ids[..., 1:], last], dim=-1)
    return torch.randn((batch, *spec.output.shape[1:]), generator=gen, dtype=spec.output.dtype)


def loss_fn(spec: DataSpec) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The default objective's loss for one micro-batch (mean-reduced)."""
    if spec.loss == LM_CROSS_ENTROPY:
        return _lm_cross_entropy
    return F.mse_loss


def load_data_factory(spec: str) -> Callable[..., Any]:
    """Import ``pkg.mod:factory`` or ``path/to/file.py:factory`` for ``--data``."""
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"--data must look like pkg.mod:factory or file.py:factory, found {spec!r}")
    try:
        module = _import_file(target) if target.endswith(".py") else importlib.import_module(target)
    except (ImportError, OSError) as exc:
        raise UsageError(f"--data {spec!r}: cannot import {target!r} ({exc}); check the module path") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UsageError(f"--data {spec!r}: {target} has no callable {attr!r}; name a function")
    return factory


def _import_file(path: str) -> Any:
    name = f"_planner_data_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def custom_batch(factory: Callable[..., Any], spec: DataSpec, seed: int, step: int,
                 batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Call a ``--data`` factory and normalise its ``(inputs, target)``."""
    got = factory(seed=seed, step=step, batch_size=batch_size)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise UsageError(f"--data factory must return (inputs, target), found {type(got).__name__}")
    inputs, target = got
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if target is None:
        target = default_target(spec, inputs, torch.Generator().manual_seed(_stream(seed, step) + 1))
    return inputs, target


def _lm_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _stream(seed: int, step: int) -> int:
    """One random stream per (seed, step); 2**61-1 keeps the streams of nearby seeds apart."""
    return (seed * 1_000_003 + step) % (2**61 - 1)


def _draw(spec: TensorSpec, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    shape = (batch_size, *spec.shape[1:]) if spec.shape else ()
    if spec.dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=spec.dtype)
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(spec.low, max(spec.high, spec.low + 1), shape, generator=gen, dtype=spec.dtype)
