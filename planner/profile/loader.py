"""Resolve a model spec (``pkg.mod:factory`` or ``path/to/file.py:factory``) to a module and its inputs.

A factory returns an ``nn.Module`` or ``(module, example_inputs)``. When it returns only a module,
an input spec such as ``"int64[8,128]"`` or ``"float32[4,3,64,64],int64[4]"`` builds the inputs
(grammar in :func:`parse_input_spec`). ``microbatch_size`` rescales dimension 0 of every input
whose leading size equals the batch size of the first input.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from planner.errors import ModelError, UsageError

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "float64": torch.float64, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
    "int": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_ITEM = re.compile(r"\s*([a-z0-9]+)\[([0-9,\s]*)\](?:\s*<\s*([0-9]+))?\s*(?:,|$)")


@dataclass(frozen=True)
class InputSpec:
    """One tensor of an input spec: ``dtype[d0,d1,...]`` with an optional ``<HIGH`` bound for integers."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    high: int | None = None


def parse_input_spec(text: str) -> tuple[InputSpec, ...]:
    """Parse ``"int64[8,128]<50257,float32[8,3,32,32]"``: comma-separated ``dtype[shape]`` items.

    Integer tensors hold random values in ``[0, HIGH)``; without ``<HIGH`` the bound is chosen from
    the model (see :func:`make_inputs`). Floating tensors are standard normal; bool tensors random bits.
    """
    items, pos = [], 0
    text = text.strip()
    while pos < len(text):
        match = _ITEM.match(text, pos)
        if not match or match.end() == pos:
            raise UsageError(
                f"input spec {text!r} is malformed near {text[pos:pos + 20]!r}; expected comma-separated "
                f"dtype[shape] items such as 'int64[8,128]' or 'float32[4,3,64,64],int64[4]'"
            )
        name, dims, high = match.group(1), match.group(2), match.group(3)
        if name not in _DTYPES:
            raise UsageError(f"input spec {text!r}: unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPES))}")
        shape = tuple(int(d) for d in dims.replace(" ", "").split(",") if d)
        items.append(InputSpec(_DTYPES[name], shape, int(high) if high else None))
        pos = match.end()
    if not items:
        raise UsageError("input spec is empty; pass e.g. --input 'int64[8,128]'")
    return tuple(items)


