"""The simulator's check on the exact methods: a plan called "optimal" never loses to greedy or a baseline.

DP and ILP minimise the step-time *formula* (``sum_k L_k + (m - 1) max_k L_k`` with each cut's transfer
added to its stages; docs/exact-methods.md). The simulator, which ranks the plans, overlaps GPU transfers
with compute but not the host copies of CPU ranks, and sees the 1F1B warm-up; so on some clusters a rival's
plan simulates faster than the formula's optimum. ``check`` places the same problem with the rivals
(``RIVALS``: the greedy placer of the rebalancing patent and the peers' baselines), keeps those whose plans pass the
feasibility rule (a rival that does not fit in memory is no rival, and is never polished into the result),
and simulates them; it also polishes the exact plan against the simulator (``search/polish.py``, which only
takes moves that fit). When a rival or the polish is faster, the fastest of the polished exact plan and the
polished best rival is kept. The solver record then says what the check did: ``result`` stays ``optimal``
only for a plan that neither a rival nor the polish beats in the simulator; otherwise it is ``best found``,
with ``formula_result: optimal`` naming what was proven.
"""

from __future__ import annotations

from typing import Callable, Mapping

from planner.errors import PlannerError
from planner.partition.model.cost import step_time_s
from planner.partition.model.feasibility import violations
from planner.partition.model.problem import Partition, Problem, facts_of, placement_orders, with_facts
from planner.partition.placers import baselines, greedy
from planner.partition.search.polish import polish

__all__ = ["OBJECTIVE", "RIVALS", "BEST_FOUND", "check"]

OBJECTIVE = "step-time formula: sum of stage latencies + (m - 1) x the largest, each cut's transfer on its stages"
BEST_FOUND = "best found"
"""The ``result`` of an exact method's plan that a rival beat in the simulator (no claim of optimality)."""
RIVALS: Mapping[str, Callable[[Problem], Partition]] = {
    "greedy": greedy.place, "uniform": baselines.uniform, "params": baselines.params,
    "time-balance": baselines.time_balance}
READ_THE_ORDER = ("uniform", "params", "time-balance")
"""The rivals whose plan depends on the order the cluster lists its devices (stage ``i`` on the ``i``-th device)."""


def check(problem: Problem, chosen: Partition, improve: bool = True) -> Partition:
    """``chosen`` if no rival simulates faster, else the fastest polished plan; the record says which.
    With ``improve=False`` (``--refine`` with its polish turned off) the plan is kept and only relabelled."""
    facts = facts_of(chosen)
    solver = dict(facts.get("solver") or {})
    if solver.get("result") != "optimal":
        return chosen
    step = step_time_s(problem, chosen)
    tried = _rivals(problem)
    if improve:
        tried["polish"] = (step_time_s(problem, polished := polish(problem, chosen).partition), polished)
    solver["objective"] = OBJECTIVE
    if not tried or min(t for t, _ in tried.values()) >= step * (1 - 1e-9):
        solver["simulated"] = {"step_time_s": step, "best_rival_s": min((t for t, _ in tried.values()), default=None),
                               "rivals": sorted(tried), "action": "no rival simulates faster"}
        return with_facts(chosen, {"solver": solver})
    rival, (rival_s, rival_plan) = min(tried.items(), key=lambda item: (item[1][0], item[0]))
    solver.update(result=BEST_FOUND, formula_result="optimal")
    if not improve:
        solver["simulated"] = {"step_time_s": step, "best_rival": rival, "best_rival_s": rival_s,
                               "action": "kept (polish off)"}
        return with_facts(chosen, {"solver": solver})
    scored = [(rival_s, 0, rival_plan)]
    if rival != "polish":
        scored.append((step_time_s(problem, p := polish(problem, rival_plan).partition), 1, p))
    best_s, _, best = min(scored, key=lambda item: item[:2])
    solver["simulated"] = {"formula_plan_s": step, "best_rival": rival, "best_rival_s": rival_s, "step_time_s": best_s,
                           "action": "the formula's optimum simulated slower than " + (
                               "its own polish" if rival == "polish" else f"{rival}'s plan") + "; kept the fastest "
                               "polished plan"}
    return with_facts(chosen, {"solver": solver}, stages=best)


def _rivals(problem: Problem) -> dict[str, tuple[float, Partition]]:
    """Each rival's fastest plan that fits, with its simulated step time. A rival that reads the device order (the
    baselines put stage ``i`` on the ``i``-th device) places from each of ``placement_orders``; ties go to the first."""
    out: dict[str, tuple[float, Partition]] = {}
    orders = placement_orders(problem)
    for name, placer in RIVALS.items():
        for ordered in orders if name in READ_THE_ORDER else (problem,):
            try:
                plan = placer(ordered)
            except PlannerError:  # nothing of this rival's fits here
                continue
            if violations(problem, plan):
                continue
            time_s = step_time_s(problem, plan)
            if name not in out or time_s < out[name][0]:
                out[name] = (time_s, plan)
    return out
