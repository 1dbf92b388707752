"""Differential tests on seeded random chains and graphs small enough for brute force.

On every case: brute force = DP = ILP on the shared objective (the step-time formula), greedy is never
better than that optimum, the topology-aware mapping of the greedy plan never worse than greedy, and
every plan passes the invariant checker. Cases: up to 9 blocks on up to 4 devices of two types on one
or two hosts, sometimes with an explicit pair link, memory that sometimes binds, both schedules.
"""

from __future__ import annotations

import numpy as np
import pytest

from planner.errors import InfeasibleError
from planner.partition.placers import registry as methods
from tests._bruteforce import brute_force, random_cluster, random_profile
from planner.partition.placers.dp import solve_dp
from planner.partition.placers.ilp import solve_ilp
from planner.partition.placers.mapping import map_stages
from planner.partition.model.objective import step_time_formula_s
from planner.partition.model.convert import build_plan
from planner.partition.model.problem import build_problem
from planner.partition.validate import validate_plan

CASES = [(seed, skip, devices) for seed in range(10) for skip, devices in ((0.0, 3), (0.4, 4))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed,skip_prob,num_devices", CASES)
def test_brute_force_dp_and_ilp_agree(seed: int, skip_prob: float, num_devices: int) -> None:
    profile = random_profile(seed, num_nodes=9, skip_prob=skip_prob)
    schedule = ("gpipe", "1f1b")[seed % 2]
    problem = build_problem(profile, random_cluster(seed, num_devices, mem_range=(40, 300)),
                            microbatches=2 + seed % 5, schedule=schedule, optimizer="sgd")
    try:
        oracle = brute_force(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve_dp(problem)
        with pytest.raises(InfeasibleError):
            solve_ilp(problem)
        return
    exact = solve_dp(problem)
    solved = solve_ilp(problem, gap_rel=1e-9)
    assert solved.status == "optimal"
    assert exact.objective_s == pytest.approx(oracle.objective_s, rel=1e-9)
    assert solved.objective_s == pytest.approx(oracle.objective_s, rel=1e-9)
    plans = {"dp": exact.partition, "ilp": solved.partition, "brute": oracle.partition}
    try:
        greedy = methods.get("greedy").fn(problem, weights={})
    except InfeasibleError:
        greedy = None  # greedy may miss a feasible split; the exact methods may not
    if greedy is not None:
        assert step_time_formula_s(problem, greedy) >= oracle.objective_s * (1 - 1e-9)
        mapped = map_stages(problem, greedy)
        assert step_time_formula_s(problem, mapped) <= step_time_formula_s(problem, greedy)
        plans.update(greedy=greedy, mapped=mapped)
    for name, partition in plans.items():
        plan = build_plan(problem, partition, method=name)
        assert validate_plan(plan, profile) == [], name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(4))
def test_warm_started_ilp_matches_the_dp(seed: int) -> None:
    """The warm start prunes candidate stages; the optimum must survive the pruning."""
    problem = build_problem(random_profile(100 + seed, num_nodes=10, skip_prob=0.3), random_cluster(seed, 4),
                            microbatches=8, schedule="1f1b", optimizer="sgd")
    greedy = methods.get("greedy").fn(problem, weights={})
    solved = solve_ilp(problem, warm_start=greedy, gap_rel=1e-9)
    assert solved.objective_s == pytest.approx(solve_dp(problem).objective_s, rel=1e-9)
    assert solved.objective_s <= step_time_formula_s(problem, greedy) * (1 + 1e-12)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seed", range(12))
def test_the_dp_walk_equals_the_best_answer_over_every_latency_bound(seed: int) -> None:
    """The DP's walk solves few of the candidate bounds (a bisection for the least one that fits gives it a first
    plan, whose cost then skips every bound that cannot win); on problems too large for brute force (40 ops, up to
    6 devices, 1 to 32 micro-batches) its objective equals the best of the DP answers under every candidate."""
    import math

    from planner.partition.model.feasibility import max_stages
    from planner.partition.model.objective import class_tables, stage_latencies
    from planner.partition.placers import dp

    profile = random_profile(seed, num_nodes=40, skip_prob=0.2)
    problem = build_problem(profile, random_cluster(seed, 3 + seed % 4, mem_range=(400, 4000)),
                            microbatches=(1, 2, 8, 32)[seed % 4], schedule=("gpipe", "1f1b")[seed % 2],
                            optimizer="sgd")
    tab = class_tables(problem)
    lat = stage_latencies(tab, len(problem.blocks))
    try:
        value, stages, tried = dp.walk_bounds(problem, tab, lat, len(problem.blocks))
    except InfeasibleError:
        value, tried = math.inf, 0
    space, m = dp._space(tab.counts), problem.microbatches
    limit = max_stages(problem.schedule, m, sum(tab.counts))
    every = sorted({float(x) for x in lat.mid[np.isfinite(lat.mid)]} | {float(x) for x in lat.last[np.isfinite(lat.last)]})
    bounded = dp._BoundedDP(lat, space, len(problem.blocks), limit)
    best, index, solved = math.inf, len(every) - 1, 0  # every bound from the top down, skipping only the bounds
    while index >= 0:  # between an answer's largest latency and its own bound (the same answer), never pruning
        answer = bounded.solve(every[index])
        solved += 1
        if answer is None:
            break
        largest = max(dp._stage_latencies(lat, answer[1]))
        best = min(best, answer[0] + (m - 1) * largest)
        index = every.index(largest) - 1
    assert value == pytest.approx(best, rel=1e-12)
    assert tried <= solved + 2 * math.ceil(math.log2(len(every) + 1))


@pytest.mark.slow  # about 4 s
@pytest.mark.timeout(120)
def test_on_a_replica_pipeline_brute_force_dp_and_ilp_agree_with_the_sync_tails() -> None:
    """Issue 27, cuts that see the sync: on a replica pipeline (``Problem.replica_sync``: each device's all-reduce
    with its replicas, ``a + b x`` a stage's parameter bytes) the formula adds each stage's sync tail, and the DP and
    the ILP still find brute force's optimum; on some of these cases it is not the optimum without the sync."""
    import random
    from dataclasses import replace

    moved = []
    for seed in range(10):
        rng = random.Random(seed)
        base = build_problem(random_profile(seed, num_nodes=8, skip_prob=0.3), random_cluster(seed, 3 + seed % 2),
                             microbatches=2 + seed % 4, schedule=("gpipe", "1f1b")[seed % 2], optimizer="sgd")
        problem = replace(base, replica_sync={d: (rng.uniform(0.0, 8.0), rng.uniform(0.0, 0.5))
                                              for d in base.cluster.device_ids})
        try:
            oracle = brute_force(problem)
        except InfeasibleError:
            continue
        exact, solved = solve_dp(problem), solve_ilp(problem, gap_rel=1e-9)
        assert solved.status == "optimal", seed
        assert exact.objective_s == pytest.approx(oracle.objective_s, rel=1e-9), seed
        assert solved.objective_s == pytest.approx(oracle.objective_s, rel=1e-9), seed
        assert exact.objective_s > step_time_formula_s(base, exact.partition) or not any(
            problem.tables.param_prefix[st.stop] > problem.tables.param_prefix[st.start] for st in exact.partition[:1])
        moved.append(brute_force(base).partition != oracle.partition)
    assert len(moved) >= 6 and any(moved)
