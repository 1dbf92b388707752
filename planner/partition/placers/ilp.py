"""``--method ilp``: an integer program over candidate stages and device classes, solved by HiGHS.

It minimises the shared objective ``sum_k L_k + (m - 1) * max_k L_k`` (``planner.partition.model.objective``;
docs/exact-methods.md derives the linearisation) subject to memory under the schedule, choosing at once
which contiguous block runs form stages and which device class runs each stage. A plan is a path of
candidate stages (blocks ``[i, j)`` on class ``c``, next stage on class ``d``) from block 0 to the end:
a flow formulation whose linear relaxation is far tighter than the compact slot model (y[b, k],
z[k, d] with big-M products), which we tried first and which left 20-50 % gaps after 60 s on 64 blocks
x 8 devices (docs/exact-methods.md). Candidates slower than a bound implied by the warm start are left
out, which keeps the model small without losing the optimum.

Solved with PuLP's in-process HiGHS (``threads=1``, fixed seed) under a time limit and relative gap,
warm-started from the greedy plan; the result is never worse than the warm start. The status
distinguishes a proven optimum (HiGHS ``Optimal``: gap within ``gap_rel``) from an incumbent stopped
by the time limit, which PuLP alone would also call "Optimal".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np
import pulp

from planner.errors import InfeasibleError, PlannerError
from planner.partition.model.feasibility import check_fits, max_stages, no_fit_message
from planner.partition.model.problem import Placed
from planner.partition.placers import greedy
from planner.partition.placers.highs import HiGHS, solver_output_to_log, tolerances
from planner.partition.model.objective import ClassTables, assign_devices, class_tables, stage_latencies, step_time_formula_s
from planner.partition.model.problem import Partition, Problem

__all__ = ["IlpResult", "solve_ilp", "lp_bound_s", "ilp_placer", "ilp_result", "top_floor_s", "MAX_CANDIDATES"]

log = logging.getLogger(__name__)

MAX_CANDIDATES = 100_000
"""Most candidate stages (binary variables) the ILP builds; beyond, PuLP's model building alone takes minutes."""


@dataclass(frozen=True)
class IlpResult:
    partition: Partition
    objective_s: float
    """The shared objective of ``partition``."""
    status: str
    """``optimal`` (HiGHS proved its optimum and the returned plan is within the tolerances it stopped by:
    ``solver["tolerances"]``, see ``_tolerances``), ``feasible`` (stopped with a
    gap) or ``warm-start`` (the solver found nothing better than the warm start, which is returned, and
    did not prove it). ``solver["returned"]`` says whose plan it is."""
    bound_s: float
    """The solver's proven lower bound on the objective (seconds)."""
    gap: float
    """``(objective - bound) / objective`` of the returned plan."""
    solver: Mapping[str, Any] = field(default_factory=dict)
    """What the plan records under ``solver``."""


@dataclass(frozen=True)
class _Arc:
    """A candidate stage: blocks ``[start, stop)`` on class ``cls``, followed by a stage on ``nxt`` (-1: last)."""

    start: int
    stop: int
    cls: int
    nxt: int
    latency_s: float
    room: int
    """Most stages-to-end for which the stage fits (``ClassTables.BIG``: always)."""
    tail_s: float = 0.0
    """The stage's sync tail on a replica pipeline (``objective.sync_tail_s``): in the objective, not in ``top``."""


@dataclass
class _Model:
    """The PuLP problem, its arcs and variables (numbered blocks in ``_build``)."""

    lp: pulp.LpProblem
    scale_s: float
    arcs: list[_Arc]
    x: list[pulp.LpVariable]
    top: pulp.LpVariable
    after: list[pulp.LpVariable]
    holder: list[pulp.LpVariable]


