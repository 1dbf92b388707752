"""The offline S3-S6 loop: the runtime's rebalancer fed with simulated rounds; rounds recorded, weights moved
towards waiting devices, convergence. The balance rule and the weight move themselves are tested once, in
test_rebalance.py, because there is one implementation."""

from __future__ import annotations

import pytest

from _placer_cases import GIB, free_cluster, mixed_cluster, ops
from planner.errors import PlannerError
from planner.partition import RebalanceConfig, RefineConfig, partition
from planner.partition.search.rebalance import imbalance, normalise_weights
from planner.partition.search.refine import _simulated_round, refine
from planner.partition.model.problem import build_problem
from planner.partition.validate import assert_valid_plan


def test_balanced_plan_converges_in_one_round() -> None:
    prof = ops([1.0] * 4)
    result = partition(prof, free_cluster(2), method="greedy", microbatches=4, schedule="1f1b", refine=True)
    assert_valid_plan(result, prof)
    record = result.extra["refine"]
    assert record["converged"] and record["stop"] == "balanced"
    assert len(record["rounds"]) == 1
    first = record["rounds"][0]
    assert first["weights"] == {"d0": 1.0, "d1": 1.0}
    assert set(first["waits"]) == {"d0", "d1"} and first["changed"] is True
    assert first["step_time_s"] == pytest.approx(result.step_time_s)


def test_unbalanced_rounds_are_recorded_and_the_best_plan_kept() -> None:
    prof = ops([2, 1, 3, 1, 0.5, 2, 0.25, 1, 2, 1], types=("fast", "slow"), speed={"fast": 3.0})
    clus = mixed_cluster(("s0", "slow", GIB), ("f0", "fast", GIB), ("s1", "slow", GIB), ("s2", "slow", GIB),
                         bandwidth_Bps=1e5, latency_s=0.01)
    result = partition(prof, clus, method="greedy", microbatches=4, schedule="1f1b", refine=True)
    assert_valid_plan(result, prof)
    record = result.extra["refine"]
    rounds = record["rounds"]
    assert len(rounds) >= 2
    assert result.step_time_s <= min(r["step_time_s"] for r in rounds) * (1 + 1e-12)  # polish only improves
    assert result.step_time_s == pytest.approx(record["polish"]["step_time_s"])
    assert record["polish"]["start_step_time_s"] == pytest.approx(min(r["step_time_s"] for r in rounds))
    assert result.extra["weights"] == pytest.approx(rounds[record["best_round"]]["weights"])
    assert not rounds[0]["balanced"]  # the last stage holds one op and waits
    assert rounds[1]["weights"]["s1"] > rounds[0]["weights"]["s1"]  # so it gets weight
    for r in rounds:
        assert sum(r["weights"].values()) == pytest.approx(4.0)
    assert record["stop"] in ("balanced", "no new partition", "max_rounds")
    assert record["converged"] == (record["stop"] != "max_rounds")


def test_refine_is_deterministic() -> None:
    prof = ops([0.5, 2.0, 0.25, 1.0, 3.0, 0.75], types=("fast", "slow"), speed={"fast": 2.0})
    clus = mixed_cluster(("s0", "slow", GIB), ("f0", "fast", GIB), bandwidth_Bps=1e3)
    args = dict(method="greedy", microbatches=4, schedule="1f1b", refine=True)
    assert partition(prof, clus, **args).to_dict() == partition(prof, clus, **args).to_dict()


def test_max_rounds_bounds_the_loop() -> None:
    prof = ops([0.5, 2.0, 0.25, 1.0, 3.0, 0.75, 1.5, 0.5], types=("fast", "slow"), speed={"fast": 3.0})
    clus = mixed_cluster(("s0", "slow", GIB), ("f0", "fast", GIB), ("s1", "slow", GIB), bandwidth_Bps=2e3)
    problem = build_problem(prof, clus, microbatches=3, schedule="gpipe")
    result = refine(problem, "greedy", {}, {}, RefineConfig(RebalanceConfig(threshold=0.0, max_rounds=2, patience=5)))
    assert len(result.record["rounds"]) <= 2


def test_the_offline_threshold_means_what_it_means_at_run_time() -> None:
    """A simulated round is judged by the same measure as a measured one: max wait above the mean, as a
    fraction of the round (one step)."""
    prof = ops([2, 1, 3, 1], types=("fast", "slow"), speed={"fast": 3.0})
    clus = mixed_cluster(("s0", "slow", GIB), ("f0", "fast", GIB), bandwidth_Bps=1e5)
    problem = build_problem(prof, clus, microbatches=4, schedule="1f1b")
    plan = partition(prof, clus, method="greedy", microbatches=4, schedule="1f1b", refine=True,
                     refine_config=RefineConfig(RebalanceConfig(threshold=0.0, max_rounds=1)))
    first = plan.extra["refine"]["rounds"][0]
    from planner.partition.model.problem import StageSpec

    blocks = {b.nodes[0]: i for i, b in enumerate(problem.blocks)}
    spec = tuple(StageSpec(blocks[s.nodes[0]], blocks[s.nodes[0]] + len(s.nodes), s.device) for s in plan.stages)
    stats = _simulated_round(problem, spec, 0)
    waits = stats.waits()
    expected = (max(waits.values()) - sum(waits.values()) / len(waits)) / stats.wall_s
    assert imbalance(stats) == pytest.approx(expected)
    assert first["balanced"] == (expected <= 0.0)


def test_a_method_without_weights_gets_one_round_then_polish() -> None:
    prof = ops([1.0] * 4)
    plan = partition(prof, free_cluster(2), method="uniform", microbatches=2, schedule="1f1b", refine=True)
    assert_valid_plan(plan, prof)
    record = plan.extra["refine"]
    assert len(record["rounds"]) == 1 and record["stop"] == "method ignores weights" and record["converged"]
    assert "weights" not in plan.extra and "polish" in record


@pytest.mark.parametrize("weights,match", [({"zz": 1.0}, "not one of the devices"), ({"d0": 0.0}, "positive finite"),
                                           ({"d0": float("nan")}, "positive finite")])
def test_bad_weights_are_rejected(weights: dict[str, float], match: str) -> None:
    with pytest.raises(PlannerError, match=match):
        partition(ops([1.0] * 4), free_cluster(2), method="greedy", microbatches=2, schedule="1f1b", weights=weights)


def test_weights_are_normalised_to_mean_one() -> None:
    assert normalise_weights({"a": 3.0}, ("a", "b")) == pytest.approx({"a": 1.5, "b": 0.5})


def test_bad_config_is_rejected() -> None:
    with pytest.raises(PlannerError, match="patience"):
        RefineConfig(RebalanceConfig(patience=0))
    with pytest.raises(PlannerError, match="max_rounds"):
        RefineConfig(RebalanceConfig(max_rounds=0))
