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
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from planner.errors import ModelError, UsageError

__all__ = ["TensorSpec", "DataSpec", "data_spec", "make_batch", "load_data_factory", "check_data_factory", "loss_fn",
           "task_spec", "takes_split", "load_loss", "has_accuracy"]

FACTORY_ARGS = ("seed", "step", "batch_size")
"""The keyword arguments a ``--data`` factory is called with."""

LM_CROSS_ENTROPY = "lm-cross-entropy"
MSE = "mse"
CROSS_ENTROPY = "cross-entropy"
"""Classification: a float output ``(batch, classes)`` and an integer target ``(batch,)``."""
CUSTOM = "custom"
"""``--loss pkg.mod:fn``."""
SPLITS = ("train", "val")


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
        from planner.profile.loader import describe_output

        raise ModelError(f"plan run trains on one tensor but the model returns {describe_output(example_output)}; "
                         f"profile it again with --model-output KEY|INDEX (the output to train on) and partition "
                         f"that profile, or wrap the model so forward returns one tensor")
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


def make_batch(spec: DataSpec, seed: int, step: int, batch_size: int,
               split: str = "train") -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The synthetic ``(inputs, target)`` of ``step``: a pure function of ``(seed, step)`` (on CPU); ``val``
    batches come from streams no training step uses."""
    gen = torch.Generator().manual_seed(_stream(seed, step) if split == "train" else _stream(seed + 7_919, -1 - step))
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


def loss_fn(spec: DataSpec, custom: Callable[..., Any] | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss for one micro-batch (mean-reduced): ``custom`` (``--loss``), else the task's."""
    if custom is not None:
        return custom
    if spec.loss == LM_CROSS_ENTROPY:
        return _lm_cross_entropy
    if spec.loss == CROSS_ENTROPY:
        return F.cross_entropy
    return F.mse_loss


def has_accuracy(spec: DataSpec) -> bool:
    """Whether evaluation reports accuracy (classification; next-token accuracy for language models)."""
    return spec.loss in (CROSS_ENTROPY, LM_CROSS_ENTROPY)


def task_spec(spec: DataSpec, target: torch.Tensor, custom_loss: bool = False) -> DataSpec:
    """The task as the data shows it: an integer target ``(batch,)`` for a ``(batch, classes)`` output is
    classification (cross-entropy, and accuracy in evaluation); ``--loss`` makes it ``custom``."""
    if custom_loss:
        return DataSpec(spec.inputs, spec.output, CUSTOM, spec.token_input)
    if spec.loss != LM_CROSS_ENTROPY and not target.dtype.is_floating_point and target.dim() == 1 \
            and len(spec.output.shape) == 2 and spec.output.dtype.is_floating_point:
        return DataSpec(spec.inputs, spec.output, CROSS_ENTROPY, spec.token_input)
    return spec


