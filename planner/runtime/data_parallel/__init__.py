"""The data-parallel layer: the replicas of this rank's stages and how they combine their updates.

A rank trains the stages the plan gives it; with a plan's ``data_parallel.degree`` d > 1 the same stages
also live on d - 1 other ranks, and after every step (or every few, for local steps) the replicas combine
their updates. The worker calls one ``UpdateSync`` per rank at two points of a step:

- ``after_backward(params)``: the step's gradients are complete (accumulated over this replica's
  micro-batches and averaged by ``pipeline.stages.average_grads``); a synchronous mode averages them here;
- ``after_step(params)``: the optimizer has stepped; a mode that averages parameters does it here.

``SingleReplica`` (degree 1: pure pipelines) is the only mode this runtime has today, so ``sync_for``
refuses a plan with replicas in one line rather than training each replica alone.
"""

from __future__ import annotations

from typing import Mapping, Protocol

from torch import nn

from planner.errors import PlanMismatchError
from planner.formats.plan import Plan

__all__ = ["UpdateSync", "SingleReplica", "degree_of", "sync_for"]


class UpdateSync(Protocol):
    """How the replicas of a rank's stages combine their updates (see the module docstring)."""

    mode: str

    def after_backward(self, params: Mapping[str, nn.Parameter]) -> None: ...

    def after_step(self, params: Mapping[str, nn.Parameter]) -> None: ...


class SingleReplica:
    """Degree 1: nothing to combine."""

    mode = "none"

    def after_backward(self, params: Mapping[str, nn.Parameter]) -> None:
        return None

    def after_step(self, params: Mapping[str, nn.Parameter]) -> None:
        return None


def degree_of(plan: Plan) -> int:
    """The plan's data-parallel degree: ``data_parallel.degree``, else the length of the stages' ``replicas``, else 1."""
    dp = plan.extra.get("data_parallel")
    if isinstance(dp, Mapping) and "degree" in dp:
        return int(dp["degree"])
    replicas = [len(s.extra.get("replicas") or [s.device]) for s in plan.stages]
    return max(replicas, default=1)


def sync_for(plan: Plan) -> UpdateSync:
    """The ``UpdateSync`` of ``plan``; a plan with replicas is refused until this runtime can run one."""
    degree = degree_of(plan)
    if degree != 1:
        raise PlanMismatchError(f"the plan replicates its stages {degree} times (data_parallel degree {degree}), but "
                                f"this version of plan run executes pure pipelines only (degree 1); re-partition "
                                f"without replicas")
    return SingleReplica()
