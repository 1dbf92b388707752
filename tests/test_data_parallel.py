"""The data-parallel room of the runtime: degree 1 combines nothing; a plan with replicas is refused in one line."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest
import torch
from _plan_cases import make_plan, toy_cluster, toy_profile

from planner.errors import PlanMismatchError
from planner.runtime.data_parallel import SingleReplica, degree_of, sync_for


def test_a_pure_pipeline_has_degree_one_and_combines_nothing() -> None:
    plan = make_plan(toy_profile(), toy_cluster(), (3, 5))
    assert degree_of(plan) == 1
    sync = sync_for(plan)
    assert isinstance(sync, SingleReplica)
    params = {"w": torch.nn.Parameter(torch.ones(2))}
    params["w"].grad = torch.full((2,), 3.0)
    sync.after_backward(params)
    sync.after_step(params)
    assert params["w"].grad.tolist() == [3.0, 3.0] and params["w"].tolist() == [1.0, 1.0]


def test_a_plan_with_replicas_is_refused_until_the_runtime_can_run_it() -> None:
    plan = make_plan(toy_profile(), toy_cluster(), (3, 5))
    replicated = replace(plan, extra=MappingProxyType({**plan.extra, "data_parallel": {"degree": 2}}))
    assert degree_of(replicated) == 2
    with pytest.raises(PlanMismatchError, match="degree 2.*pure pipelines only"):
        sync_for(replicated)
