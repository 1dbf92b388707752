"""Golden tests of the cost model: stage times and memory per schedule, fitting, the plan it builds."""

from __future__ import annotations

import pytest

from _partition_cases import FREE, GIB, chain, cluster
from planner.errors import InfeasibleError, PlannerError
from planner.formats.plan import plan_from_dict
from planner.partition.model.cost import (
    device_memory_bytes,
    evaluate,
    format_bytes,
    infeasible_reason,
    inflight_microbatches,
    stage_activation_bytes,
    stage_compute_s,
    stage_fwd_bwd_s,
    stage_memory_bytes,
    stage_sims,
    stage_static_bytes,
    transfer_s,
)
from planner.partition.model.convert import build_plan
from planner.partition.model.feasibility import check_fits
from planner.partition.model.problem import StageSpec, build_problem


def even(n_blocks: int, devices: list[str]) -> tuple[StageSpec, ...]:
    per = n_blocks // len(devices)
    return tuple(StageSpec(i * per, n_blocks if i == len(devices) - 1 else (i + 1) * per, d)
                 for i, d in enumerate(devices))


def test_stage_figures_are_prefix_sums() -> None:
    # chain(6): input + 6 ops of fwd 1, bwd 2, 10 param bytes, 7 saved bytes.
    problem = build_problem(chain(6), cluster(2), microbatches=4, schedule="1f1b", speed_factors={"d1": 1.5})
    tables = problem.tables
    assert stage_fwd_bwd_s(tables, "d0", 0, 4) == (3.0, 6.0)
    assert stage_compute_s(tables, "d1", 2, 5) == pytest.approx(3 * 3.0 * 1.5)
    assert stage_static_bytes(problem, 1, 4) == 3 * 10 * (2 + 2)  # weights + grads + Adam's two moments
    assert stage_activation_bytes(problem, 1, 4) == 21


def test_sgd_keeps_no_optimizer_state() -> None:
    problem = build_problem(chain(3), cluster(1), microbatches=1, schedule="gpipe", optimizer="sgd")
    assert stage_static_bytes(problem, 0, 4) == 3 * 10 * 2


@pytest.mark.parametrize("schedule,expected", [("gpipe", [5, 5, 5]), ("1f1b", [3, 2, 1])])
def test_memory_per_schedule(schedule: str, expected: list[int]) -> None:
    problem = build_problem(chain(6), cluster(3), microbatches=5, schedule=schedule)
    partition = (StageSpec(0, 3, "d0"), StageSpec(3, 5, "d1"), StageSpec(5, 7, "d2"))
    assert [inflight_microbatches(schedule, i, 3, 5) for i in range(3)] == expected
    static = [2 * 40, 2 * 40, 2 * 40]
    saved = [14, 14, 14]
    memory = [stage_memory_bytes(problem, partition, i) for i in range(3)]
    assert memory == [static[i] + saved[i] * expected[i] for i in range(3)]
    assert list(device_memory_bytes(problem, partition).values()) == memory
    result = evaluate(problem, partition)
    assert [d.peak_memory_bytes for d in result.devices.values()] == memory


@pytest.mark.parametrize("schedule,expected", [("gpipe", [5, 5, 5]), ("1f1b", [3, 2, 1])])
def test_recomputation_keeps_stage_inputs_and_runs_the_forward_twice(schedule: str, expected: list[int]) -> None:
    """With recomputation a stage keeps only its input per micro-batch in flight (the 100 bytes crossing the cut
    before it; nothing for the first stage) plus one micro-batch's saved bytes, and its backward pays its forward
    again; the cost model, the device replay and the simulator agree."""
    problem = build_problem(chain(6), cluster(3), microbatches=5, schedule=schedule, recompute=True)
    partition = (StageSpec(0, 3, "d0"), StageSpec(3, 5, "d1"), StageSpec(5, 7, "d2"))
    memory = [stage_memory_bytes(problem, partition, i) for i in range(3)]
    assert memory == [2 * 40 + inputs * expected[i] + 14 for i, inputs in enumerate([0, 100, 100])]
    assert list(device_memory_bytes(problem, partition).values()) == memory
    assert [d.peak_memory_bytes for d in evaluate(problem, partition).devices.values()] == memory
    assert stage_fwd_bwd_s(problem.tables, "d1", 3, 5) == (2.0, 6.0)  # backward 2 x 2 s + the forward again


