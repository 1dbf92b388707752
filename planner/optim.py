"""The optimizers ``plan run`` trains with, built in one place for the runtime and for the profile that times them.

``torch.optim`` picks its multi-tensor (foreach) or fused implementation by itself only for CUDA tensors; on CPU it
falls back to a loop over the tensors. Adam is built fused where torch has a fused kernel for every parameter's
device (CPU and CUDA): on one CPU thread a step over ``gpt_small``'s 22 MiB of parameters took 5 ms fused against
18 ms foreach and 22 ms looped (torch 2.13, this 2-core machine, 2026-11-28), and its parameters after 20 steps
differed from foreach's by 1e-7. SGD gains nothing from the fused kernel on CPU (2.1 ms either way), so it stays
foreach. ``plan profile`` times the optimizer built here (``planner.profile.whole_model.measure_update``), so the
cost model charges the step the runs take.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["OPTIMIZERS", "build_optimizer"]

OPTIMIZERS = ("sgd", "adam")
FUSED_DEVICES = ("cpu", "cuda")
"""Device types whose fused Adam kernel torch ships in every build this project supports."""


def build_optimizer(name: str, params: Iterable[torch.Tensor | tuple[str, torch.Tensor]],
                    lr: float) -> torch.optim.Optimizer:
    """``sgd`` or ``adam`` (torch defaults besides the learning rate) over ``params`` (tensors, or (name, tensor)
    pairs, whose names the state dict then carries); Adam fused where every parameter's device has the kernel,
    else foreach. ``ValueError`` for another name (callers check it against ``OPTIMIZERS`` first)."""
    params = list(params)
    tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    if name == "adam":
        if tensors and all(t.device.type in FUSED_DEVICES and t.is_floating_point() for t in tensors):
            return torch.optim.Adam(params, lr=lr, fused=True)
        return torch.optim.Adam(params, lr=lr, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=True)
    raise ValueError(f"no optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")
