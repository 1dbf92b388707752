"""The DP placer: golden optima by hand, memory under the schedule, its limits and its errors."""

from __future__ import annotations

import pytest

from _exact_cases import fast_and_slow, identical_two, memory_bound, problem, cluster, small_device_last, FAST, BIG
from planner.errors import InfeasibleError, PlannerError
from planner.partition.placers import dp
from planner.partition.placers.dp import dp_placer, solve_dp
from planner.partition.placers.registry import facts_of
from planner.partition.model.objective import stage_latencies_s, step_time_formula_s


def _split(result: dp.DPResult) -> list[tuple[int, int, str]]:
    return [(st.start, st.stop, st.device) for st in result.partition]


def test_identical_devices_split_evenly() -> None:
    result = solve_dp(identical_two())
    assert _split(result) == [(0, 2, "d0"), (2, 4, "d1")]
    assert result.objective_s == pytest.approx(30.0)


def test_fast_device_takes_three_times_the_work() -> None:
    result = solve_dp(fast_and_slow())
    assert result.objective_s == pytest.approx(45.0)
    sizes = {st.device: st.stop - st.start for st in result.partition}
    assert sizes == {"fast0": 3, "slow0": 1}


def test_memory_bound_optimum_leaves_the_fast_device_under_used() -> None:
    result = solve_dp(memory_bound())
    assert result.objective_s == pytest.approx(111.0)
    assert {st.device: st.stop - st.start for st in result.partition} == {"fast0": 1, "slow0": 3}


def test_1f1b_memory_puts_the_small_device_last() -> None:
    prob = small_device_last()
    result = solve_dp(prob)
    assert result.partition[-1].device == "tiny"
    assert result.partition[-1].stop - result.partition[-1].start == 1
    assert result.objective_s == pytest.approx(step_time_formula_s(prob, result.partition))
    assert max(stage_latencies_s(prob, result.partition)) == pytest.approx(6.0)


def test_one_micro_batch_prefers_one_stage_on_the_fastest_device() -> None:
    # m = 1: the step is the sum of latencies, so splitting only adds transfer
    prob = problem([1.0] * 4, cluster(("s", "slow", BIG), ("f", FAST, BIG)), microbatches=1, cut_bytes=10**12)
    assert _split(solve_dp(prob)) == [(0, 4, "f")]


def test_segments_restrict_the_stages() -> None:
    result = solve_dp(identical_two(), segments=[(0, 1), (1, 4)])
    assert [(st.start, st.stop) for st in result.partition] == [(0, 1), (1, 4)]


def test_nothing_fits_is_one_line_infeasible_error() -> None:
    prob = problem([1.0] * 2, cluster(("a", FAST, 1), ("b", FAST, 1)), param_bytes=10)
    with pytest.raises(InfeasibleError) as info:
        solve_dp(prob)
    assert "\n" not in str(info.value)


def test_state_space_limit_names_the_alternative(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "MAX_STATES", 2)
    with pytest.raises(PlannerError, match="use --method ilp"):
        solve_dp(identical_two())


def test_placer_records_its_result_and_rejects_options() -> None:
    placed = dp_placer(identical_two(), weights={})
    assert facts_of(placed)["solver"]["result"] == "optimal"
    assert facts_of(placed)["solver"]["objective_s"] == pytest.approx(30.0)
    with pytest.raises(PlannerError, match="takes no options"):
        dp_placer(identical_two(), weights={}, time_limit_s=3)
