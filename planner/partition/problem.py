"""The partitioning problem that every placer solves, built once from a profile and a cluster.

A plan is a sequence of stages, each a *contiguous* run of the profile's nodes in their
topological order, each on one device. Contiguity in that order is what
``torch.distributed.pipelining`` can execute (it cuts the exported graph between nodes), and it
makes every edge run forwards by construction. Placers therefore choose cut points between
*blocks* (contiguous node runs; one node per block at op granularity) and a device per stage.

Values that skip stages are routed through the stages in between (design.md section 8), so the
bytes crossing the cut after block ``b`` are those of every value produced at or before ``b``
and read after it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from planner.errors import PlannerError
from planner.formats.cluster import Cluster
from planner.formats.profile import INPUT_OP, Profile

OPTIMIZER_STATES = {"sgd": 0, "adam": 2}
"""Optimizer state per parameter, in units of the parameter's bytes (plain SGD keeps none; Adam two moments)."""


@dataclass(frozen=True)
class Block:
    """A contiguous run of profile nodes that placers never split."""

    name: str
    nodes: tuple[str, ...]
    param_bytes: int
    saved_bytes: int
    time_s: Mapping[str, tuple[float, float]]
    """Per device type: (forward, backward) seconds per micro-batch, summed over the block's nodes."""


@dataclass(frozen=True)
class Problem:
    """Everything a placer needs: blocks, the bytes at every cut, the cluster and the run settings."""

    blocks: tuple[Block, ...]
    cut_fwd_bytes: tuple[int, ...]
    """``cut_fwd_bytes[b]``: activation bytes crossing the cut after block ``b`` (len = blocks - 1)."""
    cut_bwd_bytes: tuple[int, ...]
    """``cut_bwd_bytes[b]``: gradient bytes crossing the same cut backwards (model inputs carry none)."""
    cluster: Cluster
    microbatches: int
    schedule: str
    optimizer: str
    estimated_types: tuple[str, ...] = ()
    """Device types whose times were estimated by the roofline because the profile lacked them."""
    speed_factors: Mapping[str, float] = field(default_factory=dict)
    """Device id -> multiplier on that device's compute times (measured / predicted; 1 when absent).
    The runtime's rebalancer (seed 003 S5) feeds measured speeds back through this."""

    def time_on(self, block: int, device_id: str) -> tuple[float, float]:
        fwd, bwd = self.blocks[block].time_s[self.cluster.device(device_id).type]
        factor = self.speed_factors.get(device_id, 1.0)
        return fwd * factor, bwd * factor


@dataclass(frozen=True)
class StageSpec:
    """One stage of a candidate partition: blocks ``[start, stop)`` on ``device``."""

    start: int
    stop: int
    device: str


Partition = tuple[StageSpec, ...]


def validate_settings(microbatches: int, schedule: str, optimizer: str) -> None:
    from planner.formats.plan import SCHEDULES

    if microbatches < 1:
        raise PlannerError(f"--microbatches must be at least 1, found {microbatches}; pass a positive count such as 8")
    if schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if optimizer not in OPTIMIZER_STATES:
        raise PlannerError(f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZER_STATES)}")


def cut_bytes(profile: Profile, groups: Sequence[Sequence[str]]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Bytes crossing each cut between consecutive ``groups`` (forward activations, backward gradients).

    A value produced in group ``i`` whose last reader is in group ``j > i`` crosses cuts ``i .. j-1``;
    a difference array makes this one pass over the edges.
    """
    group_of = {name: g for g, names in enumerate(groups) for name in names}
    last_reader: dict[str, int] = {}
    for node in profile.nodes:
        for src in node.inputs:
            last_reader[src] = max(last_reader.get(src, -1), group_of[node.name])
    fwd = [0] * (len(groups) + 1)
    bwd = [0] * (len(groups) + 1)
    for node in profile.nodes:
        start, end = group_of[node.name], last_reader.get(node.name, -1)
        if end <= start:
            continue
        fwd[start] += node.output_bytes
        fwd[end] -= node.output_bytes
        if node.op != INPUT_OP and node.extra.get("requires_grad", True):
            bwd[start] += node.output_bytes
            bwd[end] -= node.output_bytes
    return _prefix(fwd)[: len(groups) - 1], _prefix(bwd)[: len(groups) - 1]


def _prefix(deltas: list[int]) -> tuple[int, ...]:
    out, running = [], 0
    for d in deltas:
        running += d
        out.append(running)
    return tuple(out)


_REPEATED = re.compile(r"^(.*?\.\d+)(\.|$)")


def layer_of(module_path: str) -> str:
    """The top-level repeated module holding an op: ``h.3.attn.c_attn`` -> ``h.3``.

    The shallowest path component followed by an integer index marks a ``ModuleList``/``Sequential``
    entry; ops outside any repeated module (embeddings, heads) belong to their top-level module.
    """
    if not module_path:
        return ""
    match = _REPEATED.match(module_path)
    if match:
        return match.group(1)
    return module_path.split(".")[0]
