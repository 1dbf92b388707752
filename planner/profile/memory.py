"""What the values of one recorded run take in memory (``planner.profile.measure``, step 1).

``record`` runs the captured graph once with gradients on and attributes every tensor autograd saves for
backward to the node that saved it first (``torch.autograd.graph.saved_tensors_hooks``; each storage counted
once; parameters and buffers excluded): the profile's ``saved_bytes``, which the cost model multiplies by the
micro-batches in flight. ``nbytes``, ``storage_key`` and ``aliases`` say what a value takes and whether an op
made a new tensor at all (a view moves no bytes).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.utils._pytree import tree_leaves

from planner.profile.capture import Captured

__all__ = ["Run", "record", "storage_key", "nbytes", "dtype_of", "aliases", "differentiable"]


@dataclass
class Run:
    interpreter: fx.Interpreter
    env: dict[fx.Node, Any]
    saved: dict[str, int]


def record(captured: Captured, module: nn.Module, inputs: Sequence[Any]) -> Run:
    """Run the graph once with gradients on, keeping every value and attributing saved tensors to nodes."""
    skip = {storage_key(t) for t in list(module.parameters()) + list(module.buffers())}
    seen: set[int] = set()
    saved: dict[str, int] = defaultdict(int)
    interpreter = fx.Interpreter(captured.graph_module, garbage_collect_values=False)
    current = [""]

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
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
    return Run(interpreter, interpreter.env, dict(saved))


def storage_key(t: torch.Tensor) -> int:
    """The data pointer of ``t``'s storage, or 0 for a tensor without one (sparse, meta): unknown,
    so such a tensor is neither counted as saved nor taken for an alias of anything."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


def nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def dtype_of(value: Any) -> str:
    tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    pick = next((t for t in tensors if t.is_floating_point()), tensors[0] if tensors else None)
    return str(pick.dtype).replace("torch.", "") if pick is not None else ""


def aliases(value: Any, inputs: Any, params: list[torch.Tensor]) -> bool:
    """True when the op produced no new tensor: every output shares storage with an input, or there is none."""
    outs = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    if not outs:
        return True
    sources = {storage_key(t) for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    sources |= {storage_key(p) for p in params}
    return all(key != 0 and key in sources for key in map(storage_key, outs))


def differentiable(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]
