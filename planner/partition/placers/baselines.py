"""The peers' partition methods, as they define them, for side-by-side comparison.

All three cut at *layer* boundaries, as the peers do (they split a list of layers, not ops), put
stage ``i`` on the ``i``-th device in the cluster file's order (rank order), use
``min(devices, layers)`` stages, and ignore device speeds, links and memory. ``planner.partition``
checks the result's memory afterwards and reports a split that does not fit.

- ``uniform``: Megatron-LM / DeepSpeed ``partition_method="uniform"``: the same number of transformer
  layers per stage, the first ``L mod p`` stages taking one more (DeepSpeed ``partition_uniform``).
  Ops outside the repeated layers (embeddings, final norm, head) ride with the neighbouring layer.
- ``params``: DeepSpeed ``partition_method="parameters"``: contiguous stages minimising the largest
  parameter count (DeepSpeed ``partition_balanced``: bisection on the bottleneck with a greedy fill).
- ``time-balance``: torchgpipe ``balance_by_time``: contiguous stages minimising the largest
  forward + backward time, every device assumed to be the first device's type. torchgpipe solves it
  with the Bárány–Grinberg block-partition heuristic; we solve the same min-max objective exactly
  (bisection plus greedy fill), which can only make this baseline stronger.

A *layer unit* is a maximal run of consecutive blocks with the same ``layer_of`` label (ops with no
module path stay with the unit before them, or join the first unit; a profile without module paths
has one unit per block). Repeated layers are the units whose label ends in an index
(``blocks.3``); when a model has none, every unit counts as a layer.
"""

from __future__ import annotations

import functools
import operator
import re
from typing import Any, Mapping, Sequence

from planner.partition.model.feasibility import max_stages
from planner.partition.model.problem import Partition, Problem, StageSpec

_INDEXED = re.compile(r"\.\d+$")


def layer_units(problem: Problem) -> list[tuple[int, int, str]]:
    """Maximal runs ``(start, stop, label)`` of blocks sharing one layer label, in block order."""
    units: list[tuple[int, int, str]] = []
    start, label = 0, ""
    for b, block in enumerate(problem.blocks):
        own = block.layers[-1] if block.layers else ""
        if not own or own == label:
            continue
        if label:
            units.append((start, b, label))
            start = b
        label = own
    if not label:
        return [(b, b + 1, problem.blocks[b].name) for b in range(len(problem.blocks))]
    units.append((start, len(problem.blocks), label))
    return units


def uniform(problem: Problem, *, weights: Mapping[str, float] | None = None, **options: Any) -> Partition:
    """Equal numbers of repeated layers per stage (Megatron-LM / DeepSpeed ``uniform``)."""
    _no_options("uniform", options)
    units = layer_units(problem)
    repeated = [i for i, (_, _, label) in enumerate(units) if _INDEXED.search(label)] or list(range(len(units)))
    parts = min(_stage_limit(problem), len(repeated))
    bounds = _uniform_bounds(len(repeated), parts)
    # Stage i starts at the unit of its first layer; units before the first layer stay in stage 0.
    cuts = [units[repeated[bounds[i]]][0] for i in range(1, parts)]
    return _stages(problem, [0, *cuts, len(problem.blocks)])


def params(problem: Problem, *, weights: Mapping[str, float] | None = None, **options: Any) -> Partition:
    """Contiguous layer stages minimising the largest parameter bytes (DeepSpeed ``parameters``)."""
    _no_options("params", options)
    units = layer_units(problem)
    costs = [float(sum(problem.blocks[b].param_bytes for b in range(s, e))) for s, e, _ in units]
    return _balanced(problem, units, costs)


def time_balance(problem: Problem, *, weights: Mapping[str, float] | None = None, **options: Any) -> Partition:
    """Contiguous layer stages minimising the largest fwd+bwd time on device 0's type (torchgpipe)."""
    _no_options("time-balance", options)
    dev_type = problem.cluster.devices[0].type
    units = layer_units(problem)
    costs = [sum(sum(problem.blocks[b].time_s[dev_type]) for b in range(s, e)) for s, e, _ in units]
    return _balanced(problem, units, costs)


def _stage_limit(problem: Problem) -> int:
    """One stage per device, as the peers do, but no more than the feasibility rule allows (1F1B: m)."""
    return max_stages(problem.schedule, problem.microbatches, len(problem.cluster.devices))


def _uniform_bounds(items: int, parts: int) -> list[int]:
    """DeepSpeed ``partition_uniform``: part ``i`` is ``[bounds[i], bounds[i+1])``; the remainder goes first."""
    chunk, residual = divmod(items, parts)
    return [i * chunk + min(i, residual) for i in range(parts + 1)]


def _balanced(problem: Problem, units: Sequence[tuple[int, int, str]], costs: Sequence[float]) -> Partition:
    parts = min(_stage_limit(problem), len(units))
    bounds = min_max_split(costs, parts)
    return _stages(problem, [units[u][0] for u in bounds[:-1]] + [len(problem.blocks)])


def min_max_split(costs: Sequence[float], parts: int) -> list[int]:
    """Split ``costs`` into exactly ``parts`` non-empty contiguous runs minimising the largest sum.

    Returns bounds (``parts + 1`` indices). The smallest feasible bottleneck is found by bisection with
    the greedy "fill each part up to the bottleneck" test (exact for this problem); runs are then split
    until there are ``parts`` of them, which never raises the largest sum.
    """
    assert 1 <= parts <= len(costs)
    # hi must be a bottleneck that ``_fill`` itself accepts: its running total, not ``sum`` (compensated since
    # Python 3.12, so it can fall below the running total, and one part came back as two on the GPU machine)
    lo, hi = max(costs), functools.reduce(operator.add, costs, 0.0)
    for _ in range(200):
        if hi - lo <= 1e-12 * max(hi, 1e-300):
            break
        mid = (lo + hi) / 2
        if len(_fill(costs, mid)) - 1 <= parts:
            hi = mid
        else:
            lo = mid
    bounds = _fill(costs, hi)
    while len(bounds) - 1 < parts:
        bounds = _split_largest(costs, bounds)
    return bounds


def _fill(costs: Sequence[float], limit: float) -> list[int]:
    bounds, total = [0], 0.0
    for i, cost in enumerate(costs):
        if total + cost > limit and i > bounds[-1]:
            bounds.append(i)
            total = 0.0
        total += cost
    bounds.append(len(costs))
    return bounds


def _split_largest(costs: Sequence[float], bounds: list[int]) -> list[int]:
    """Split the costliest run of two or more items where the larger half is smallest."""
    runs = [(sum(costs[a:b]), -a, a, b) for a, b in zip(bounds, bounds[1:]) if b - a >= 2]
    _, _, a, b = max(runs)
    best = min(range(a + 1, b), key=lambda c: (max(sum(costs[a:c]), sum(costs[c:b])), c))
    return sorted([*bounds, best])


def _stages(problem: Problem, bounds: Sequence[int]) -> Partition:
    devices = problem.cluster.device_ids
    return tuple(StageSpec(a, b, devices[i]) for i, (a, b) in enumerate(zip(bounds, bounds[1:])))


def _no_options(method: str, options: Mapping[str, Any]) -> None:
    if options:
        from planner.errors import UsageError

        raise UsageError(f"method {method!r} takes no options, found {', '.join(sorted(options))}")