def _arcs(problem: Problem, tab: ClassTables, incumbent_s: float) -> list[_Arc]:
    """Every stage the ILP may choose: valid in memory and on a device pair, and not ruled out by
    ``incumbent_s`` (a feasible plan's step time; ``inf`` keeps all)."""
    nb = len(problem.blocks)
    lat = stage_latencies(tab, nb)
    fastest = np.array([float(tab.compute_s[:, b, b + 1].min()) for b in range(nb)])
    before = np.concatenate([[0.0], np.cumsum(fastest)])  # fastest time of blocks [0, i)
    outside = before[-1] - (before[None, :] - before[:, None])  # [i, j]: fastest time of blocks outside [i, j)
    tail = np.zeros(lat.room.shape) if lat.tail is None else lat.tail  # (class, start, stop)
    keep_mid = np.isfinite(lat.mid) & _could_beat(problem, tab, lat.mid, outside, incumbent_s, tail[:, None])
    keep_last = np.isfinite(lat.last) & _could_beat(problem, tab, lat.last, before, incumbent_s, tail[:, :, nb])
    arcs = [_Arc(int(i), int(j), int(c), int(d), float(lat.mid[c, d, i, j]), int(lat.room[c, i, j]),
                 float(tail[c, i, j])) for c, d, i, j in zip(*np.nonzero(keep_mid))]
    arcs += [_Arc(int(i), nb, int(c), -1, float(lat.last[c, i]), int(lat.room[c, i, nb]), float(tail[c, i, nb]))
             for c, i in zip(*np.nonzero(keep_last))]
    return sorted(arcs, key=lambda a: (a.start, a.stop, a.cls, a.nxt))


def _could_beat(problem: Problem, tab: ClassTables, latency: np.ndarray, outside_s: np.ndarray,
                incumbent_s: float, tail_s: np.ndarray | float = 0.0) -> np.ndarray:
    """Mask of stages (latency ``latency``, sync tail ``tail_s``) that may appear in a plan no worse than
    ``incumbent_s``.

    A plan holding a stage of latency ``L`` costs at least ``L`` and its tail, plus ``outside_s`` (every other block
    on its fastest class: the rest of the sum term), plus ``(m - 1) * max(L, floor)`` with ``floor``
    from ``top_floor_s``. Dropping stages that must exceed the incumbent keeps every optimal plan.
    """
    if not np.isfinite(incumbent_s):
        return np.ones(latency.shape, dtype=bool)
    floor = top_floor_s(tab, len(problem.blocks))
    with np.errstate(invalid="ignore"):
        least = latency + tail_s + outside_s * (1 - 1e-9) + (problem.microbatches - 1) * np.maximum(latency, floor)
        return least <= incumbent_s * (1 + 1e-9)


