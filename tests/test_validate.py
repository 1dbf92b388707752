"""The plan invariant checker: each rule, one broken plan at a time."""

from __future__ import annotations

from typing import Any, Callable

import pytest

from _placer_cases import free_cluster, ops
from planner.errors import PlanMismatchError
from planner.formats.plan import Plan, plan_from_dict
from planner.partition import partition
from planner.partition.validate import assert_valid_plan, validate_plan

PROFILE = ops([1.0] * 6, params=[10] * 6, saved=5)
CLUSTER = free_cluster(3)


def good() -> Plan:
    return partition(PROFILE, CLUSTER, method="greedy", microbatches=4, schedule="1f1b")


def broken(edit: Callable[[dict[str, Any]], None]) -> Plan:
    data = good().to_dict()
    edit(data)
    return plan_from_dict(data)


def test_valid_plan_has_no_violations() -> None:
    plan = good()
    assert [len(s.nodes) for s in plan.stages] == [3, 2, 2]
    assert validate_plan(plan, PROFILE) == []
    assert validate_plan(plan, PROFILE, CLUSTER) == []
    assert_valid_plan(plan, PROFILE)


def test_dropped_node_is_named() -> None:
    plan = broken(lambda d: d["stages"][1]["nodes"].pop())
    assert validate_plan(plan, PROFILE) == ["1 profile node(s) in no stage: 'op3'"]


def test_duplicated_node_is_named() -> None:
    plan = broken(lambda d: d["stages"][2]["nodes"].insert(0, "op3"))
    violations = validate_plan(plan, PROFILE)
    assert "1 node(s) in more than one stage: 'op3'" in violations


def test_unknown_node_is_named() -> None:
    plan = broken(lambda d: d["stages"][2]["nodes"].append("ghost"))
    assert validate_plan(plan, PROFILE) == ["1 node(s) not in the profile: 'ghost'"]


def test_empty_stage() -> None:
    def edit(d: dict[str, Any]) -> None:
        d["stages"][1]["nodes"] += d["stages"][2]["nodes"]
        d["stages"][2]["nodes"] = []

    assert validate_plan(broken(edit), PROFILE) == ["empty stage(s): 2; every stage must hold at least one node"]


def test_backward_edge_and_non_contiguous_stage() -> None:
    def swap(d: dict[str, Any]) -> None:  # op1 (last of stage 0) and op2 (first of stage 1) trade places
        d["stages"][0]["nodes"][-1], d["stages"][1]["nodes"][0] = d["stages"][1]["nodes"][0], d["stages"][0]["nodes"][-1]

    violations = validate_plan(broken(swap), PROFILE)
    assert any(v.startswith("1 edge(s) run backwards") and "'op1' (stage 1) -> 'op2' (stage 0)" in v for v in violations)
    assert any(v.startswith("stage 0 is not the contiguous run") for v in violations)


def test_non_contiguous_but_forward_stage_order() -> None:
    from _partition_cases import node, profile

    times = {"cpu": (1.0, 2.0)}
    prof = profile(node("x", op="input", times={"cpu": (0.0, 0.0)}), node("a", ["x"], times=times),
                   node("b", ["x"], times=times), node("c", ["a", "b"], times=times))
    plan = partition(prof, free_cluster(2), method="uniform", microbatches=2, schedule="1f1b")
    data = plan.to_dict()
    data["stages"] = [dict(data["stages"][0], nodes=["x", "b"]), dict(data["stages"][1], nodes=["a", "c"])]
    violations = validate_plan(plan_from_dict(data), prof)
    assert len(violations) == 2 and all("is not the contiguous run" in v for v in violations)


def test_unknown_device() -> None:
    plan = broken(lambda d: d["stages"][1].update(device="gpu9"))
    assert validate_plan(plan, PROFILE) == ["device(s) not in cluster 'test': 'gpu9' (known: d0, d1, d2)"]


def test_device_with_two_stages_needs_interleaving() -> None:
    plan = broken(lambda d: d["stages"][2].update(device="d0"))
    (violation,) = validate_plan(plan, PROFILE)
    assert "device 'd0' holds stages 0 and 2" in violation and "interleaved-1f1b" in violation


def test_memory_is_recomputed_from_the_profile_not_the_plan() -> None:
    def lie(d: dict[str, Any]) -> None:
        for stage in d["stages"]:
            stage["memory_bytes"] = 1
        for dev in d["cluster"]["devices"]:
            dev["memory_bytes"] = 100

    violations = validate_plan(broken(lie), PROFILE)
    # Stage 0 (op0, op1): 2 x 10 params x 4 (Adam) + 2 x 5 saved x 3 in flight = 110 bytes > 100.
    assert violations == ["stage 0 on 'd0' needs 110 B (110 bytes) of memory at peak under 1f1b with 4 micro-batches, but the "
                          "device has 100 B (100 bytes); move blocks off it, use more stages, or a schedule with fewer "
                          "micro-batches in flight"]


def test_explicit_cluster_overrides_the_embedded_one() -> None:
    violations = validate_plan(good(), PROFILE, free_cluster(3, memory_bytes=50))
    assert len(violations) == 3 and all("at peak" in v for v in violations)


def test_plan_without_cluster() -> None:
    plan = broken(lambda d: d.pop("cluster"))
    (violation,) = validate_plan(plan, PROFILE)
    assert violation.startswith("cannot check devices and memory")
    assert validate_plan(plan, PROFILE, CLUSTER) == []


def test_assert_valid_plan_lists_the_violations() -> None:
    plan = broken(lambda d: d["stages"][1]["nodes"].pop())
    with pytest.raises(PlanMismatchError, match=r"plan \(greedy\) is invalid: 1 profile node\(s\) in no stage: 'op3'"):
        assert_valid_plan(plan, PROFILE)
