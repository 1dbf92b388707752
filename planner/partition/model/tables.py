"""Prefix-sum cost tables of a ``Problem``: any stage's compute, memory and transfer figures in O(1).

Built once per problem (``Problem.tables``); this module knows the problem only as a type, so the
problem can build its tables without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Sequence, TypeVar

from planner.formats.cluster import Link

if TYPE_CHECKING:
    from planner.partition.model.problem import Problem

_Number = TypeVar("_Number", int, float)

OPTIMIZER_STATES = {"sgd": 0, "adam": 2}
"""Optimizer state per parameter, in units of the parameter's bytes (plain SGD keeps none; Adam two moments)."""


@dataclass(frozen=True)
class CostTables:
    """Prefix sums over blocks, built once per ``Problem`` (``problem.tables``).

    ``x_prefix[k]`` is the sum over blocks ``0 .. k-1``, so blocks ``[start, stop)`` cost
    ``x_prefix[stop] - x_prefix[start]``.
    """

    fwd_prefix: Mapping[str, tuple[float, ...]]
    """Per device id (device types share one tuple): forward seconds, speed factor not applied."""
    bwd_prefix: Mapping[str, tuple[float, ...]]
    weight_prefix: Mapping[str, tuple[float, ...]]
    """Per device id: the weight-gradient part of ``bwd_prefix`` (``Block.weight_s``)."""
    speed: Mapping[str, float]
    """Per device id: multiplier on compute times (1.0 unless the problem sets one)."""
    param_prefix: tuple[int, ...]
    param_tensor_prefix: tuple[int, ...]
    """Parameter tensors of the blocks before each cut (``Block.param_tensors``)."""
    saved_prefix: tuple[int, ...]
    input_bytes: tuple[int, ...]
    """``input_bytes[b]``: bytes a stage starting at block ``b`` receives per micro-batch (0 for the first: the data)."""
    recompute: bool
    """``Problem.recompute``: stages keep their inputs, not their saved activations (``cost.stage_activation_terms_t``)."""
    static_per_param_byte: int
    """Weights + gradients + optimizer state per parameter byte."""
    capacity_bytes: Mapping[str, int]
    links: Mapping[tuple[str, str], Link]
    """Every ordered pair of distinct devices -> the link between them."""
    update_rate: Mapping[str, float]
    """Per device id: optimizer-step seconds per parameter byte (``Problem.update_s_per_param_byte``)."""
    update_tensor_rate: Mapping[str, float]
    """Per device id: optimizer-step seconds per parameter tensor (``Problem.update_s_per_param_tensor``)."""
    version_rate: Mapping[str, float]
    """Per device id: an asynchronous update's version bookkeeping, seconds per parameter byte
    (``Problem.version_s_per_param_byte``)."""
    split_excess: Mapping[str, tuple[float, float]]
    """Per device id: ``(a, k)``, a split backward's excess over the fused one, ``a * saved_bytes ** k`` seconds
    (``Problem.split_backward_excess``; ``(0, 1)`` when absent)."""
    tied: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """``Problem.tied``: ``(bytes, reading blocks)`` of each parameter set several blocks read."""

    @classmethod
    def build(cls, problem: "Problem") -> "CostTables":
        by_type = {}
        for dev_type in sorted({d.type for d in problem.cluster.devices}):
            fwd, bwd = _prefix([b.time_s[dev_type][0] for b in problem.blocks]), _prefix([b.time_s[dev_type][1] for b in problem.blocks])
            by_type[dev_type] = (fwd, bwd, _prefix([b.weight_s.get(dev_type, 0.0) for b in problem.blocks]))
        devices = problem.cluster.devices
        return cls(
            fwd_prefix=MappingProxyType({d.id: by_type[d.type][0] for d in devices}),
            bwd_prefix=MappingProxyType({d.id: by_type[d.type][1] for d in devices}),
            weight_prefix=MappingProxyType({d.id: by_type[d.type][2] for d in devices}),
            speed=MappingProxyType({d.id: float(problem.speed_factors.get(d.id, 1.0)) for d in devices}),
            param_prefix=_prefix([b.param_bytes for b in problem.blocks]),
            param_tensor_prefix=_prefix([b.param_tensors for b in problem.blocks]),
            saved_prefix=_prefix([b.saved_bytes for b in problem.blocks]),
            input_bytes=(0, *problem.cut_fwd_bytes),
            recompute=problem.recompute,
            static_per_param_byte=2 + OPTIMIZER_STATES[problem.optimizer],
            capacity_bytes=MappingProxyType({d.id: d.memory_bytes for d in devices}),
            links=MappingProxyType(_links(problem)),
            update_rate=MappingProxyType({d.id: problem.update_s_per_param_byte.get(d.type, 0.0) for d in devices}),
            update_tensor_rate=MappingProxyType({d.id: problem.update_s_per_param_tensor.get(d.type, 0.0)
                                                 for d in devices}),
            version_rate=MappingProxyType({d.id: problem.version_s_per_param_byte.get(d.type, 0.0) for d in devices}),
            split_excess=MappingProxyType({d.id: problem.split_backward_excess.get(d.type, (0.0, 1.0)) for d in devices}),
            tied=problem.tied,
        )


def _links(problem: "Problem") -> dict[tuple[str, str], Link]:
    """Every ordered pair of distinct devices -> its link (``Cluster.link`` without per-call device scans)."""
    cluster = problem.cluster
    out = {}
    for a in cluster.devices:
        for b in cluster.devices:
            if a.id != b.id:
                pair = cluster.pairs.get((a.id, b.id) if a.id < b.id else (b.id, a.id))
                out[(a.id, b.id)] = pair or (cluster.intra_host if a.host == b.host else cluster.inter_host)
    return out


def _prefix(values: Sequence[_Number]) -> tuple[_Number, ...]:
    """``(0, v0, v0 + v1, ...)``: ``len(values) + 1`` running sums."""
    return tuple(accumulate(values, initial=values[0] * 0 if values else 0))