def top_floor_s(tab: ClassTables, nblocks: int) -> float:
    """A lower bound on the slowest stage of any plan.

    Some stage holds the largest block, and all devices together, each no faster than its class's
    best ratio to the fastest class, must get through every block: ``T >= W / sum_c n_c / r_c``.
    """
    single = tab.compute_s[:, np.arange(nblocks), np.arange(nblocks) + 1]
    fastest = single.min(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(fastest[None, :] > 0, single / fastest[None, :], 1.0).min(axis=1)
    capacity = sum(n / max(r, 1e-12) for n, r in zip(tab.counts, ratio))
    return float(max(fastest.max(initial=0.0), fastest.sum() / capacity))


def _build(problem: Problem, tab: ClassTables, incumbent_s: float = np.inf, relax: bool = False) -> _Model:
    """The formulation, in numbered blocks. Times are in units of ``scale_s`` so coefficients are O(1)."""
    nb, m = len(problem.blocks), problem.microbatches
    arcs = _arcs(problem, tab, incumbent_s)
    if len(arcs) > MAX_CANDIDATES:
        raise PlannerError(f"the ilp method would weigh {len(arcs)} candidate stages ({nb} blocks x {len(tab.classes)} "
                           f"device classes; limit {MAX_CANDIDATES}); coarsen with --granularity layer or count:64, "
                           f"or use --method dp")
    scale = max((a.latency_s for a in arcs), default=1.0) or 1.0
    lp = pulp.LpProblem("pipeline_stages", pulp.LpMinimize)

    # 1. Variables. x[a] = 1 when candidate stage a (blocks [i, j) on class c, next stage on class d) is
    #    in the plan; the plan is a path of such stages from block 0 to the end. top >= every chosen
    #    latency; after[i] = how many stages start at block i or later (the 1F1B memory rule needs it).
    cat = pulp.LpContinuous if relax else pulp.LpBinary
    x = [lp.add_variable(f"x_{a.start}_{a.stop}_{a.cls}_{a.nxt + 1}", 0, 1, cat) for a in arcs]
    top = lp.add_variable("top", 0)
    after = [lp.add_variable(f"after_{i}", 0) for i in range(nb + 1)]

    # 2. Objective: sum of the chosen latencies (and sync tails, on a replica pipeline) + (m - 1) * top, the
    #    step-time formula once top = max.
    lp += pulp.LpAffineExpression([(v, (a.latency_s + a.tail_s) / scale) for v, a in zip(x, arcs)]
                                  + [(top, m - 1)]), "step_time"

    # 3. Path: one stage starts at block 0; a stage ending before block j on class d's account is
    #    followed by exactly one stage starting at j on class d (flow conservation on nodes (j, d)).
    inflow: dict[tuple[int, int], list] = {}
    outflow: dict[tuple[int, int], list] = {}
    for v, a in zip(x, arcs):
        outflow.setdefault((a.start, a.cls), []).append((v, 1))
        if a.nxt >= 0:
            inflow.setdefault((a.stop, a.nxt), []).append((v, 1))
    first = [term for (i, _), terms in outflow.items() if i == 0 for term in terms]
    lp += pulp.LpConstraint(pulp.LpAffineExpression(first), pulp.LpConstraintEQ, "start", 1)
    for node in sorted(set(inflow) | {k for k in outflow if k[0] > 0}):
        terms = inflow.get(node, []) + [(v, -1) for v, _ in outflow.get(node, [])]
        lp += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintEQ, f"flow_{node[0]}_{node[1]}", 0)

    # 4. No class runs more stages than it has devices.
    for c, cls in enumerate(tab.classes):
        terms = [(v, 1) for v, a in zip(x, arcs) if a.cls == c]
        lp += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, f"devices_{c}", cls.count)

    # 5. top >= the latency of the stage that holds block b, for every block. Exactly one chosen stage
    #    covers each block (also fractionally: a unit flow crosses every cut once), so that latency is
    #    a convex combination: much tighter than one bound per candidate. Written sparsely through
    #    holder[b] = holder[b-1] - (stages ending at b) + (stages starting at b), each stage in two rows.
    holder = [lp.add_variable(f"holder_{b}", 0) for b in range(nb)]
    for b in range(nb):
        terms = [(holder[b], 1)] + ([(holder[b - 1], -1)] if b else [])
        terms += [(v, -a.latency_s / scale) for v, a in zip(x, arcs) if a.start == b]
        terms += [(v, a.latency_s / scale) for v, a in zip(x, arcs) if a.stop == b]
        lp += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintEQ, f"holder_{b}", 0)
        lp += pulp.LpConstraint(pulp.LpAffineExpression([(holder[b], 1), (top, -1)]), pulp.LpConstraintLE,
                                f"top_{b}", 0)

    # 6. Stages-to-end: after[i] = after[i+1] + (stages starting at i); after[nb] = 0.
    lp += after[nb] == 0, "after_end"
    for i in range(nb):
        terms = [(after[i], 1), (after[i + 1], -1)] + [(v, -1) for v, a in zip(x, arcs) if a.start == i]
        lp += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintEQ, f"after_{i}", 0)

    # 7. Memory under 1F1B: a stage that fits only with at most `room` stages to its end (fewer
    #    micro-batches in flight) may be chosen only where after[start] <= room (big-M off otherwise).
    #    Stages that never fit were left out in _arcs; under GPipe every kept stage fits.
    most = min(sum(tab.counts), nb)
    for v, a in zip(x, arcs):
        if a.room < most:
            terms = [(after[a.start], 1), (v, most - a.room)]
            lp += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE,
                                    f"memory_{a.start}_{a.stop}_{a.cls}_{a.nxt + 1}", most)
    # 8. The feasibility rule's stage count (1F1B runs at most m stages): after[0] counts every stage.
    limit = max_stages(problem.schedule, m, sum(tab.counts))
    if limit < most:
        lp += pulp.LpConstraint(pulp.LpAffineExpression([(after[0], 1)]), pulp.LpConstraintLE, "stage_count", limit)
    return _Model(lp, scale, arcs, x, top, after, holder)


