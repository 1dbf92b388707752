"""Golden tests of the greedy EFT placer (seed 003 S2/S3) on small hand-made graphs."""

from __future__ import annotations

import pytest

from _placer_cases import GIB, devices, free_cluster, mixed_cluster, ops, sizes
from planner.errors import InfeasibleError, UsageError
from planner.partition import partition
from planner.partition.placers.greedy import place
from planner.partition.model.problem import build_problem
from planner.partition.validate import assert_valid_plan


def plan(prof, clus, **kwargs):
    kwargs.setdefault("microbatches", 4)
    kwargs.setdefault("schedule", "1f1b")
    result = partition(prof, clus, method="greedy", **kwargs)
    assert_valid_plan(result, prof)
    return result


def test_equal_ops_on_equal_devices_split_evenly() -> None:
    result = plan(ops([1.0] * 4), free_cluster(2))
    assert sizes(result) == [3, 2]  # the input node rides with the first two ops
    assert devices(result) == ["d0", "d1"]
    assert result.step_time_s == pytest.approx((4 + 1) * 6.0)


def test_heavy_op_forces_an_uneven_split() -> None:
    result = plan(ops([1.0, 1.0, 1.0, 3.0]), free_cluster(2))
    assert sizes(result) == [4, 1]  # 1+1+1 | 3
    assert [s.extra["compute_s"] for s in result.stages] == [9.0, 9.0]


def test_faster_device_takes_more_work() -> None:
    prof = ops([1.0] * 6, types=("fast", "slow"), speed={"fast": 2.0})
    clus = mixed_cluster(("s0", "slow", GIB), ("f0", "fast", GIB))
    result = plan(prof, clus)
    assert devices(result) == ["f0", "s0"]  # EFT: the op finishes first on the fast device
    assert sizes(result) == [5, 2]  # 4 ops x 1.5 s on the fast device, 2 ops x 3 s on the slow one
    assert [s.extra["compute_s"] for s in result.stages] == [6.0, 6.0]


def test_memory_bound_fast_device_is_under_used() -> None:
    prof = ops([1.0] * 6, types=("fast", "slow"), speed={"fast": 2.0}, params=[100] * 6)
    # Adam keeps 4 bytes per parameter byte: the fast device holds one op (400 bytes), not four.
    clus = mixed_cluster(("f0", "fast", 500), ("s0", "slow", 10_000))
    result = plan(prof, clus)
    assert devices(result) == ["f0", "s0"]
    assert sizes(result) == [2, 5]
    assert result.stages[0].extra["memory_bytes"] <= 500


def test_weights_shift_work_between_identical_devices() -> None:
    result = plan(ops([1.0] * 6), free_cluster(2), weights={"d0": 2.0, "d1": 1.0})
    assert sizes(result) == [5, 2]  # shares 4/3 and 2/3 of the period: 4 ops and 2 ops
    assert result.extra["weights"] == pytest.approx({"d0": 4 / 3, "d1": 2 / 3})


def test_transfers_pull_the_cut_to_a_small_activation() -> None:
    from _partition_cases import cluster, node, profile

    times = {"cpu": (1.0, 2.0)}
    prof = profile(node("x", op="input", out=1, times={"cpu": (0.0, 0.0)}),
                   node("a", ["x"], out=1, times=times), node("b", ["a"], out=4 * 10**9, times=times),
                   node("c", ["b"], out=1, times=times), node("d", ["c"], out=1, times=times))
    # 1 GB/s: cutting after "b" adds 4 s each way per micro-batch (more than a 3 s op), after "a" or "c" 1 ns.
    result = plan(prof, cluster(2, bandwidth_Bps=1e9))
    assert result.stages[0].nodes[-1] != "b"


def test_single_device_holds_everything() -> None:
    result = plan(ops([1.0, 2.0, 3.0]), free_cluster(1))
    assert sizes(result) == [4]


def test_deterministic_plan_dicts() -> None:
    prof = ops([0.5, 1.5, 1.0, 2.0, 0.25, 1.0, 3.0], types=("fast", "slow"), speed={"fast": 3.0})
    clus = mixed_cluster(("a", "slow", GIB), ("b", "fast", GIB), ("c", "slow", GIB), bandwidth_Bps=1e6)
    first = plan(prof, clus).to_dict()
    second = plan(prof, clus).to_dict()
    assert first == second


def test_infeasible_memory_names_largest_need_and_device() -> None:
    prof = ops([1.0, 1.0], params=[10_000, 10])
    with pytest.raises(InfeasibleError) as info:
        partition(prof, free_cluster(2, memory_bytes=1000), method="greedy", microbatches=2, schedule="1f1b")
    message = str(info.value)
    assert "block 'op0' alone needs 39.06 KiB" in message
    assert "largest device, 'd1'" in message and "1000 B" in message


def test_device_without_a_time_for_an_op_is_skipped() -> None:
    import math

    prof = build_problem(ops([1.0] * 4, types=("cpu", "gpu")), free_cluster(2, types=["gpu", "cpu"]),
                         microbatches=2, schedule="1f1b")
    blocks = list(prof.blocks)
    gpu_free = type(blocks[2])(blocks[2].name, blocks[2].nodes, 0, 0, {"cpu": (1.0, 2.0), "gpu": (math.inf, math.inf)},
                               blocks[2].layers)
    blocks[2] = gpu_free
    from dataclasses import replace

    problem = replace(prof, blocks=tuple(blocks))
    result = place(problem)
    holder = next(stage for stage in result if stage.start <= 2 < stage.stop)
    assert holder.device == "d1"  # the gpu (d0) has no kernel for block 2
    assert result[-1].stop == 5 and all(a.stop == b.start for a, b in zip(result, result[1:]))


def test_unknown_option_is_a_usage_error() -> None:
    problem = build_problem(ops([1.0]), free_cluster(1), microbatches=1, schedule="gpipe")
    with pytest.raises(UsageError, match="takes no options"):
        place(problem, bogus=1)


def test_infeasible_when_blocks_fit_alone_but_not_on_the_devices_together() -> None:
    prof = ops([1.0, 1.0, 1.0], params=[75, 75, 75])  # 300 bytes each with Adam; two never share 500 bytes
    with pytest.raises(InfeasibleError, match="greedy: no split of the 4 blocks fits in memory.*needs 600 B.*has 500 B"):
        partition(prof, free_cluster(2, memory_bytes=500), method="greedy", microbatches=2, schedule="gpipe")


def _greedy_step_s(problem, monkeypatch, mapped: bool) -> float:
    from planner.partition.placers import greedy
    from planner.partition.model.cost import evaluate

    monkeypatch.setattr(greedy, "MAP_STAGES", mapped)
    return evaluate(problem, greedy.place(problem), record_events=False).step_time_s


def test_remapping_the_candidates_never_hurts_and_sometimes_helps(monkeypatch) -> None:
    from planner.errors import InfeasibleError as NoFit
    from tests._bruteforce import random_cluster, random_profile

    gains = 0
    for seed in range(40):
        problem = build_problem(random_profile(500 + seed, num_nodes=9), random_cluster(seed, 4, mem_range=(200, 600)),
                                microbatches=4, schedule="1f1b", optimizer="sgd")
        try:
            without = _greedy_step_s(problem, monkeypatch, False)
        except NoFit:
            continue
        with_mapping = _greedy_step_s(problem, monkeypatch, True)
        assert with_mapping <= without * (1 + 1e-12)
        gains += with_mapping < without * (1 - 1e-9)
    assert gains > 0  # the fill's fastest-first device order is not always the best mapping