def takes_split(factory: Callable[..., Any]) -> bool:
    """Whether a ``--data`` factory serves held-out batches (has a ``split`` argument or ``**kwargs``)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return "split" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def load_loss(spec: str) -> Callable[..., Any]:
    """Import ``--loss pkg.mod:fn`` (``fn(output, target) -> scalar tensor``)."""
    return _load_callable(spec, "--loss", "fn")


def load_data_factory(spec: str) -> Callable[..., Any]:
    """Import ``pkg.mod:factory`` or ``path/to/file.py:factory`` for ``--data``."""
    return _load_callable(spec, "--data", "factory")


def _load_callable(spec: str, option: str, what: str) -> Callable[..., Any]:
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise UsageError(f"{option} must look like pkg.mod:{what} or file.py:{what}, found {spec!r}")
    try:
        module = _import_file(target) if target.endswith(".py") else importlib.import_module(target)
    except (ImportError, OSError) as exc:
        raise UsageError(f"{option} {spec!r}: cannot import {target!r} ({exc}); check the module path") from None
    found = getattr(module, attr, None)
    if not callable(found):
        raise UsageError(f"{option} {spec!r}: {target} has no callable {attr!r}; name a function")
    return found


def check_data_factory(factory: Callable[..., Any], name: str, spec: DataSpec, seed: int, batch_size: int,
                       microbatches: int) -> None:
    """Check a ``--data`` factory once, before any rank starts: that it takes ``seed``, ``step`` and
    ``batch_size`` by keyword, that one call (step 0) returns ``(inputs, target)``, and that those have the
    number, shapes and dtypes of the profiled inputs and the model's output. Raises ``UsageError``."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        signature = None
    if signature is not None:
        params = signature.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for arg in FACTORY_ARGS:
            param = params.get(arg)
            if (param is not None and param.kind is param.POSITIONAL_ONLY) or (param is None and not takes_any):
                raise UsageError(f"--data {name}: the factory must accept the keyword arguments "
                                 f"{', '.join(FACTORY_ARGS)}, but its signature is {name.rpartition(':')[2]}{signature}; "
                                 f"define it as def factory(seed, step, batch_size)")
        required = [p.name for p in params.values() if p.default is p.empty and p.name not in (*FACTORY_ARGS, "split")
                    and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if required:
            raise UsageError(f"--data {name}: the factory also requires {', '.join(required)}, but plan run passes "
                             f"only {', '.join(FACTORY_ARGS)}; give the others defaults")
    call = f"{name.rpartition(':')[2]}(seed={seed}, step=0, batch_size={batch_size})"
    try:
        inputs, target = custom_batch(factory, spec, seed, 0, batch_size)
    except UsageError as exc:
        raise UsageError(f"--data {name}: {call}: {exc}") from None
    except Exception as exc:
        line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:200]
        raise UsageError(f"--data {name}: {call} raised {type(exc).__name__}: {line}; "
                         f"fix the factory (it is called once per step on every rank)") from None
    where = f"--data {name}: {call} returned"
    if len(inputs) != len(spec.inputs) or not all(isinstance(x, torch.Tensor) for x in (*inputs, target)):
        raise UsageError(f"{where} {len(inputs)} input(s) and a {type(target).__name__} target; the model takes "
                         f"{len(spec.inputs)} tensor input(s) ({_shapes(spec.inputs, batch_size)}): return them as "
                         f"(inputs, target) with a tensor or None as target")
    rows = f"batch_size ({batch_size} = {microbatches} micro-batches x {batch_size // microbatches})"
    for i, (x, want) in enumerate(zip(inputs, spec.inputs)):
        shape = (batch_size, *want.shape[1:])
        if tuple(x.shape) != shape or x.dtype != want.dtype:
            raise UsageError(f"{where} input {i} as {_describe(x.dtype, tuple(x.shape))}; the profiled model takes "
                             f"{_describe(want.dtype, shape)} (dimension 0 is {rows}); return inputs of that shape "
                             f"and dtype, or profile the model with inputs like these")
    if spec.loss == LM_CROSS_ENTROPY:
        ids = inputs[spec.token_input]
        if tuple(target.shape) != tuple(ids.shape) or target.dtype.is_floating_point:
            raise UsageError(f"{where} a target of {_describe(target.dtype, tuple(target.shape))}; a language model "
                             f"trains on next-token ids of {_describe(ids.dtype, tuple(ids.shape))}; return those "
                             f"(or None for the inputs shifted left by one)")
    elif task_spec(spec, target).loss == CROSS_ENTROPY:
        return
    elif tuple(target.shape) != (batch_size, *spec.output.shape[1:]) or not target.dtype.is_floating_point:
        raise UsageError(f"{where} a target of {_describe(target.dtype, tuple(target.shape))}; the mean-squared "
                         f"error needs one shaped like the output, "
                         f"{_describe(spec.output.dtype, (batch_size, *spec.output.shape[1:]))} (or, for "
                         f"classification, integer labels {_describe(torch.int64, (batch_size,))})")


def _describe(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    return f"{str(dtype).replace('torch.', '')}{list(shape)}"


def _shapes(specs: Sequence[TensorSpec], batch_size: int) -> str:
    return ", ".join(_describe(s.dtype, (batch_size, *s.shape[1:])) for s in specs)


def _import_file(path: str) -> Any:
    name = f"_planner_data_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def custom_batch(factory: Callable[..., Any], spec: DataSpec, seed: int, step: int,
                 batch_size: int, split: str = "train") -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Call a ``--data`` factory and normalise its ``(inputs, target)`` (``split`` is passed only for held-out
    batches, so factories without it keep working for training)."""
    extra = {} if split == "train" else {"split": split}
    got = factory(seed=seed, step=step, batch_size=batch_size, **extra)
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
