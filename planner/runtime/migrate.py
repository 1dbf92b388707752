"""Move the parameters and optimizer state of ops that changed owner, directly between ranks.

After a re-plan (the rebalancing patent's S5) each rank knows which named tensors (parameters and buffers, by their
canonical names, see ``graph_split.canonical_param_names``) it owned under the old plan and which it
owns under the new one. Every rank builds the full model, so the tensor objects exist everywhere,
but only an owner's values are current. A tensor a rank newly owns is sent to it by one rank that
owned it before (the lowest such rank), together with its optimizer state, as one pickled bundle
per (sender, receiver) pair over point-to-point ``send_object_list`` / ``recv_object_list``. Every
rank walks the pairs in the same sorted order, so each blocked rank waits on a partner that is
working on an earlier pair: no cycle, no deadlock. Nothing goes through rank 0 or a file.

The runtime then rebuilds the stages and optimizers for the new plan, loads the returned state and
continues from the same step; the batch of step ``s`` depends only on (seed, s), so the data order
is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from planner.errors import DistributedError

__all__ = ["Transfer", "MigrationReport", "plan_transfers", "migrate", "optimizer_state_by_name",
           "load_optimizer_state", "clone_state"]


@dataclass(frozen=True)
class Transfer:
    """Tensors ``names`` go from rank ``src`` to rank ``dst``."""

    src: int
    dst: int
    names: tuple[str, ...]


@dataclass(frozen=True)
class MigrationReport:
    transfers: tuple[Transfer, ...]
    sent_bytes: int
    """Bytes this rank sent (tensor payloads: values and optimizer state)."""
    received_bytes: int

    @property
    def moved(self) -> int:
        return sum(len(t.names) for t in self.transfers)


def plan_transfers(owned_before: Sequence[Iterable[str]], owned_after: Sequence[Iterable[str]]) -> tuple[Transfer, ...]:
    """Pure: which rank sends which names to which, given every rank's ownership before and after.

    A name a rank owns after but not before comes from the lowest rank that owned it before. A name
    nobody owned before is an error (the plans cover different models).
    """
    holders: dict[str, int] = {}
    for rank, names in enumerate(owned_before):
        for name in names:
            holders.setdefault(name, rank)
    pairs: dict[tuple[int, int], list[str]] = {}
    for rank, names in enumerate(owned_after):
        before = set(owned_before[rank]) if rank < len(owned_before) else set()
        for name in sorted(set(names) - before):
            if name not in holders:
                raise DistributedError(
                    f"rank {rank} needs {name!r} under the new plan but no rank held it under the old one; "
                    f"the two plans are for different models: restart from a checkpoint of this model")
            pairs.setdefault((holders[name], rank), []).append(name)
    return tuple(Transfer(src, dst, tuple(names)) for (src, dst), names in sorted(pairs.items()))


def migrate(rank: int, tensors: Mapping[str, torch.Tensor], owned_before: Iterable[str], owned_after: Iterable[str],
            opt_state: Mapping[str, Mapping[str, Any]], group: Any = None) -> tuple[dict[str, dict[str, Any]], MigrationReport]:
    """Collective over ``group``: exchange tensors that changed owner; return the new optimizer state.

    ``tensors``: canonical name -> this rank's live tensor (parameters and buffers; received values
    are copied into them in place). ``opt_state``: canonical name -> optimizer state of a tensor this
    rank owned before. Returns the optimizer state, by name, of every tensor this rank owns after.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    before, after = sorted(set(owned_before)), sorted(set(owned_after))
    everyone_before: list[Any] = [None] * world
    everyone_after: list[Any] = [None] * world
    dist.all_gather_object(everyone_before, before, group=group)
    dist.all_gather_object(everyone_after, after, group=group)
    transfers = plan_transfers(everyone_before, everyone_after)
    new_state = {name: dict(opt_state[name]) for name in after if name in before and name in opt_state}
    sent = received = 0
    for t in transfers:
        if t.src == rank:
            bundle = {name: {"value": tensors[name].detach().clone(), "state": clone_state(opt_state.get(name, {}))}
                      for name in t.names}
            sent += _payload_bytes(bundle)
            dist.send_object_list([bundle], dst=_global(t.dst, group), group=group)
        elif t.dst == rank:
            box: list[Any] = [None]
            dist.recv_object_list(box, src=_global(t.src, group), group=group)
            bundle = box[0]
            received += _payload_bytes(bundle)
            for name in t.names:
                with torch.no_grad():
                    tensors[name].copy_(bundle[name]["value"])
                if bundle[name]["state"]:
                    new_state[name] = bundle[name]["state"]
    return new_state, MigrationReport(transfers, sent, received)


def optimizer_state_by_name(optimizers: Sequence[torch.optim.Optimizer], name_of: Mapping[int, str]) -> dict[str, dict[str, Any]]:
    """Optimizer state keyed by canonical name instead of parameter object (``name_of``: id(param) -> name)."""
    out: dict[str, dict[str, Any]] = {}
    for opt in optimizers:
        for param, state in opt.state.items():
            if state and id(param) in name_of:
                out[name_of[id(param)]] = dict(state)
    return out


def load_optimizer_state(optimizers: Sequence[torch.optim.Optimizer], state_by_name: Mapping[str, Mapping[str, Any]],
                         name_of: Mapping[int, str]) -> int:
    """Put per-name state into freshly built optimizers; returns how many parameters received state."""
    loaded = 0
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                state = state_by_name.get(name_of.get(id(param), ""))
                if state:
                    opt.state[param] = clone_state(state)
                    loaded += 1
    return loaded


def clone_state(state: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _payload_bytes(bundle: Mapping[str, Mapping[str, Any]]) -> int:
    total = 0
    for entry in bundle.values():
        total += entry["value"].numel() * entry["value"].element_size()
        for v in entry["state"].values():
            if isinstance(v, torch.Tensor):
                total += v.numel() * v.element_size()
    return total


def _global(rank: int, group: Any) -> int:
    if group is None:
        return rank
    import torch.distributed as dist

    return dist.get_global_rank(group, rank)