def test_every_placer_keeps_a_recomputing_plan_in_memory() -> None:
    """A cluster too small for GPipe's saved activations: without recomputation nothing fits, with it every
    placer's plan fits by the cost model's figures (check_fits)."""
    from planner.partition import partition as plan_with

    profile = chain(6, saved=400, out=50)
    tight = cluster(3, memory_bytes=2 * 40 + 50 * 8 + 800)
    with pytest.raises(InfeasibleError):
        plan_with(profile, tight, method="dp", microbatches=8, schedule="gpipe")
    for method in ("greedy", "dp", "ilp"):
        plan = plan_with(profile, tight, method=method, microbatches=8, schedule="gpipe", recompute=True)
        assert plan.recomputed() == (True,) * len(plan.stages) and "recompute" not in plan.extra
        assert plan.peak_memory_bytes <= 2 * 40 + 50 * 8 + 800, method


def test_inflight_is_capped_by_microbatches() -> None:
    assert [inflight_microbatches("1f1b", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert inflight_microbatches("interleaved-1f1b", 1, 4, 2) == 2  # one stage per device: 1F1B


def test_stage_sims_route_cut_bytes_and_evaluate_matches_hand_schedule() -> None:
    problem = build_problem(chain(2, out=1000), cluster(2, hosts=2, bandwidth_Bps=FREE, inter_bandwidth_Bps=1000.0,
                                                       inter_latency_s=0.5), microbatches=1, schedule="gpipe")
    partition = (StageSpec(0, 2, "d0"), StageSpec(2, 3, "d1"))
    sims = stage_sims(problem, partition)
    assert (sims[0].send_fwd_bytes, sims[0].send_bwd_bytes) == (1000, 0)
    assert (sims[1].send_fwd_bytes, sims[1].send_bwd_bytes) == (0, 1000)
    assert transfer_s(problem.tables, "d0", "d1", 1000) == pytest.approx(1.5)
    # fwd 1 + send 1.5 + fwd 1 + bwd 2 + send 1.5 + bwd 2
    assert evaluate(problem, partition).step_time_s == pytest.approx(9.0)


@pytest.mark.parametrize("partition,match", [
    ((StageSpec(0, 2, "d0"), StageSpec(3, 4, "d1")), "must start at block 2"),
    ((StageSpec(0, 2, "d0"),), r"cover blocks \[0, 2\) of 4"),
    ((StageSpec(0, 2, "d0"), StageSpec(2, 2, "d1"), StageSpec(2, 4, "d1")), "at least one block"),
    ((StageSpec(0, 2, "d0"), StageSpec(2, 4, "gpu7")), "not in cluster"),
    ((StageSpec(0, 2, "d0"), StageSpec(2, 4, "d0")), "holds stages 0 and 1"),
    ((), "at least one stage"),
])
def test_bad_partitions_raise(partition, match) -> None:
    problem = build_problem(chain(3), cluster(2), microbatches=2, schedule="1f1b")
    with pytest.raises(PlannerError, match=match):
        evaluate(problem, partition)


def test_check_fits_names_stage_need_and_capacity() -> None:
    problem = build_problem(chain(4, params=100, saved=50), cluster(2, memory_bytes=1000), microbatches=4,
                            schedule="gpipe")
    fits = (StageSpec(0, 3, "d0"), StageSpec(3, 5, "d1"))  # 2 ops: 800 static + 100 x 4 in flight = 1200
    with pytest.raises(InfeasibleError, match=r"stage 0 on 'd0' needs 1.17 KiB \(1200 bytes\).*has 1000 B"):
        check_fits(problem, fits)
    one_f = build_problem(chain(4, params=100, saved=50), cluster(2, memory_bytes=1000), microbatches=4,
                          schedule="1f1b")
    check_fits(one_f, fits)  # 800 + 100 x 2 and 800 + 100 x 1


def test_infeasible_reason_names_largest_need_and_device() -> None:
    big = build_problem(chain(2, params=GIB), cluster(2, memory_bytes=2 * GIB), microbatches=2, schedule="1f1b")
    reason = infeasible_reason(big)
    assert reason is not None
    assert "block 'op0' alone needs 4.00 GiB" in reason and "largest device, 'd1' (cpu), has 2.00 GiB" in reason
    total = build_problem(chain(8, params=GIB // 8), cluster(2, memory_bytes=GIB), microbatches=2, schedule="1f1b")
    assert "all 2 devices together have 2.00 GiB" in infeasible_reason(total)
    assert infeasible_reason(build_problem(chain(2), cluster(2), microbatches=2, schedule="1f1b")) is None


def test_format_bytes() -> None:
    assert [format_bytes(x) for x in (512, 1536, 3 * GIB)] == ["512 B", "1.50 KiB", "3.00 GiB"]


def test_interleaved_device_memory_counts_both_chunks() -> None:
    problem = build_problem(chain(8), cluster(2, bandwidth_Bps=FREE), microbatches=4, schedule="interleaved-1f1b")
    partition = (StageSpec(0, 3, "d0"), StageSpec(3, 5, "d1"), StageSpec(5, 7, "d0"), StageSpec(7, 9, "d1"))
    result = evaluate(problem, partition)
    assert {d: s.peak_memory_bytes for d, s in result.devices.items()} == device_memory_bytes(problem, partition)
    check_fits(problem, partition)


def test_build_plan_lists_every_node_and_predicts() -> None:
    prof = chain(6)
    problem = build_problem(prof, cluster(3, bandwidth_Bps=1e6, latency_s=1e-3), microbatches=4, schedule="1f1b")
    partition = (StageSpec(0, 3, "d0"), StageSpec(3, 5, "d1"), StageSpec(5, 7, "d2"))
    plan = build_plan(problem, partition, method="manual", profile_ref={"path": "p.json", "sha256": "ab", "model": "toy"},
                      extra={"solver": {"status": "n/a"}})
    assert [n for s in plan.stages for n in s.nodes] == [n.name for n in prof.nodes]
    first = plan.stages[0].extra
    assert first["layers"] == ["layers.0", "layers.1"]
    assert first["compute_s"] == pytest.approx(6.0)
    assert first["transfer_s"] == pytest.approx(1e-3 + 100 / 1e6)
    assert first["memory_bytes"] == 2 * 40 + 14 * 3 and first["capacity_bytes"] == 16 * GIB
    assert [s.extra["inflight_microbatches"] for s in plan.stages] == [3, 2, 1]
    assert plan.predicted["step_time_s"] == pytest.approx(evaluate(problem, partition).step_time_s)
    assert set(plan.predicted["devices"]) == {"d0", "d1", "d2"}
    data = plan.to_dict()
    assert data["cluster"]["name"] == "test" and data["optimizer"] == "adam" and data["solver"] == {"status": "n/a"}
    assert data["profile"]["sha256"] == "ab"
    assert plan_from_dict(data).assignment() == plan.assignment()


def test_build_plan_refuses_a_plan_that_does_not_fit() -> None:
    problem = build_problem(chain(2, params=GIB), cluster(2, memory_bytes=GIB), microbatches=2, schedule="1f1b")
    with pytest.raises(InfeasibleError):
        build_plan(problem, (StageSpec(0, 2, "d0"), StageSpec(2, 3, "d1")), method="manual")


def test_a_stage_that_reads_a_tied_weight_it_does_not_hold_first_keeps_a_copy() -> None:
    """GPT's LM head reads the token embedding's weight (tied). The profile counts those bytes once, at the
    embedding; the runtime keeps a copy, with its gradient and optimizer state, on every rank whose stages read it
    (``stages.tied_groups``). A split that puts the head on another stage than the embedding must count that copy
    there, or a plan can fit on paper and not on the device."""
    from pathlib import Path

    from planner.formats.cluster import load_cluster
    from planner.formats.profile import load_profile
    from planner.partition.model.cost import stage_param_bytes_t, stage_static_bytes_t

    root = Path(__file__).resolve().parents[1]
    profile = load_profile(root / "tests" / "golden" / "profiles" / "gpt_tiny.json")
    problem = build_problem(profile, load_cluster(root / "profiles" / "clusters" / "cpu-2.json"), microbatches=2,
                            schedule="1f1b", optimizer="adam")
    ((nbytes, readers),) = problem.tied
    names = [b.name for b in problem.blocks]
    assert names[readers[0]] == "embedding" and names[readers[-1]].startswith("linear") and nbytes > 0
    tables, n = problem.tables, len(problem.blocks)
    own = [tables.param_prefix[b + 1] - tables.param_prefix[b] for b in range(n)]
    for cut in (readers[0] + 1, n // 2, readers[-1]):
        assert stage_param_bytes_t(tables, 0, cut) == sum(own[:cut])
        assert stage_param_bytes_t(tables, cut, n) == sum(own[cut:]) + nbytes
        assert stage_static_bytes_t(tables, cut, n) == (sum(own[cut:]) + nbytes) * tables.static_per_param_byte
    assert stage_param_bytes_t(tables, 0, n) == sum(own)  # one stage holds it once
    assert stage_param_bytes_t(tables, readers[0] + 1, readers[-1]) == sum(own[readers[0] + 1:readers[-1]])


@pytest.mark.parametrize("seed", range(20))
def test_the_exact_placers_matrix_of_parameter_bytes_is_the_per_stage_rule(seed: int) -> None:
    """``objective.param_bytes_matrix`` (the DP's and the ILP's stage room) equals ``cost.stage_param_bytes_t`` (the
    feasibility rule's) on every stage, with random tied parameter sets."""
    import dataclasses
    import random

    import numpy as np

    from planner.partition.model.cost import stage_param_bytes_t
    from planner.partition.model.objective import param_bytes_matrix

    rng = random.Random(seed)
    base = build_problem(chain(rng.randint(2, 11)), cluster(2), microbatches=2, schedule="1f1b")
    n = len(base.blocks)
    tied = tuple((rng.randint(1, 50), tuple(sorted(rng.sample(range(n), rng.randint(2, min(n, 4))))))
                 for _ in range(rng.randint(0, 3)))
    problem = dataclasses.replace(base, tied=tied)
    matrix = param_bytes_matrix(problem.tables)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            assert matrix[start, stop] == stage_param_bytes_t(problem.tables, start, stop), (start, stop, tied)
    assert isinstance(matrix, np.ndarray)


def test_replicas_of_a_stage_holding_a_tied_copy_all_reduce_the_copy_too() -> None:
    """Each replica of the stage with the LM head keeps the tied embedding's copy among its parameters, so the
    replicas' all-reduce carries its gradient as well: ``stage_sync_s`` prices the stage's held bytes."""
    from pathlib import Path

    from planner.clusters import resolve_cluster
    from planner.formats.catalog import load_catalog
    from planner.formats.cluster import load_cluster
    from planner.formats.profile import load_profile
    from planner.partition.model.allreduce import allreduce_s
    from planner.partition.model.cost import stage_param_bytes_t, stage_sync_s

    root = Path(__file__).resolve().parents[1]
    net = load_cluster(resolve_cluster("a100-4"))
    problem = build_problem(load_profile(root / "tests" / "golden" / "profiles" / "gpt_tiny.json"), net,
                            microbatches=4, schedule="1f1b", optimizer="adam", catalog=load_catalog())
    n = len(problem.blocks)
    ids = list(net.device_ids)
    head = StageSpec(n // 2, n, ids[1], replicas=(ids[1], ids[3]))
    held = stage_param_bytes_t(problem.tables, n // 2, n)
    assert held > problem.tables.param_prefix[n] - problem.tables.param_prefix[n // 2]  # the copy is held
    hosts = {d.id: d.host for d in net.devices}
    assert stage_sync_s(problem, head) == pytest.approx(
        allreduce_s([ids[1], ids[3]], held, net.link, hosts, net.nics_per_host, net.pass_byte_overhead_s))
