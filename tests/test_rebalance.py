"""The pure rebalancing loop (seed 003 S3-S6): golden answers on hand-made rounds."""

from __future__ import annotations

import pytest

from planner.errors import PlannerError
from planner.runtime.rebalance import (
    DeviceRound, RebalanceConfig, RebalanceState, RoundStats, decide, imbalance, initial_state,
    is_balanced, placer_weights, plans_equal, settle, speed_factors_from, update_weights,
)


def _round(compute: dict[str, float], wall_s: float, steps: int = 4) -> RoundStats:
    devices = tuple(DeviceRound(d, c, wall_s - c) for d, c in compute.items())
    return RoundStats(round=0, first_step=0, steps=steps, wall_s=wall_s, devices=devices)


def test_initial_weights_are_equal_or_the_plans() -> None:
    assert dict(initial_state(["a", "b"]).weights) == {"a": 1.0, "b": 1.0}
    state = initial_state(["a", "b"], {"a": 3.0, "b": 1.0})
    assert dict(state.weights) == {"a": 1.5, "b": 0.5}


@pytest.mark.parametrize("weights", [{"c": 1.0}, {"a": 0.0}, {"a": float("nan")}, {"a": "x"}])
def test_bad_plan_weights_are_refused(weights: dict) -> None:
    with pytest.raises(PlannerError, match="weight"):
        initial_state(["a", "b"], weights)


def test_imbalance_is_max_wait_above_mean_over_the_round() -> None:
    stats = _round({"a": 6.0, "b": 10.0, "c": 8.0}, wall_s=10.0)  # waits 4, 0, 2: mean 2, max 4
    assert imbalance(stats) == pytest.approx(0.2)
    assert not is_balanced(stats, 0.1)
    assert is_balanced(stats, 0.2)
    assert imbalance(_round({"a": 3.0}, wall_s=5.0)) == 0.0


def test_weights_move_in_proportion_to_waits_to_the_measured_speeds() -> None:
    # Equal loads; b computes twice as long, so a waits for it. The full move gives a twice b's share.
    stats = _round({"a": 4.0, "b": 8.0}, wall_s=9.0)
    weights = update_weights({"a": 1.0, "b": 1.0}, stats, {"a": 1.0, "b": 1.0})
    assert weights == pytest.approx({"a": 4 / 3, "b": 2 / 3})
    half = update_weights({"a": 1.0, "b": 1.0}, stats, {"a": 1.0, "b": 1.0}, gain=0.5)
    assert half == pytest.approx({"a": 7 / 6, "b": 5 / 6})


def test_weight_update_starts_from_the_load_actually_carried() -> None:
    # The plan gave a 60% of the (predicted) load although weights were equal; both ran at equal speed
    # per unit of load, so the new shares follow the loads and waits, not the stale weights.
    stats = _round({"a": 6.0, "b": 4.0}, wall_s=6.5)
    weights = update_weights({"a": 1.0, "b": 1.0}, stats, {"a": 0.6, "b": 0.4})
    # a: carried 1.2, no excess wait -> 1.2; b: carried 0.8 * (1 + 2/4) = 1.2 -> equal
    assert weights == pytest.approx({"a": 1.0, "b": 1.0})


def test_weight_update_skips_idle_devices_and_bounds_the_step() -> None:
    stats = RoundStats(0, 0, 1, 10.0, (DeviceRound("a", 0.1, 9.9), DeviceRound("b", 10.0, 0.0)))
    weights = update_weights({"a": 1.0, "b": 1.0, "c": 1.0}, stats, {"a": 1.0, "b": 1.0}, max_step=4.0)
    # a would stretch 100x; bounded to 4x. The devices that ran keep their total weight (2), and c,
    # which took no part, keeps its own.
    assert weights == pytest.approx({"a": 1.6, "b": 0.4, "c": 1.0})


def test_speed_factors_are_measured_over_predicted() -> None:
    stats = _round({"a": 3.0, "b": 8.0}, wall_s=9.0)
    factors = speed_factors_from(stats, {"a": 2.0, "b": 4.0, "c": 1.0}, {"c": 1.7, "a": 9.0})
    assert factors == pytest.approx({"a": 1.5, "b": 2.0, "c": 1.7})


def test_placer_weights_are_one_when_speed_factors_explain_the_weights() -> None:
    assert placer_weights({"a": 4 / 3, "b": 2 / 3}, {"a": 1.0, "b": 2.0}) == pytest.approx({"a": 1.0, "b": 1.0})
    assert placer_weights({"a": 1.0, "b": 1.0}, {"a": 1.0, "b": 3.0}) == pytest.approx({"a": 0.5, "b": 1.5})


def test_decide_replans_only_when_unbalanced() -> None:
    config = RebalanceConfig(threshold=0.1)
    state = initial_state(["a", "b"])
    unbalanced = decide(state, _round({"a": 4.0, "b": 8.0}, wall_s=9.0), {"a": 4.0, "b": 4.0}, config)
    assert unbalanced.replan and not unbalanced.balanced
    assert dict(unbalanced.state.speed_factors) == pytest.approx({"a": 1.0, "b": 2.0})
    assert placer_weights(unbalanced.state.weights, unbalanced.state.speed_factors) == pytest.approx({"a": 1.0, "b": 1.0})
    balanced = decide(state, _round({"a": 8.0, "b": 8.0}, wall_s=9.0), {"a": 4.0, "b": 4.0}, config)
    assert not balanced.replan and balanced.balanced
    assert dict(balanced.state.weights) == dict(state.weights)


def test_settle_counts_stable_rounds_and_converges_after_patience() -> None:
    config = RebalanceConfig(patience=2)
    state = initial_state(["a", "b"])
    state = settle(state, plan_changed=True, config=config)
    assert (state.stable_rounds, state.converged) == (0, False)
    state = settle(state, plan_changed=False, config=config)
    assert (state.stable_rounds, state.converged) == (1, False)
    state = settle(state, plan_changed=False, config=config)
    assert (state.stable_rounds, state.converged, state.rounds) == (2, True, 3)
    frozen = decide(state, _round({"a": 1.0, "b": 8.0}, wall_s=9.0), {"a": 1.0, "b": 1.0}, config)
    assert not frozen.replan and "converged" in frozen.reason


def test_state_round_trips_through_a_dict() -> None:
    state = settle(initial_state(["a", "b"], {"a": 2.0}), plan_changed=False, config=RebalanceConfig())
    assert RebalanceState.from_dict(state.to_dict()) == state
    with pytest.raises(PlannerError, match="rebalance state"):
        RebalanceState.from_dict({"speed_factors": {}})


@pytest.mark.parametrize("kwargs", [{"threshold": -1}, {"gain": 0}, {"gain": 1.5}, {"patience": 0},
                                    {"min_improvement": -0.1}, {"max_step": 1.0}])
def test_bad_config_is_refused(kwargs: dict) -> None:
    with pytest.raises(PlannerError):
        RebalanceConfig(**kwargs)


def test_plans_compare_by_device_and_nodes() -> None:
    assert plans_equal([("a", ["x", "y"]), ("b", ["z"])], [("a", ("x", "y")), ("b", ("z",))])
    assert not plans_equal([("a", ["x", "y"]), ("b", ["z"])], [("a", ["x"]), ("b", ["y", "z"])])
