"""Partition a profiled model over a cluster into pipeline stages: the one entry point of the placers.

Public: ``partition`` (profile + cluster -> plan), ``methods`` (the registry: ``register``, ``METHODS``),
``RefineConfig``. The placers live in ``greedy`` (seed 003 S2), ``baselines`` (the peers' uniform,
parameter and time balance) and the modules other packages register; ``refine`` is the offline
S3-S6 loop; ``validate.validate_plan`` checks any plan against its profile.
"""

from __future__ import annotations

from typing import Any, Mapping

from planner.errors import InfeasibleError
from planner.formats.catalog import DeviceSpec
from planner.formats.cluster import Cluster
from planner.formats.plan import Plan
from planner.formats.profile import Profile
from planner.partition.placers import registry as methods
from planner.partition.model.cost import infeasible_reason
from planner.partition.model.granularity import groups_for
from planner.partition.model.convert import build_plan
from planner.partition.model.problem import build_problem
from planner.partition.search import guard
from planner.partition.search.interleave import interleave
from planner.partition.search.rebalance import RebalanceConfig, normalise_weights
from planner.partition.search.refine import RefineConfig, refine as refine_loop

__all__ = ["partition", "methods", "RefineConfig", "RebalanceConfig"]


def partition(profile: Profile, cluster: Cluster, *, method: str, microbatches: int, schedule: str,
              optimizer: str = "adam", refine: bool = False, weights: Mapping[str, float] | None = None,
              speed_factors: Mapping[str, float] | None = None, profile_ref: Mapping[str, Any] | None = None,
              refine_config: RefineConfig | None = None, granularity: str | None = None,
              estimate_precision: str | None = None, catalog: Mapping[str, DeviceSpec] | None = None,
              **method_options: Any) -> Plan:
    """Plan ``profile`` on ``cluster`` with placer ``method``; the plan's ``predicted`` comes from the simulator.

    ``weights`` (device id -> share of the load, seed 003 S3; default equal) reach placers that take
    them; ``speed_factors`` (device id -> multiplier on its compute times) come from measurements.
    ``refine=True`` runs the offline S4-S6 loop (``planner.partition.search.refine``; one round for a placer that
    ignores weights) and then the boundary polish against the simulator (``planner.partition.search.polish``),
    recording both under ``refine``. ``granularity`` (``op``, ``layer``, ``depth:N``, ``count:N``; default ``op``) sets
    the blocks placers never split (``planner.partition.model.granularity``); ``estimate_precision`` (``fp32``,
    ``tf32``, ``bf16``; default: the profiled dtype) is what roofline estimates of device types assume
    (``build_problem``), recorded in the plan as ``estimate_precision``; placers may attach plan fields
    (``methods.Placed``, e.g. the ILP's ``solver``). Raises ``UsageError`` for an unknown method (listing the methods) and
    ``InfeasibleError`` when no stage split fits in memory.
    """
    entry = methods.get(method)
    groups = groups_for(profile, granularity) if granularity else None
    problem = build_problem(profile, cluster, microbatches=microbatches, schedule=schedule, optimizer=optimizer,
                            speed_factors=speed_factors, groups=groups, estimate_precision=estimate_precision,
                            catalog=catalog)
    reason = infeasible_reason(problem)
    if reason is not None:
        raise InfeasibleError(reason)
    start = normalise_weights(weights or {}, cluster.device_ids)
    extra: dict[str, Any] = {"granularity": granularity} if granularity else {}
    if estimate_precision is not None:
        extra["estimate_precision"] = estimate_precision
    if refine:
        result = refine_loop(problem, method, start, method_options, refine_config or RefineConfig())
        chosen, used = result.partition, result.weights
        extra["refine"] = result.record
    else:
        chosen, used = entry.fn(problem, weights=start, **method_options), start
    polish_on = not refine or (refine_config or RefineConfig()).polish is not None
    chosen = guard.check(problem, chosen, polish_on)  # "optimal" (dp, ilp) never loses to a baseline when simulated
    extra.update(methods.facts_of(chosen))
    chosen, interleaved = interleave(problem, chosen)  # interleaved-1f1b: v chunks per device when faster
    if interleaved:
        extra["interleave"] = interleaved
    if entry.takes_weights:
        extra["weights"] = used
    try:
        return build_plan(problem, chosen, method=method, profile_ref=profile_ref, extra=extra)
    except InfeasibleError as exc:
        raise InfeasibleError(f"method {method!r} made a split that does not fit: {exc}") from None
