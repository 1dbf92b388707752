"""Every registered placer, on every bundled cluster and a few profiles, yields a valid plan.

The invariant checker (``validate_plan``) is the oracle; the profiles are seeded synthetic graphs with
residual edges, so values skip ops and cuts carry more than one tensor.
"""

from __future__ import annotations

from functools import lru_cache

import pytest

from planner.clusters import bundled_clusters, load_cluster_spec
from planner.errors import InfeasibleError, PlannerError
from planner.formats.profile import Profile
from planner.partition import partition
from planner.partition.placers import registry as methods
from bench.synthetic import transformer_like
from planner.partition.validate import validate_plan

CLUSTERS = bundled_clusters()
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@lru_cache(maxsize=None)
def types_of_bundled() -> tuple[str, ...]:
    return tuple(sorted({d.type for name in CLUSTERS for d in load_cluster_spec(name).devices}))


@lru_cache(maxsize=None)
def synthetic(num_ops: int, seed: int) -> Profile:
    # Small tensors: every bundled cluster (the smallest device has 12 GiB) holds any split.
    return transformer_like(num_ops, ops_per_layer=5, device_types=types_of_bundled(), seed=seed,
                            activation_bytes=2**16, param_bytes=2**18)


def test_clusters_are_bundled() -> None:
    assert len(CLUSTERS) >= 3


@pytest.mark.parametrize("cluster_name", CLUSTERS)
@pytest.mark.parametrize("method", methods.names())
@pytest.mark.parametrize("num_ops,seed,schedule", [(7, 0, "1f1b"), (20, 1, "gpipe"), (20, 2, "interleaved-1f1b")])
def test_every_method_gives_a_valid_plan(cluster_name: str, method: str, num_ops: int, seed: int, schedule: str) -> None:
    profile, cluster = synthetic(num_ops, seed), load_cluster_spec(cluster_name)
    plan = partition(profile, cluster, method=method, microbatches=8, schedule=schedule)
    assert validate_plan(plan, profile) == []
    assert plan.method == method and plan.schedule == schedule
    assert set(plan.predicted["devices"]) == {stage.device for stage in plan.stages}


@pytest.mark.parametrize("cluster_name", CLUSTERS)
@pytest.mark.parametrize("method", ["greedy", "uniform", "params", "time-balance"])
def test_fast_methods_on_a_larger_graph(cluster_name: str, method: str) -> None:
    profile, cluster = synthetic(120, 7), load_cluster_spec(cluster_name)
    plan = partition(profile, cluster, method=method, microbatches=16, schedule="1f1b")
    assert validate_plan(plan, profile) == []


@pytest.mark.parametrize("method", methods.names())
def test_same_inputs_give_identical_plans(method: str) -> None:
    profile, cluster = synthetic(20, 3), load_cluster_spec("mixed-3type-2host")
    first = partition(profile, cluster, method=method, microbatches=4, schedule="1f1b").to_dict()
    assert partition(profile, cluster, method=method, microbatches=4, schedule="1f1b").to_dict() == first


@pytest.mark.parametrize("cluster_name", ["a100-8", "dgx-h100-8", "t4-4-pcie"])
@pytest.mark.parametrize("seed", [4, 5])
def test_greedy_matches_time_balance_on_identical_devices(cluster_name: str, seed: int) -> None:
    """Simulated step times (not wall clock): greedy is at most 2% slower than the time balance."""
    profile, cluster = synthetic(60, seed), load_cluster_spec(cluster_name)
    greedy = partition(profile, cluster, method="greedy", microbatches=8, schedule="1f1b")
    balanced = partition(profile, cluster, method="time-balance", microbatches=8, schedule="1f1b")
    assert greedy.step_time_s <= 1.02 * balanced.step_time_s


def test_greedy_refine_valid_on_a_mixed_cluster() -> None:
    profile, cluster = synthetic(40, 6), load_cluster_spec("mixed-a100-v100-pcie")
    plan = partition(profile, cluster, method="greedy", microbatches=8, schedule="1f1b", refine=True)
    assert validate_plan(plan, profile) == []
    assert plan.extra["refine"]["rounds"]


def test_unknown_method_lists_the_methods() -> None:
    from planner.errors import UsageError

    with pytest.raises(UsageError) as info:
        partition(synthetic(7, 0), load_cluster_spec("cpu-2"), method="magic", microbatches=2, schedule="1f1b")
    message = str(info.value)
    assert "unknown partition method 'magic'" in message
    for name in ("greedy", "uniform", "params", "time-balance"):
        assert name in message


def test_infeasible_everywhere_is_reported_for_every_method() -> None:
    profile = transformer_like(6, device_types=types_of_bundled(), param_bytes=2**40)
    for method in methods.names():
        with pytest.raises(InfeasibleError, match="largest device"):
            partition(profile, load_cluster_spec("cpu-2"), method=method, microbatches=2, schedule="1f1b")


def test_registry_lists_and_registers_methods() -> None:
    from planner.partition.placers.registry import METHODS, get, register, takes_weights
    from planner.partition.model.problem import StageSpec

    assert set(METHODS) == {"greedy", "uniform", "params", "time-balance", "ilp", "dp"}
    assert takes_weights("greedy") and not takes_weights("uniform")
    assert METHODS["greedy"] is get("greedy").fn

    def everything_on_the_last_device(problem, *, weights, **options):  # type: ignore[no-untyped-def]
        return (StageSpec(0, len(problem.blocks), problem.cluster.device_ids[-1]),)

    register("test-last-device", everything_on_the_last_device)
    try:
        plan = partition(synthetic(7, 0), load_cluster_spec("cpu-2"), method="test-last-device", microbatches=2,
                         schedule="1f1b")
        assert [s.device for s in plan.stages] == ["cpu1"] and "weights" not in plan.extra
    finally:
        from planner.partition.placers import registry

        registry._extra.pop("test-last-device")
    with pytest.raises(PlannerError, match="built in"):
        register("dp", everything_on_the_last_device)
