"""Topology-aware mapping: heavy cuts on fast links, host boundaries at small cuts, heavy stages on fast devices."""

from __future__ import annotations

import itertools
from types import MappingProxyType

import pytest

from planner.errors import InfeasibleError
from planner.formats.cluster import Cluster, Device, Link
from planner.partition.placers import dp
from tests._bruteforce import random_cluster, random_profile
from planner.partition.model.feasibility import check_fits
from planner.partition.placers.mapping import id_order, map_stages
from planner.partition.model.objective import step_time_formula_s
from planner.partition.model.problem import Block, Partition, Problem, StageSpec, build_problem

GiB = 2**30


def _blocks(times: list[float]) -> tuple[Block, ...]:
    return tuple(Block(f"b{i}", (f"n{i}",), 1, 1, MappingProxyType({"fast": (t, 2 * t), "slow": (3 * t, 6 * t)}))
                 for i, t in enumerate(times))


def _two_hosts_interleaved() -> Cluster:
    # ids alternate hosts, so id order crosses the slow inter-host link at every boundary
    devices = tuple(Device(f"g{i}", "fast", f"h{i % 2}", GiB) for i in range(4))
    return Cluster("2x2", devices, intra_host=Link(100.0, 0.0), inter_host=Link(1.0, 0.0))


def _hosts(problem: Problem, partition: Partition) -> list[str]:
    return [problem.cluster.device(st.device).host for st in partition]


def test_host_boundary_goes_to_the_smallest_cut() -> None:
    cuts = (50, 2, 50)  # bytes after blocks 0, 1, 2: only the middle cut is cheap to cross hosts
    problem = Problem(_blocks([1.0] * 4), cuts, cuts, _two_hosts_interleaved(), 4, "1f1b", "sgd")
    stages = tuple(StageSpec(i, i + 1, "") for i in range(4))
    naive = id_order(problem, stages)
    assert _hosts(problem, naive) == ["h0", "h1", "h0", "h1"]
    mapped = map_stages(problem, naive)
    hosts = _hosts(problem, mapped)
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3] and hosts[1] != hosts[2]
    # each boundary: both directions; 50 bytes on the fast link cost 0.5 + 0.5, 2 bytes across hosts 2 + 2
    latencies = [3.0 + 1.0, 3.0 + 4.0, 3.0 + 1.0, 3.0]
    assert step_time_formula_s(problem, mapped) == pytest.approx(sum(latencies) + 3 * max(latencies))
    assert step_time_formula_s(problem, mapped) < step_time_formula_s(problem, naive)


def test_heavy_stage_moves_to_the_fast_device() -> None:
    devices = (Device("a", "slow", "h", GiB), Device("b", "fast", "h", GiB))
    cluster = Cluster("mixed", devices, Link(1e9, 0.0), Link(1e9, 0.0))
    problem = Problem(_blocks([1.0, 3.0]), (0,), (0,), cluster, 8, "gpipe", "sgd")
    naive = id_order(problem, (StageSpec(0, 1, ""), StageSpec(1, 2, "")))
    mapped = map_stages(problem, naive)
    assert [st.device for st in mapped] == ["a", "b"]  # the 3 s block on the fast device: max 9, not 27
    assert step_time_formula_s(problem, mapped) == pytest.approx(9.0 + 9.0 + 7 * 9.0)


def _best_by_enumeration(problem: Problem, partition: Partition) -> float:
    best = float("inf")
    for devices in itertools.permutations(problem.cluster.device_ids, len(partition)):
        candidate = tuple(StageSpec(st.start, st.stop, d) for st, d in zip(partition, devices))
        try:
            check_fits(problem, candidate)
        except InfeasibleError:
            continue
        best = min(best, step_time_formula_s(problem, candidate))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_mapping_is_exact_against_enumeration(seed: int) -> None:
    problem = build_problem(random_profile(seed, num_nodes=8, skip_prob=0.4), random_cluster(seed, 4),
                            microbatches=4, schedule="1f1b" if seed % 2 else "gpipe", optimizer="sgd")
    cuts = [[0, 4, 8], [0, 2, 5, 8], [0, 2, 4, 6, 8]][seed % 3]  # 2, 3 and 4 stages on 4 devices
    stages = tuple(StageSpec(a, b, "") for a, b in zip(cuts, cuts[1:]))
    naive = id_order(problem, stages)
    mapped = map_stages(problem, naive)
    best = _best_by_enumeration(problem, naive)
    if best == float("inf"):
        assert mapped == naive  # nothing fits: returned unchanged
        return
    assert [(st.start, st.stop) for st in mapped] == [(st.start, st.stop) for st in naive]
    assert len({st.device for st in mapped}) == len(mapped)
    assert step_time_formula_s(problem, mapped) == pytest.approx(best, rel=1e-12)


def test_local_search_beyond_the_dp_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dp, "MAX_STATES", 1)
    cuts = (50, 2, 50)
    problem = Problem(_blocks([1.0] * 4), cuts, cuts, _two_hosts_interleaved(), 4, "1f1b", "sgd")
    naive = id_order(problem, tuple(StageSpec(i, i + 1, "") for i in range(4)))
    mapped = map_stages(problem, naive)
    assert step_time_formula_s(problem, mapped) <= step_time_formula_s(problem, naive)
    hosts = _hosts(problem, mapped)
    assert hosts[0] == hosts[1] and hosts[2] == hosts[3]


def test_id_order_needs_enough_devices() -> None:
    from planner.errors import PlannerError

    problem = Problem(_blocks([1.0] * 6), (0,) * 5, (0,) * 5, _two_hosts_interleaved(), 4, "1f1b", "sgd")
    with pytest.raises(PlannerError, match="6 stages need as many devices"):
        id_order(problem, tuple(StageSpec(i, i + 1, "") for i in range(6)))
