"""The data-parallel room of the runtime: degree 1 combines nothing; ssgd runs; other sync modes are refused in one line."""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import pytest
import torch
from _plan_cases import make_plan, toy_cluster, toy_profile

from planner.errors import PlanMismatchError
from planner.runtime.data_parallel import SingleReplica, Synchronous, sync_for


def test_a_pure_pipeline_has_degree_one_and_combines_nothing() -> None:
    plan = make_plan(toy_profile(), toy_cluster(), (3, 5))
    assert plan.shape().degree == 1
    sync = sync_for(plan)
    assert isinstance(sync, SingleReplica)
    params = {"w": torch.nn.Parameter(torch.ones(2))}
    params["w"].grad = torch.full((2,), 3.0)
    sync.after_backward(params)
    sync.after_step(params)
    assert params["w"].grad.tolist() == [3.0, 3.0] and params["w"].tolist() == [1.0, 1.0]


def test_ssgd_is_the_synchronous_mode_and_other_modes_are_refused_in_one_line() -> None:
    plan = make_plan(toy_profile(), toy_cluster(), (3, 5))
    stages = tuple(replace(st, extra=MappingProxyType({**st.extra, "replicas": [st.device, f"{st.device}-copy"]}))
                   for st in plan.stages)  # the degree is what the stages' replicas say
    plan = replace(plan, stages=stages)
    replicated = replace(plan, extra=MappingProxyType({**plan.extra, "data_parallel": {"degree": 2, "sync": "ssgd"}}))
    assert replicated.shape().degree == 2
    sync = sync_for(replicated)
    assert isinstance(sync, Synchronous) and sync.reduces_in_backward and sync.microbatches == plan.microbatches
    other = replace(plan, extra=MappingProxyType({**plan.extra, "data_parallel": {"degree": 2, "sync": "easgd"}}))
    with pytest.raises(PlanMismatchError, match="data_parallel.sync is .easgd.*ssgd, local-sgd, adaptive, bsp"):
        sync_for(other)
    served = replace(plan, stages=plan.stages[:1],
                     extra=MappingProxyType({**plan.extra, "data_parallel": {"degree": 2, "sync": "dasp"}}))
    with pytest.raises(PlanMismatchError, match="parameter server rank that `plan run` starts"):
        sync_for(served)  # the library's pipeline runtime cannot run it


def _weighted(rank: int, world: int) -> None:
    import torch.distributed as dist

    shares = (3, 1)  # replica r summed its gradient over shares[r] micro-batches of gradient (r + 1) each
    sync = Synchronous(dist.group.WORLD, sum(shares))
    w = torch.nn.Parameter(torch.zeros(2))
    w.grad = torch.full((2,), float(shares[rank] * (rank + 1)))
    sync.after_backward({"w": w})
    assert w.grad.tolist() == [(3 * 1 + 1 * 2) / 4] * 2  # the mean over all 4 micro-batches


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ssgd_weighs_each_replica_by_its_micro_batches() -> None:
    from _gloo import run_ranks

    run_ranks(_weighted, 2, timeout_s=90)