def _start_values(tab: ClassTables, model: _Model, partition: Partition) -> dict[str, float] | None:
    """Variable values of ``partition`` in ``model`` (None when one of its stages was left out)."""
    klass = {dev: c for c, cls in enumerate(tab.classes) for dev in cls.devices}
    index = {(a.start, a.stop, a.cls, a.nxt): n for n, a in enumerate(model.arcs)}
    values: dict[str, float] = {}
    for k, st in enumerate(partition):
        nxt = klass[partition[k + 1].device] if k + 1 < len(partition) else -1
        n = index.get((st.start, st.stop, klass[st.device], nxt))
        if n is None:
            return None
        values[model.x[n].name] = 1.0
        values[model.top.name] = max(values.get(model.top.name, 0.0), model.arcs[n].latency_s / model.scale_s)
        for b in range(st.start, st.stop):
            values[model.holder[b].name] = model.arcs[n].latency_s / model.scale_s
    for i, var in enumerate(model.after):
        values[var.name] = float(sum(1 for st in partition if st.start >= i))
    return values


def _extract(tab: ClassTables, model: _Model) -> Partition:
    """Follow the chosen stages from block 0 (HiGHS keeps binaries within its integrality tolerance)."""
    chosen = {a.start: a for v, a in zip(model.x, model.arcs) if (v.varValue or 0.0) > 0.5}
    stages, start = [], 0
    while True:
        arc = chosen[start]
        stages.append((arc.start, arc.stop, arc.cls))
        if arc.nxt < 0:
            return assign_devices(tab.classes, stages)
        start = arc.stop


def solve_ilp(problem: Problem, *, time_limit_s: float = 60.0, gap_rel: float = 1e-4,
              warm_start: Partition | None = None, threads: int = 1, seed: int = 0) -> IlpResult:
    """Solve the ILP; falls back to ``warm_start`` (and says so) when the solver returns nothing better.

    Raises ``InfeasibleError`` when no split fits in memory.
    """
    if not time_limit_s > 0:
        raise PlannerError(f"--time-limit must be positive seconds, found {time_limit_s}")
    if not 0 <= gap_rel < 1:
        raise PlannerError(f"the relative gap must be in [0, 1), found {gap_rel}")
    tab = class_tables(problem)
    start = _feasible(problem, warm_start)
    start_s = step_time_formula_s(problem, start) if start else np.inf
    model = _build(problem, tab, start_s)
    start_values = _start_values(tab, model, start) if start else None
    # presolve off: HiGHS 1.15's presolve declared some pruned models infeasible that have feasible (and
    # better) solutions, and then returned the warm start as "Optimal" with an infinite bound; the
    # solve is as fast without it on these models.
    solver = HiGHS(start_values, msg=False, timeLimit=time_limit_s, gapRel=gap_rel, threads=threads,
                    random_seed=seed, presolve="off")
    with solver_output_to_log():
        model.lp.solve(solver)
    highs = model.lp.solverModel
    info, status = highs.getInfo(), highs.modelStatusToString(highs.getModelStatus())
    record: dict[str, Any] = {
        "name": "HiGHS", "via": f"PuLP {pulp.__version__}", "status": status, "time_limit_s": time_limit_s,
        "gap_rel": gap_rel, "threads": threads, "seed": seed, "nodes": int(info.mip_node_count),
        "warm_start_s": start_s if start else None, "candidate_stages": len(model.arcs),
        "constraints": model.lp.numConstraints()}
    found = None
    if info.primal_solution_status == 2:  # kSolutionStatusFeasible: HiGHS holds an integer solution
        found = _extract(tab, model)
        record["ilp_objective_s"] = float(info.objective_function_value) * model.scale_s
    bound = float(info.mip_dual_bound) * model.scale_s if np.isfinite(info.mip_dual_bound) else 0.0
    proven = status == "Optimal" and np.isfinite(info.mip_dual_bound)
    record["tolerances"] = tolerances(highs, model.scale_s)
    return _choose(problem, found, start, max(bound, 0.0), proven, record)


