"""Profiles kept by what they measured, so ``plan train`` profiles a model once.

The key is a SHA-256 over everything that changes a profile's numbers or its graph:

- the **model**: its factory spec, every parameter's and buffer's name, shape and dtype, the module tree as
  ``repr`` prints it (layer sizes, dropout rates), and the source of every module class it is built from (a
  changed ``forward`` changes the graph without changing a shape);
- the **example inputs**' shapes and dtypes (after ``--microbatch-size``);
- the **tracer**, the **device type** it was measured on, the co-located ranks (``--colocate``), the repeats and
  warm-up, the device types it estimates, the torch version, and ``MEASUREMENT_VERSION`` (what the profiler
  measures per op).

A source file that cannot be read (a class defined in a notebook) counts by its qualified name only, so an edit
there is not seen: ``--reprofile`` measures again. The cache lives in ``$PLANNER_CACHE_DIR`` (default
``~/.cache/planner``), under ``profiles/<key>.json``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["cache_dir", "profile_key", "cached_profile_path", "MEASUREMENT_VERSION"]

MEASUREMENT_VERSION = 6
"""What ``plan profile`` measures, in the key: a profile cached before a change of it is measured again (2: the
backward split into its input and weight gradients, docs/zero-bubble.md; 3: the whole model's weight-version
bookkeeping and its split backward's excess, ``whole_model.version_s`` and ``split_backward``; 4: the optimizer
step's cost per parameter tensor, ``whole_model.update_tensor_s``; 5: a micro-batch of twice the rows,
``whole_model.rows_scaling``; 6: the co-location factor against lone times on either side,
``whole_model.colocation.alone_s``)."""


def cache_dir(override: str | Path | None = None) -> Path:
    """Where cached profiles live: ``override``, else ``$PLANNER_CACHE_DIR``, else ``~/.cache/planner``."""
    if override is not None:
        return Path(override)
    env = os.environ.get("PLANNER_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "planner"


def profile_key(spec: str, *, input_spec: str | None, microbatch_size: int | None, tracer: str, colocate: int,
                repeats: int, warmup: int, estimate: Sequence[str], model_output: str | None) -> tuple[str, dict[str, Any]]:
    """The cache key of profiling ``spec`` with these options on this machine's device, and what went into it
    (the model is built once, on the CPU, to read its parameters and classes)."""
    import torch

    from planner.profile.device import detect_device_type
    from planner.profile.loader import load_factory

    module, inputs = load_factory(spec, input_spec, microbatch_size)
    tensors = [(name, list(t.shape), str(t.dtype)) for name, t in
               [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]]
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}": type(m) for m in module.modules()}.items())
    described = {
        "spec": spec, "tensors": tensors, "tree": repr(module),
        "classes": {name: _source_hash(cls) for name, cls in classes},
        "inputs": [[list(x.shape), str(x.dtype)] if isinstance(x, torch.Tensor) else repr(x) for x in inputs],
        "tracer": tracer, "device_type": detect_device_type(), "colocate": colocate, "repeats": repeats,
        "warmup": warmup, "estimate": sorted(estimate), "model_output": model_output, "torch": torch.__version__,
        "measurement": MEASUREMENT_VERSION,
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest(), described


def cached_profile_path(key: str, directory: Path) -> Path:
    """The file a profile with ``key`` is kept in."""
    return directory / "profiles" / f"{key[:32]}.json"


def _source_hash(cls: type) -> str:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return cls.__qualname__
    return hashlib.sha256(source.encode("utf-8")).hexdigest()[:16]
