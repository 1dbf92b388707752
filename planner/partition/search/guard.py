"""The simulator's check on the exact methods: "optimal" never loses to a baseline.

DP and ILP minimise the step-time *formula* (``sum_k L_k + (m - 1) max_k L_k`` with each cut's transfer
added to its stages; docs/exact-methods.md). The simulator, which ranks the plans, overlaps GPU transfers
with compute but not the host copies of CPU ranks, and sees the 1F1B warm-up; so on some clusters (``cpu-2``
among the bundled ones) a baseline's plan simulates faster than the formula's optimum. ``check`` simulates the
peers' baselines on the same problem; when one is faster it polishes the exact plan against the simulator
(``search/polish.py``, which also descends from the time-balanced split) and from the best baseline's plan,
and keeps the fastest. The solver record then says which objective "optimal" refers to and what the check
did: ``result`` stays ``optimal`` only for a plan no baseline beats in the simulator.
"""

from __future__ import annotations

from planner.errors import PlannerError
from planner.partition.model.cost import step_time_s
from planner.partition.model.problem import Partition, Placed, Problem, facts_of
from planner.partition.placers import baselines
from planner.partition.search.polish import polish

__all__ = ["OBJECTIVE", "check"]

OBJECTIVE = "step-time formula: sum of stage latencies + (m - 1) x the largest, each cut's transfer on its stages"
BASELINES = {"uniform": baselines.uniform, "params": baselines.params, "time-balance": baselines.time_balance}


def check(problem: Problem, chosen: Partition, improve: bool = True) -> Partition:
    """``chosen`` if no baseline simulates faster, else the fastest polished plan; the record says which.
    With ``improve=False`` (``--refine`` with its polish turned off) the plan is kept and only relabelled."""
    facts = facts_of(chosen)
    solver = dict(facts.get("solver") or {})
    if solver.get("result") != "optimal":
        return chosen
    step = step_time_s(problem, chosen)
    tried = {}
    for name, placer in BASELINES.items():
        try:
            plan = placer(problem)
            tried[name] = (step_time_s(problem, plan), plan)
        except PlannerError:  # a baseline that does not fit here is no rival
            continue
    solver["objective"] = OBJECTIVE
    if not tried or min(t for t, _ in tried.values()) >= step * (1 - 1e-9):
        solver["simulated"] = {"step_time_s": step, "best_baseline_s": min((t for t, _ in tried.values()), default=None),
                               "action": "no baseline simulates faster"}
        return Placed(chosen, {**facts, "solver": solver})
    rival, (rival_s, rival_plan) = min(tried.items(), key=lambda item: (item[1][0], item[0]))
    if not improve:
        solver.update(result=f"optimal for the formula; {rival} simulates faster", formula_result="optimal",
                      simulated={"step_time_s": step, "best_baseline": rival, "best_baseline_s": rival_s,
                                 "action": "kept (polish off)"})
        return Placed(chosen, {**facts, "solver": solver})
    scored = [(step_time_s(problem, p), i, p) for i, p in enumerate((polish(problem, chosen).partition,
                                                                      polish(problem, rival_plan).partition))]
    best_s, _, best = min(scored, key=lambda item: item[:2])
    solver.update(result="optimal for the formula; polished against the simulator", formula_result="optimal",
                  simulated={"formula_plan_s": step, "best_baseline": rival, "best_baseline_s": rival_s,
                             "step_time_s": best_s, "action": "polished: a baseline simulated faster than the "
                             "formula's optimum"})
    return Placed(best, {**facts, "solver": solver})