def _feasible(problem: Problem, partition: Partition | None) -> Partition | None:
    if partition is None:
        return None
    try:
        check_fits(problem, partition)
    except PlannerError:
        log.info("ilp: the warm start does not fit in memory; solving without it")
        return None
    return partition


def _choose(problem: Problem, found: Partition | None, start: Partition | None, bound_s: float, proven: bool,
            record: dict[str, Any]) -> IlpResult:
    """The solver's plan, or the warm start where the solver found nothing better; status, bound and gap."""
    found_s = step_time_formula_s(problem, found) if found else np.inf
    start_s = step_time_formula_s(problem, start) if start else np.inf
    if found is None and start is None:
        raise InfeasibleError(no_fit_message(problem, f"ilp (HiGHS: {record['status']})"))
    if found is not None and found_s <= start_s:
        chosen, value, returned = found, found_s, "solver"
    else:
        chosen, value, returned = start, start_s, "warm start"
        log.warning("ilp: the solver returned nothing better than its warm start (HiGHS: %s); "
                    "returning the warm start", record["status"])
    bound_s = min(bound_s, value)
    gap = (value - bound_s) / value if value > 0 else 0.0
    tolerances = record["tolerances"]
    if proven and (gap <= tolerances["mip_rel_gap"] + 1e-12 or value - bound_s <= tolerances["abs_gap_s"]):
        status = "optimal"  # the solver's bound proves the returned plan (its own or the warm start), by its own rule
    else:
        status = "feasible" if returned == "solver" else "warm-start"
    record["returned"] = returned
    record.update({"result": status, "bound_s": bound_s, "gap": gap, "objective_s": value})
    return IlpResult(chosen, value, status, bound_s, gap, record)


def lp_bound_s(problem: Problem, *, incumbent_s: float = np.inf, time_limit_s: float = 60.0) -> float:
    """The LP relaxation's optimum: a lower bound on every plan's step-time formula (seconds).

    With ``incumbent_s`` (a feasible plan's value) it relaxes the model the ILP solves, with the stages
    that cannot beat the incumbent left out; the bound stays valid for the optimum.
    """
    tab = class_tables(problem)
    model = _build(problem, tab, incumbent_s, relax=True)
    with solver_output_to_log():
        model.lp.solve(pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1, mip=False, presolve="off"))
    if model.lp.status != pulp.LpStatusOptimal:
        raise InfeasibleError(f"the LP relaxation has no optimum (status {pulp.LpStatus[model.lp.status]})")
    return float(pulp.value(model.lp.objective)) * model.scale_s


def ilp_placer(problem: Problem, *, weights: Mapping[str, float] | None = None, time_limit_s: float = 60.0,
               gap_rel: float = 1e-4, warm_start: bool = True, **options: Any) -> Partition:
    """The registered ``ilp`` method: warm-started from the greedy placer with the same weights; the plan
    records the solver's status, bound and gap under ``solver``."""
    result = ilp_result(problem, weights=weights, time_limit_s=time_limit_s, gap_rel=gap_rel, warm_start=warm_start,
                        **options)
    return Placed(result.partition, {"solver": result.solver})


def ilp_result(problem: Problem, *, weights: Mapping[str, float] | None = None, time_limit_s: float = 60.0,
               gap_rel: float = 1e-4, warm_start: bool = True, **options: Any) -> IlpResult:
    """``ilp_placer`` with the solver's record (status, bound, gap) for the plan's ``solver`` field."""
    if options:
        raise PlannerError(f"the ilp method takes time_limit_s, gap_rel and warm_start; found {', '.join(sorted(options))}")
    start = None
    if warm_start:
        try:
            start = greedy.place(problem, weights=weights or {})
        except PlannerError as exc:
            log.info("ilp: no greedy warm start (%s)", exc)
    return solve_ilp(problem, time_limit_s=time_limit_s, gap_rel=gap_rel, warm_start=start)