def make_inputs(specs: Sequence[InputSpec], module: nn.Module, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Seeded tensors for ``specs``. Integer inputs default to ``[0, HIGH)`` where HIGH is the smallest
    ``num_embeddings`` of the model's ``nn.Embedding`` modules (every value is then a valid index), or 2."""
    generator = torch.Generator().manual_seed(seed)
    sizes = [m.num_embeddings for m in module.modules() if isinstance(m, nn.Embedding)]
    default_high = min(sizes) if sizes else 2
    out = []
    for spec in specs:
        if spec.dtype.is_floating_point:
            out.append(torch.randn(spec.shape, generator=generator).to(spec.dtype))
        elif spec.dtype == torch.bool:
            out.append(torch.randint(0, 2, spec.shape, generator=generator).bool())
        else:
            out.append(torch.randint(0, spec.high or default_high, spec.shape, generator=generator, dtype=spec.dtype))
    return tuple(out)


def call_factory(spec: str) -> tuple[nn.Module, tuple[Any, ...] | None]:
    """Import and call the factory named by ``spec``; return the module and its example inputs (or None)."""
    factory = _resolve(spec)
    try:
        result = factory()
    except Exception as exc:
        raise ModelError(f"factory {spec!r} raised {type(exc).__name__}: {_line(exc)}; fix the factory so it builds the model") from None
    if isinstance(result, nn.Module):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        inputs = result[1]
        return result[0], tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    raise ModelError(f"factory {spec!r} returned {type(result).__name__}; expected an nn.Module or (module, example_inputs)")


def load_factory(spec: str, input_spec: str | None = None, microbatch_size: int | None = None) -> tuple[nn.Module, tuple[Any, ...]]:
    """Resolve ``spec`` to ``(module, example_inputs)``; ``input_spec`` replaces or supplies the inputs."""
    module, inputs = call_factory(spec)
    if input_spec is not None:
        inputs = make_inputs(parse_input_spec(input_spec), module)
    if inputs is None:
        raise UsageError(
            f"factory {spec!r} returned a module without example inputs; describe them with --input, "
            f"e.g. --input 'int64[8,128]' or --input 'float32[4,3,64,64]'"
        )
    if microbatch_size is not None:
        inputs = rescale_batch(inputs, microbatch_size)
    return module, inputs


def batch_size(inputs: Sequence[Any]) -> int:
    """Leading dimension of the first tensor input (1 when there is none)."""
    first = next((x for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    return int(first.shape[0]) if first is not None else 1


def rescale_batch(inputs: Sequence[Any], size: int) -> tuple[Any, ...]:
    """Repeat or truncate dim 0 of every tensor whose leading size is the batch size, to ``size`` rows (new leaf
    tensors, each requiring grad as its original did: every training pass through them builds its own graph)."""
    if size < 1:
        raise UsageError(f"--microbatch-size must be a positive integer, found {size}")
    old = batch_size(inputs)
    rows = torch.arange(size) % old
    return tuple(x[rows].detach().requires_grad_(x.requires_grad)
                 if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == old else x for x in inputs)


def _resolve(spec: str) -> Any:
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise UsageError(f"model spec {spec!r} must be 'package.module:factory' or 'path/to/file.py:factory'")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _import_file(Path(target), spec)
    else:
        module = _import_module(target, spec)
    factory = getattr(module, name, None)
    if not callable(factory):
        known = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))[:12]
        raise ModelError(f"model spec {spec!r}: {target} has no callable {name!r} (callables there: {', '.join(known) or 'none'}); check the factory name")
    return factory


def _import_module(name: str, spec: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name and name.startswith(exc.name):
            raise ModelError(f"model spec {spec!r}: module {name!r} not found; check the spelling or install the package") from None
        raise ModelError(f"model spec {spec!r}: importing {name!r} failed, it needs missing module {exc.name!r}; install it") from None
    except Exception as exc:
        raise ModelError(f"model spec {spec!r}: importing {name!r} raised {type(exc).__name__}: {_line(exc)}") from None


def _import_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise ModelError(f"model spec {spec!r}: file {str(path)!r} not found; pass an existing .py file")
    mod_name = f"_planner_model_{abs(hash(str(path.resolve())))}"
    loader_spec = importlib.util.spec_from_file_location(mod_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ModelError(f"model spec {spec!r}: cannot import {str(path)!r} as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[mod_name] = module
    folder = str(path.resolve().parent)
    if folder not in sys.path:  # like `python file.py`: the file may import its sibling modules
        sys.path.append(folder)
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(mod_name, None)
        raise ModelError(f"model spec {spec!r}: importing {str(path)!r} raised {type(exc).__name__}: {_line(exc)}") from None
    return module


def _line(exc: BaseException) -> str:
    text = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return text[:240] or type(exc).__name__


def describe_output(value: Any) -> str:
    """What a forward returned, in words: ``one tensor``, ``a dict with keys 'logits', 'loss'``, ``a tuple of 2``."""
    if isinstance(value, torch.Tensor):
        return "one tensor"
    if isinstance(value, dict):
        return f"a {type(value).__name__} with keys {', '.join(repr(str(k)) for k in value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def pick_output(value: Any, selector: str) -> Any:
    """``value[selector]``: a dict's key, or an index (``0``, ``-1``) of a tuple or list; ``ModelError`` otherwise."""
    try:
        if isinstance(value, dict):
            return value[selector]
        if isinstance(value, (tuple, list)):
            return value[int(selector)]
    except (KeyError, IndexError, ValueError):
        pass
    choices = (f"one of {', '.join(map(str, value))}" if isinstance(value, dict)
               else f"an index below {len(value)}" if isinstance(value, (tuple, list)) else "no selection")
    raise ModelError(f"--model-output {selector!r} does not select an output: the model returns "
                     f"{describe_output(value)}; pass {choices}")


def select_output(module: nn.Module, selector: str | None) -> nn.Module:
    """The module, trained on one output (``--model-output KEY|INDEX``) of a forward that returns a dict, tuple or
    list. The module's class is swapped for a subclass whose forward picks that output, so parameter names (and
    so the profile's node and parameter names) stay those of the model."""
    if selector is None:
        return module
    base = type(module)

    @functools.wraps(base.forward)  # tracers read the arguments from the wrapped forward
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return pick_output(base.forward(self, *args, **kwargs), selector)

    module.__class__ = type(base.__name__, (base,), {"forward": forward, "__module__": base.__module__,
                                                     "__qualname__": base.__qualname__})
    return module

