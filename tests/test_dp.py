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


def _reference_least_sum(lat, counts: tuple[int, ...], nblocks: int, bound: float, limit: int) -> float:
    """``S(T)`` by the recurrence of docs/exact-methods.md, one state at a time (slow, and plainly written)."""
    import functools
    import math

    classes = range(len(counts))

    @functools.cache
    def from_here(b: int, c: int, used: tuple[int, ...]) -> float:
        """Least sum of the stages from block ``b`` on, the first on class ``c``, using ``used`` devices per class."""
        if sum(used) > limit or used[c] < 1:
            return math.inf
        rest = tuple(n - (k == c) for k, n in enumerate(used))
        best = float(lat.last[c, b]) if lat.last[c, b] <= bound and sum(rest) == 0 else math.inf
        for e in range(b + 1, nblocks):
            if sum(used) > lat.room[c, b, e]:
                continue
            for d in classes:
                if lat.mid[c, d, b, e] <= bound:
                    best = min(best, float(lat.mid[c, d, b, e]) + from_here(e, d, rest))
        return best

    import itertools

    states = itertools.product(*(range(n + 1) for n in counts))
    return min((from_here(0, c, used) for used in states for c in classes), default=math.inf)


@pytest.mark.parametrize("seed", range(8))
def test_the_vectorised_bounded_dp_equals_the_recurrence_written_out(seed: int) -> None:
    """``_BoundedDP`` lays the table out for numpy (states after the cut, classes broadcast, the least taken along
    the last axis); a slip in that layout (an in-place add on a copy, a state mapped to the wrong class) gives
    wrong sums on mixed clusters. Under a bound below every latency and every third candidate (tight to loose), on
    random problems of up to 5 classes and 1F1B memory that binds, its least sum equals the recurrence evaluated
    state by state, and its stages add up to it."""
    import math
    from dataclasses import replace

    import numpy as np

    from planner.partition.model.feasibility import max_stages
    from planner.partition.model.objective import class_tables, stage_latencies
    from planner.partition.model.problem import build_problem
    from tests._bruteforce import random_cluster, random_profile

    cluster = random_cluster(seed, 3 + seed % 4, mem_range=(100, 600))
    if seed % 2:  # devices of a type and host with equal memory: classes of several devices (counts above 1)
        cluster = replace(cluster, devices=tuple(replace(d, memory_bytes=250) for d in cluster.devices))
    problem = build_problem(random_profile(seed, num_nodes=14, skip_prob=0.2), cluster,
                            microbatches=(1, 2, 4, 8)[seed % 4], schedule=("gpipe", "1f1b")[seed % 4 // 2],
                            optimizer="sgd")
    tab = class_tables(problem)
    nblocks = len(problem.blocks)
    lat = stage_latencies(tab, nblocks)
    limit = max_stages(problem.schedule, problem.microbatches, sum(tab.counts))
    bounded = dp._BoundedDP(lat, dp._space(tab.counts), nblocks, limit)
    every = np.unique(np.concatenate([lat.mid[np.isfinite(lat.mid)], lat.last[np.isfinite(lat.last)]]))
    for bound in [every[0] * 0.5, *every[::3], every[-1]]:
        expected = _reference_least_sum(lat, tab.counts, nblocks, float(bound), limit)
        answer = bounded.solve(float(bound))
        if math.isinf(expected):
            assert answer is None
            continue
        assert answer is not None and answer[0] == pytest.approx(expected, rel=1e-12)
        latencies = dp._stage_latencies(lat, answer[1])
        assert sum(latencies) == pytest.approx(answer[0], rel=1e-12) and max(latencies) <= bound
        assert [s[0] for s in answer[1]][1:] == [s[1] for s in answer[1]][:-1] and answer[1][-1][1] == nblocks


def test_a_whole_model_on_one_device_is_found_whatever_the_rounding() -> None:
    """One device (a data-parallel replica's sub-problem): the only plan is one stage, whose latency is a prefix-sum
    difference, while the walk's latency floor sums the blocks one by one. In the last bits the floor could pass
    that latency, and the DP then reported "nothing fits" for 20 of these 60 problems (bench-hybrid lost its pure
    data-parallel plans to it)."""
    from planner.partition.model.problem import build_problem
    from tests._bruteforce import random_cluster, random_profile

    for seed in range(60):
        problem = build_problem(random_profile(seed, num_nodes=30, skip_prob=0.2),
                                random_cluster(seed, 1, mem_range=(10**6, 10**6)), microbatches=(2, 4, 8)[seed % 3],
                                schedule="1f1b", optimizer="sgd")
        result = solve_dp(problem)
        assert [(st.start, st.stop) for st in result.partition] == [(0, len(problem.blocks))], seed
