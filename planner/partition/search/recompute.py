"""Which stages recompute their activations, under ``--recompute auto`` (docs/cost-model.md, "Recomputation").

A placer sees one problem: either no stage recomputes or every stage does (``Problem.recompute``), because its cost
tables price a range of blocks one way. Under ``recompute="auto"``, ``partition`` places with it everywhere and then
hands the split here, which takes it away again from every stage whose device still holds its saved activations: those
stages stop paying their forward twice, and the plan records ``recompute: "full"`` only on the stages that need it.
(``plan partition --recompute auto`` then keeps this plan or the one without recomputation, the faster.)

The order is the stage whose recomputation costs its pipeline the most first (its forward seconds per micro-batch,
times its replicas' micro-batches), so where two stages share a device that cannot hold both sets of activations the
one that saves more keeps them. With one stage per device each stage's choice touches only its own device's memory,
so the result is exact: no other choice of recomputing stages for this split fits and is faster. With several
stages per device (interleaved and V schedules) it is greedy. Deterministic: ties go to the earlier stage.
"""

from __future__ import annotations

from dataclasses import replace

from planner.partition.model.cost import recomputes, stage_fwd_bwd_s
from planner.partition.model.feasibility import violations
from planner.partition.model.problem import Partition, Placed, Problem, StageSpec, shares_of

__all__ = ["recompute_where_needed"]


def recompute_where_needed(problem: Problem, partition: Partition) -> Partition:
    """``partition`` with recomputation turned off on every stage that fits without it, most costly first (module
    docstring). Every stage gets an explicit ``recompute``, and its shares and facts are kept; a partition that does
    not fit even so keeps recomputing everywhere (no trial fits)."""
    tables = problem.tables
    stages = [replace(st, recompute=recomputes(tables, st)) for st in partition]
    shares = shares_of(partition, problem.microbatches)

    def cost(i: int) -> float:  # the forward seconds the stage runs again per step, over its replicas
        st = stages[i]
        return sum(stage_fwd_bwd_s(tables, device, st.start, st.stop)[0] * m for device, m in zip(st.devices, shares))

    for i in sorted((i for i, st in enumerate(stages) if st.recompute), key=lambda i: (-cost(i), i)):
        trial = list(stages)
        trial[i] = replace(stages[i], recompute=False)
        if not violations(problem, _like(partition, trial)):
            stages = trial
    return _like(partition, stages)


def _like(partition: Partition, stages: list[StageSpec]) -> Partition:
    """``stages`` as a partition carrying ``partition``'s facts and shares (a ``Placed``) when it has them."""
    if isinstance(partition, Placed):
        return Placed(tuple(stages), partition.facts, shares=partition.shares)
    return tuple(stages)
