"""Golden tests of the peers' baselines: uniform layers, parameter balance, time balance."""

from __future__ import annotations

import functools
import itertools
import operator
import random

import pytest

from _placer_cases import GIB, devices, free_cluster, layered, mixed_cluster, ops, sizes
from planner.errors import InfeasibleError, UsageError
from planner.partition import partition
from planner.partition.placers.baselines import layer_units, min_max_split
from planner.partition.model.problem import build_problem
from planner.partition.validate import assert_valid_plan


def plan(prof, clus, method, **kwargs):
    kwargs.setdefault("microbatches", 4)
    kwargs.setdefault("schedule", "1f1b")
    result = partition(prof, clus, method=method, **kwargs)
    assert_valid_plan(result, prof)
    return result


def names(result) -> list[list[str]]:
    return [list(stage.nodes) for stage in result.stages]


def test_layer_units_group_runs_and_keep_glue_with_the_unit_before() -> None:
    problem = build_problem(layered(2), free_cluster(1), microbatches=1, schedule="gpipe")
    assert [(a, b, label) for a, b, label in layer_units(problem)] == [(0, 2, "wte"), (2, 4, "h.0"), (4, 6, "h.1"),
                                                                       (6, 7, "lm_head")]


def test_uniform_equal_layers_with_embedding_and_head_riding_along() -> None:
    result = plan(layered(4), free_cluster(2), "uniform")
    assert names(result) == [["x", "embed", "l0_0", "l0_1", "l1_0", "l1_1"], ["l2_0", "l2_1", "l3_0", "l3_1", "head"]]
    assert devices(result) == ["d0", "d1"]


def test_uniform_gives_the_remainder_to_the_first_stages() -> None:
    # DeepSpeed partition_uniform: 5 layers on 3 stages -> 2, 2, 1.
    result = plan(layered(5, ops_per_layer=1, embed=False, head=False), free_cluster(3), "uniform")
    assert names(result) == [["x", "l0_0", "l1_0"], ["l2_0", "l3_0"], ["l4_0"]]


def test_uniform_uses_no_more_stages_than_layers() -> None:
    result = plan(layered(2), free_cluster(4), "uniform")
    assert len(result.stages) == 2


def test_uniform_ignores_device_speed() -> None:
    prof = ops([1.0] * 4, types=("fast", "slow"), speed={"fast": 4.0})
    result = plan(prof, mixed_cluster(("s", "slow", GIB), ("f", "fast", GIB)), "uniform")
    assert sizes(result) == [3, 2] and devices(result) == ["s", "f"]


def test_params_balances_parameter_bytes() -> None:
    prof = ops([1.0] * 5, params=[1, 1, 1, 1, 4])
    result = plan(prof, free_cluster(2), "params")
    assert sizes(result) == [5, 1]  # 1+1+1+1 | 4


def test_time_balance_minimises_the_largest_stage_time_on_device_zero() -> None:
    prof = ops([1.0, 1.0, 1.0, 3.0])
    result = plan(prof, free_cluster(2), "time-balance")
    assert sizes(result) == [4, 1]


def test_time_balance_assumes_every_device_is_device_zeros_type() -> None:
    prof = ops([1.0] * 4, types=("fast", "slow"), speed={"fast": 4.0})
    result = plan(prof, mixed_cluster(("f", "fast", GIB), ("s", "slow", GIB)), "time-balance")
    assert sizes(result) == [3, 2]  # an even split although the second device is 4x slower


def test_baselines_do_not_check_memory_and_partition_reports_the_overflow() -> None:
    prof = ops([1.0] * 4, params=[100, 100, 100, 1000])
    clus = mixed_cluster(("a", "cpu", 10_000), ("b", "cpu", 3000))
    with pytest.raises(InfeasibleError, match="method 'uniform' made a split that does not fit"):
        partition(prof, clus, method="uniform", microbatches=2, schedule="1f1b")


def test_baselines_take_no_options() -> None:
    with pytest.raises(UsageError, match="takes no options"):
        partition(ops([1.0]), free_cluster(1), method="params", microbatches=1, schedule="gpipe", balance=3)


def brute_force(costs: list[float], parts: int) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), parts - 1):
        bounds = [0, *cuts, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_min_max_split_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    costs = [rng.choice([0.0, rng.uniform(0, 10), float(rng.randint(1, 5))]) for _ in range(rng.randint(1, 9))]
    parts = rng.randint(1, len(costs))
    bounds = min_max_split(costs, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == len(costs)
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    largest = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert largest == pytest.approx(brute_force(costs, parts), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("costs", [[0.1, 0.2, 0.3], [0.7, 0.1, 0.2, 0.3, 1e-9]])
def test_min_max_split_keeps_one_part_under_a_compensated_sum(costs, monkeypatch) -> None:
    """Python 3.12's ``sum`` is compensated (as ``math.fsum`` here), so the whole sum can fall below the running
    total ``_fill`` compares with: one part came back as two, and a 2-replica plan failed on the GPU machine."""
    import math

    from planner.partition.placers import baselines

    assert math.fsum(costs) < functools.reduce(operator.add, costs, 0.0)  # the case this test is about
    monkeypatch.setattr(baselines, "sum", math.fsum, raising=False)
    assert min_max_split(costs, 1) == [0, len(costs)]
    assert len(min_max_split(costs, 2)) == 3
