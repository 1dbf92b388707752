"""Partition a profiled model over a cluster into pipeline stages: the one entry point of the placers.

Public: ``partition`` (profile + cluster -> plan), ``methods`` (the registry: ``register``, ``METHODS``),
``RefineConfig``. The placers live in ``greedy`` (the rebalancing patent's S2), ``baselines`` (the peers' uniform,
parameter and time balance) and the modules other packages register; ``refine`` is the offline
S3-S6 loop; ``validate.validate_plan`` checks any plan against its profile.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

from planner.errors import InfeasibleError, UsageError
from planner.partition.model.feasibility import violations
from planner.partition.model.problem import Partition, Problem, degree_of, with_facts
from planner.formats.catalog import DeviceSpec
from planner.formats.cluster import Cluster
from planner.formats.plan import DEFAULT_SYNC, GENERATED_ORDER_SCHEDULES, SERVER_SYNCS, Plan
from planner.formats.profile import Profile
from planner.partition.placers import registry as methods
from planner.partition.model.cost import infeasible_reason, step_time_s
from planner.partition.model.granularity import groups_for
from planner.partition.model.convert import build_plan
from planner.partition.model.problem import build_problem, with_schedule, with_sync
from planner.partition.search import guard
from planner.partition.search.exhaustive import exhaustive
from planner.partition.search.hybrid import hybrid_search, parse_degree
from planner.partition.search.interleave import interleave
from planner.partition.search.polish import polish_cuts
from planner.partition.search.rebalance import RebalanceConfig, normalise_weights
from planner.partition.search.recompute import recompute_where_needed
from planner.partition.search.refine import RefineConfig, refine as refine_loop

__all__ = ["partition", "methods", "RefineConfig", "RebalanceConfig"]


def partition(profile: Profile, cluster: Cluster, *, method: str, microbatches: int, schedule: str,
              optimizer: str = "adam", refine: bool = False, weights: Mapping[str, float] | None = None,
              speed_factors: Mapping[str, float] | None = None, profile_ref: Mapping[str, Any] | None = None,
              refine_config: RefineConfig | None = None, granularity: str | None = None,
              estimate_precision: str | None = None, catalog: Mapping[str, DeviceSpec] | None = None,
              data_parallel: str | int = 1, corrections: Sequence[tuple[int, int, float]] = (),
              sync: str = DEFAULT_SYNC, sync_period: int | None = 1, sync_staleness: int | None = None,
              recompute: bool | str = False, drain_every: int | None = None, thorough: bool = True,
              whole_polish: bool = True,
              **method_options: Any) -> Plan:
    """Plan ``profile`` on ``cluster`` with placer ``method``; the plan's ``predicted`` comes from the simulator.

    ``weights`` (device id -> share of the load, the rebalancing patent's S3; default equal) reach placers that take
    them; ``speed_factors`` (device id -> multiplier on its compute times) and ``corrections`` (``(start, stop,
    factor)`` on profile nodes) come from measurements (``planner.partition.search.speed``).
    ``refine=True`` runs the offline S4-S6 loop (``planner.partition.search.refine``; one round for a placer that
    ignores weights) and then the boundary polish against the simulator (``planner.partition.search.polish``),
    recording both under ``refine``. ``granularity`` (``op``, ``layer``, ``depth:N``, ``count:N``; default ``op``) sets
    the blocks placers never split (``planner.partition.model.granularity``); ``estimate_precision`` (``fp32``,
    ``tf32``, ``bf16``; default: the profiled dtype) is what roofline estimates of device types assume
    (``build_problem``), recorded in the plan as ``estimate_precision``; placers may attach plan fields
    (``methods.Placed``, e.g. the ILP's ``solver``). ``data_parallel`` (``1``, the default: a pure pipeline;
    ``"auto"``: the fastest shape, the pure pipeline included; ``N``: N replica pipelines) replicates the stages
    (``planner.partition.search.hybrid``; the CLI's default is ``auto``); unless ``refine`` turned the polish off, the
    replicated finalists' cuts are then polished whole, all-reduce included, and under ``recompute="auto"`` with each
    move's recomputation decided again (``thorough`` below; ``planner.partition.search.polish.polish_cuts``, the
    plan's ``cut_polish``).
    ``sync`` and ``sync_period`` say how the
    replicas combine their updates (``ssgd`` every step; ``local-sgd`` every ``sync_period`` steps; ``adaptive``,
    whose first period the rule picks from the predicted times when ``sync_period`` is ``None``); the simulator
    spreads each aggregation over its period, and a mode other than ``ssgd`` makes ``auto`` consider replicated
    shapes only. ``recompute``: activation recomputation in every stage (``True``; ``Problem.recompute``: each stage
    keeps its input per micro-batch and runs its forward again before the backward), or ``"auto"``: placed as if every
    stage recomputed, then only in the stages whose devices cannot hold their saved activations
    (``planner.partition.search.recompute``); recorded as each stage's ``recompute``.
    ``thorough``: whether the shape search also tries the groupings by device-class counts (``search/groups.py``)
    and finishes its finalists with the sync in view, and polishes the cuts again for the stages that stop
    recomputing (the whole plan's cut polish, ``hybrid._finished``, ``_polish_whole``; never on the peers' baselines,
    whose cuts are theirs); ``plan train``'s first pass over many candidates leaves all three to its finalists.
    ``whole_polish=False`` leaves out the last two alone: ``plan run``'s re-plans, which run between rounds.
    ``drain_every``: under an asynchronous schedule, the steps ``plan run`` will run between pipeline drains (its
    round length; ``Problem.drain_every``), recorded in the plan's ``async`` field; ``None``: the steady state.
    The parameter-server modes (``bsp``, ``asp``, ``ssp`` with ``sync_staleness``, ``dasp``) serve
    replicas of the whole model: one stage, one replica per device. Raises ``UsageError`` for an unknown method (listing the methods) and
    ``InfeasibleError`` when no stage split fits in memory.
    """
    if recompute not in (False, True, "auto"):
        raise UsageError(f"recompute must be False, True or 'auto', found {recompute!r}")
    entry = methods.get(method)
    groups = groups_for(profile, granularity) if granularity else None
    problem = build_problem(profile, cluster, microbatches=microbatches, schedule=schedule, optimizer=optimizer,
                            speed_factors=speed_factors, groups=groups, estimate_precision=estimate_precision,
                            catalog=catalog, corrections=corrections, recompute=bool(recompute),
                            drain_every=drain_every)
    problem = with_sync(problem, sync, sync_period, sync_staleness)
    reason = infeasible_reason(problem)
    if reason is not None:
        raise InfeasibleError(reason)
    start = normalise_weights(weights or {}, cluster.device_ids)
    requested = parse_degree(data_parallel)
    if sync != DEFAULT_SYNC and requested == 1:
        raise UsageError(f"--sync {sync} combines replicas, but --data-parallel 1 makes a pure pipeline with none; "
                         f"pass --data-parallel auto or N > 1, or drop --sync")
    if sync in SERVER_SYNCS:
        count = len(cluster.device_ids)
        if requested not in (None, count):
            raise UsageError(f"--sync {sync} serves replicas of the whole model, one per device: --data-parallel must "
                             f"be {count} (the devices of {cluster.name!r}) or auto, found {requested}")
        if count < 2:
            raise UsageError(f"--sync {sync} needs at least 2 devices for its workers, {cluster.name!r} has {count}; "
                             f"use a larger cluster or drop --sync")
        requested = count
    extra: dict[str, Any] = {"granularity": granularity} if granularity else {}
    if estimate_precision is not None:
        extra["estimate_precision"] = estimate_precision
    polish_on = not refine or (refine_config or RefineConfig()).polish is not None
    ours = thorough and whole_polish and method not in methods.PEER_BASELINES  # the peers' splits stay theirs
    chosen: Partition | None = None
    used = start
    pure_error: InfeasibleError | None = None
    if requested == 1 or (requested is None and sync == DEFAULT_SYNC):
        try:
            chosen, used = _pure(problem, method, start, refine, refine_config, method_options, polish_on, extra)
        except InfeasibleError as exc:
            if requested == 1:
                raise
            pure_error = exc
        broken = violations(problem, chosen) if requested is None and chosen is not None else []
        if broken:  # auto: a pure pipeline that does not fit is no candidate (build_plan names it for 1), but its
            chosen, pure_error = None, InfeasibleError(broken[0])  # reason is the answer when no shape fits
    if requested != 1:

        def place(sub: Problem, sub_weights: Mapping[str, float]) -> Partition:
            return guard.check(sub, entry.fn(sub, weights=sub_weights, **method_options), polish_on)

        def in_view(sub: Problem, sub_weights: Mapping[str, float]) -> Partition:  # finish polishes it whole
            return entry.fn(sub, weights=sub_weights, **method_options)

        def finish(hybrid: Partition) -> Partition:
            facts: dict[str, Any] = {}  # its cut_polish record travels with the plan
            polished = _polish_whole(problem, hybrid, False, facts)
            return with_facts(polished, facts)

        try:
            finishing = polish_on and ours
            chosen = hybrid_search(problem, place, start, requested, chosen, thorough,
                                   finish if finishing else None, in_view if finishing else None)
        except InfeasibleError:
            if pure_error is not None:  # auto: nothing fits; the pipeline's reason names the sizes
                raise pure_error from None
            raise
        if degree_of(chosen) > 1:  # the pure pipeline's chunking does not describe the replicas' (they carry their own)
            extra.pop("interleave", None)
        extra.update(methods.facts_of(chosen))
        if degree_of(chosen) > 1 and isinstance(extra.get("solver"), dict):  # the placer's record: the pure pipeline
            extra["solver"] = {**extra["solver"], "applies_to": SOLVER_SCOPE}
    if method in EXACT_METHODS and polish_on:  # polish off (--refine ablations): the placer's plan as it is
        chosen = _exact_on_small(problem, requested, chosen, extra)
    if recompute == "auto":  # a split that does not fit keeps recomputing everywhere, for build_plan to name
        chosen = recompute_where_needed(problem, chosen)
    if polish_on and ours and recompute == "auto":  # the stages that stopped recomputing may take more blocks
        chosen = _polish_whole(problem, chosen, True, extra)
    if entry.takes_weights:
        extra["weights"] = used
    try:
        return build_plan(problem, chosen, method=method, profile_ref=profile_ref, extra=extra)
    except InfeasibleError as exc:
        raise InfeasibleError(f"method {method!r} made a split that does not fit: {exc}") from None


def _polish_whole(problem: Problem, chosen: Partition, auto_recompute: bool, extra: dict[str, Any]) -> Partition:
    """``chosen`` with its cuts polished whole (``search.polish.polish_cuts``: the replicas' all-reduce and, under
    ``recompute="auto"``, each candidate's recomputation decided again), recorded under ``cut_polish``; a plan that does
    not fit is left for ``build_plan`` to name. ``zb-planned`` polishes under its fixed proxy's order (one simulation
    a move, as in ``_planned_stages``; ``zbv``'s where a device holds two stages) and keeps the result only when it
    is faster under its own."""
    if violations(problem, chosen):
        return chosen
    under = problem
    if problem.schedule in GENERATED_ORDER_SCHEDULES:
        under = with_schedule(problem, "zbv" if len({st.device for st in chosen}) < len(chosen) else PLANNED_PROXY)
    decide = (lambda candidate: recompute_where_needed(under, candidate)) if auto_recompute else None
    result = polish_cuts(under, chosen, decide=decide)
    polished, record = result.partition, dict(result.record)
    if under is not problem:
        record.update(under=under.schedule, start_step_time_s=step_time_s(problem, chosen))
        if violations(problem, polished) or step_time_s(problem, polished) >= record["start_step_time_s"]:
            polished, record["moves"] = chosen, []
        record["step_time_s"] = step_time_s(problem, polished)
    sees = [*(["all-reduce"] if degree_of(chosen) > 1 else []), *(["recompute"] if auto_recompute else [])]
    done = {**{k: record[k] for k in ("objective", "start_step_time_s", "step_time_s", "evaluations", "stop", "moves",
                                      "under") if k in record}, "sees": sees}
    earlier = extra.get("cut_polish")
    if earlier:  # replicas polished for their all-reduce first (hybrid_search's finish): one record of both passes
        done.update(start_step_time_s=earlier["start_step_time_s"], evaluations=earlier["evaluations"] +
                    done["evaluations"], moves=earlier["moves"] + done["moves"])
    extra["cut_polish"] = done
    return polished


SOLVER_SCOPE = ("the pure pipeline (data_parallel 1), one candidate of the shape search; the chosen shape, its shares "
                "and its cuts minimise the simulated step with the all-reduce (shape, cut_polish)")
"""What a replicated plan's ``solver`` record (the placer on the whole cluster) refers to."""

EXACT_METHODS = ("dp", "ilp")
"""The methods that claim exactness: on a problem small enough, their shape is also searched exhaustively."""


def _exact_on_small(problem: Problem, requested: int | None, chosen: Partition, extra: dict[str, Any]) -> Partition:
    """``chosen``, or the exhaustive search's plan when the problem is small enough for it (``search/exhaustive.py``)
    and it simulates strictly faster; the plan's ``exhaustive`` record says which, and the heuristic's step time."""
    heuristic_s = step_time_s(problem, chosen) if not violations(problem, chosen) else math.inf
    found = exhaustive(problem, requested, heuristic_s)
    if found is None:
        return chosen
    plan, record = found
    record["heuristic_step_time_s"] = heuristic_s if heuristic_s < math.inf else None
    record["chosen"] = "heuristic" if plan is None else "exhaustive"
    extra["exhaustive"] = record
    if plan is None:
        return chosen
    for stale in ("interleave", "cut_polish"):  # the heuristic's chunking, polish and shape no longer describe it
        extra.pop(stale, None)
    shape = extra.get("shape")
    if shape:
        extra["shape"] = {**shape, "chosen": {"degree": record["degree"], "grouping": "exhaustive",
                                              "stages": record["stages"], "step_time_s": record["step_time_s"]}}
    return plan


def _pure(problem: Problem, method: str, start: Mapping[str, float], refine: bool,
          refine_config: RefineConfig | None, method_options: Mapping[str, Any], polish_on: bool,
          extra: dict[str, Any]) -> tuple[Partition, Mapping[str, float]]:
    """The pure pipeline (degree 1): the placer (or the refine loop), the optimality guard and interleaving;
    records what they did in ``extra``."""

    def place(under: Problem) -> tuple[Partition, Any]:
        """``under``'s stages: the refine loop's when asked (and its result), else the placer's (and None)."""
        if refine:
            result = refine_loop(under, method, start, method_options, refine_config or RefineConfig())
            return result.partition, result
        return methods.get(method).fn(under, weights=start, **method_options), None

    # zb-planned refines under its fixed proxy's order (_planned_stages says why): its own order is generated per
    # simulation, and the polish's thousands of moves under it took most of plan train's search time
    proxy = with_schedule(problem, PLANNED_PROXY) if refine and problem.schedule in GENERATED_ORDER_SCHEDULES \
        else problem
    chosen, result = place(proxy)
    used = result.weights if result is not None else start
    if result is not None:
        extra["refine"] = result.record if proxy is problem else {**result.record, "under": proxy.schedule}
    if problem.schedule in GENERATED_ORDER_SCHEDULES:
        bases = _planned_stages(problem, method, chosen, start, method_options, polish_on,
                                lambda roomy: place(roomy)[0])
    else:
        bases = (guard.check(problem, chosen, polish_on),)  # "optimal" (dp, ilp) never loses to a baseline, simulated
    # interleaved-1f1b, zbv and zb-planned: several chunks per device when faster (from each base; the first wins ties)
    options = [(base, *interleave(problem, base)) for base in bases]
    base, chosen, interleaved = options[0] if len(options) == 1 else \
        min(options, key=lambda option: step_time_s(problem, option[1]))
    extra.update(methods.facts_of(base))
    if interleaved:
        extra["interleave"] = interleaved
    return chosen, used


PLANNED_PROXY = "zb-h1"
"""The fixed order ``zb-planned``'s stages are placed, refined and polished under (one simulation per move)."""
PLANNED_ROOMY_PROXY = "zb-h2"
"""The fixed order that holds more micro-batches, under which ``zb-planned``'s stages are also placed where it fits."""


def _planned_stages(problem: Problem, method: str, placed: Partition, start: Mapping[str, float],
                    method_options: Mapping[str, Any], polish_on: bool,
                    roomy_stages: Callable[[Problem], Partition]) -> tuple[Partition, ...]:
    """``zb-planned``'s candidate stages, one stage per device. Its order is generated per candidate set of stages
    (five to eight simulations for one step time), too dear for the polish's thousand moves; so the stages are also
    placed, checked and polished under ``zb-h1``'s fixed order (one simulation each), and under ``zb-h2``'s where the
    devices hold what it keeps in flight (its cuts suit an order with more micro-batches in flight, which the
    generator may then use: ``schedules.planned_patterns``; ``roomy_stages`` places them, refined when the plan is, as
    ``zb-h2``'s own plan would be); the placer's own stages are checked without the polish.
    All go on to the V (``interleave``), and the fastest under ``zb-planned`` wins (the placer's own on ties, then
    ``zb-h1``'s). Since the planned order on any stages is at least as fast as ``zb-h1``'s (one stage per device),
    ``zbv``'s (in a V) and ``zb-h2``'s where it fits, and their plans start from the same polished stages, the plan is
    never slower than their plans of the same problem."""
    fixed = with_schedule(problem, PLANNED_PROXY)
    under_fixed = guard.check(fixed, methods.get(method).fn(fixed, weights=start, **method_options), polish_on)
    own = guard.check(problem, placed, False)
    roomy = with_schedule(problem, PLANNED_ROOMY_PROXY)
    try:
        under_roomy = guard.check(roomy, roomy_stages(roomy), polish_on)
    except InfeasibleError:  # the devices cannot hold zb-h2's micro-batches: zb-h1's counts are the most it may use
        return own, under_fixed
    return own, under_fixed, under_roomy
