"""Building the partitioning problem: blocks, cut bytes, estimated device types, settings."""

from __future__ import annotations

import pytest

from _partition_cases import chain, cluster, node, profile
from planner.errors import PlannerError
from planner.partition.model.problem import build_problem as build_problem_without_catalog, cut_bytes
from planner.formats.catalog import load_catalog
from planner.roofline import estimate_node_time


def build_problem(*args, **kwargs):  # type: ignore[no-untyped-def]
    """``build_problem`` with the bundled catalog, as the CLI calls it."""
    return build_problem_without_catalog(*args, **{"catalog": load_catalog(), **kwargs})


def _estimate_node_time(node, device_type, precision=None):  # type: ignore[no-untyped-def]
    """The roofline with the bundled catalog (the core takes the catalog as an argument)."""
    return estimate_node_time(node, device_type, load_catalog(), precision)


def skip_profile():
    # x -> a -> b -> c(a, b) -> d : a's output skips b, so it crosses the cut after b as well.
    return profile(
        node("x", op="input", out=8, times={"cpu": (0.0, 0.0)}),
        node("a", ["x"], out=100, params=40, saved=8, times={"cpu": (1.0, 2.0)}, module_path="embed"),
        node("b", ["a"], out=10, params=4, saved=100, times={"cpu": (0.5, 1.0)}, module_path="h.0.mlp"),
        node("c", ["a", "b"], out=20, saved=110, times={"cpu": (0.25, 0.5)}, module_path="h.1.attn"),
        node("d", ["c"], out=4, params=8, saved=20, times={"cpu": (0.125, 0.25)}, module_path="head"),
    )


def test_op_granularity_blocks_and_cut_bytes_with_a_skip() -> None:
    problem = build_problem(skip_profile(), cluster(2), microbatches=4, schedule="1f1b")
    assert [b.nodes for b in problem.blocks] == [("x",), ("a",), ("b",), ("c",), ("d",)]
    # Cuts after x, a, b, c. The input x carries no gradient backwards.
    assert problem.cut_fwd_bytes == (8, 100, 110, 20)
    assert problem.cut_bwd_bytes == (0, 100, 110, 20)
    assert problem.blocks[2].time_s["cpu"] == (0.5, 1.0)
    assert [b.layers for b in problem.blocks] == [(), ("embed",), ("h.0",), ("h.1",), ("head",)]
    assert problem.estimated_types == ()


def test_groups_sum_their_nodes() -> None:
    problem = build_problem(skip_profile(), cluster(2), microbatches=2, schedule="gpipe",
                            groups=[["x", "a"], ["b", "c"], ["d"]])
    first, middle, _ = problem.blocks
    assert first.nodes == ("x", "a") and first.param_bytes == 40 and first.saved_bytes == 8
    assert middle.time_s["cpu"] == (0.75, 1.5)
    assert middle.layers == ("h.0", "h.1")
    assert problem.cut_fwd_bytes == (100, 20)
    assert cut_bytes(skip_profile(), [["x", "a"], ["b", "c"], ["d"]]) == ((100, 20), (100, 20))


@pytest.mark.parametrize("groups,match", [
    ([["x", "a"], ["c", "b"], ["d"]], "profile's order"),
    ([["x", "a"], ["b", "c"]], "first left out is 'd'"),
    ([["x", "a"], [], ["b", "c", "d"]], "group 1 is empty"),
    ([["x", "a", "b", "c", "d", "e"]], "where the profile's order has None"),
])
def test_bad_groups_raise(groups, match) -> None:
    with pytest.raises(PlannerError, match=match):
        build_problem(skip_profile(), cluster(2), microbatches=2, schedule="gpipe", groups=groups)


def test_missing_type_is_estimated_and_recorded() -> None:
    net = cluster(2, types=["cpu", "a100-80g"])
    problem = build_problem(chain(3), net, microbatches=2, schedule="1f1b")
    assert problem.estimated_types == ("a100-80g",)
    assert problem.blocks[0].time_s["a100-80g"] == (0.0, 0.0)  # the model input costs nothing
    fwd, bwd = problem.blocks[1].time_s["a100-80g"]
    assert fwd > 0 and bwd > 0
    assert problem.blocks[1].time_s["cpu"] == (1.0, 2.0)


def test_unknown_device_type_names_it() -> None:
    net = cluster(2, types=["cpu", "h100"])
    with pytest.raises(PlannerError, match=r"type 'h100' \(d1\).*device catalog does not know"):
        build_problem(chain(2), net, microbatches=2, schedule="1f1b")


def test_measured_type_outside_the_catalog_is_fine() -> None:
    problem = build_problem(chain(2, types=("cuda-mystery",)), cluster(1, dev_type="cuda-mystery"),
                            microbatches=1, schedule="gpipe")
    assert problem.blocks[1].time_s["cuda-mystery"] == (1.0, 2.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"microbatches": 0, "schedule": "1f1b"}, "at least 1"),
    ({"microbatches": 2, "schedule": "pipedream"}, "unknown schedule"),
    ({"microbatches": 2, "schedule": "1f1b", "optimizer": "lion"}, "unknown optimizer"),
    ({"microbatches": 2, "schedule": "1f1b", "speed_factors": {"d9": 1.0}}, "not in cluster"),
    ({"microbatches": 2, "schedule": "1f1b", "speed_factors": {"d0": 0.0}}, "positive finite"),
])
def test_bad_settings_raise(kwargs, match) -> None:
    with pytest.raises(PlannerError, match=match):
        build_problem(chain(2), cluster(2), **kwargs)


def test_speed_factors_scale_one_device() -> None:
    problem = build_problem(chain(2), cluster(2), microbatches=2, schedule="1f1b", speed_factors={"d1": 2.0})
    assert problem.time_on(1, "d0") == (1.0, 2.0)
    assert problem.time_on(1, "d1") == (2.0, 4.0)
    assert problem.tables is problem.tables  # built once


def test_tables_are_per_type_not_per_copy() -> None:
    problem = build_problem(chain(4), cluster(8), microbatches=2, schedule="1f1b")
    tables = problem.tables
    assert tables.fwd_prefix["d0"] is tables.fwd_prefix["d7"]
    assert tables.fwd_prefix["d0"] == (0.0, 0.0, 1.0, 2.0, 3.0, 4.0)


def test_only_nodes_missing_a_type_are_estimated() -> None:

    prof = profile(
        node("x", op="input", times={"cpu": (0.0, 0.0), "t4": (0.0, 0.0)}),
        node("a", ["x"], flops=10**9, times={"cpu": (1.0, 2.0), "t4": (0.5, 0.75)}),
        node("b", ["a"], flops=10**9, times={"cpu": (1.0, 2.0)}),
    )
    problem = build_problem(prof, cluster(2, types=["cpu", "t4"]), microbatches=1, schedule="gpipe")
    assert problem.estimated_types == ("t4",)
    assert problem.blocks[1].time_s["t4"] == (0.5, 0.75)
    guess = _estimate_node_time(prof.nodes[2], "t4")
    assert problem.blocks[2].time_s["t4"] == (guess.fwd, guess.bwd)


def test_types_marked_estimated_in_the_profile_are_reported() -> None:
    prof = chain(2)
    data = prof.to_dict()
    for raw in data["nodes"]:
        raw["time_s"]["cpu"]["source"] = "estimated"
    from planner.formats.profile import profile_from_dict

    problem = build_problem(profile_from_dict(data), cluster(1), microbatches=1, schedule="gpipe")
    assert problem.estimated_types == ("cpu",)


def with_whole_model(prof, **whole):
    """``prof`` measured on ``cpu`` with the given ``whole_model`` figures."""
    from planner.formats.profile import Profile

    return Profile(model=prof.model, nodes=prof.nodes, extra={"device_type": "cpu", "whole_model": whole})


def test_measured_times_are_calibrated_to_a_training_micro_batch() -> None:
    # chain(3): ops sum to 3 x (1 + 2) = 9 s; one training micro-batch of the whole model took 10.8 s.
    prof = with_whole_model(chain(3), train_s=10.8)
    net = cluster(2, types=["cpu", "a100-80g"])
    problem = build_problem(prof, net, catalog=load_catalog(), microbatches=2, schedule="1f1b")
    assert problem.calibration == pytest.approx({"cpu": 1.2})
    assert problem.blocks[1].time_s["cpu"] == pytest.approx((1.2, 2.4))
    raw = build_problem(chain(3), net, microbatches=2, schedule="1f1b")
    assert problem.blocks[1].time_s["a100-80g"] == raw.blocks[1].time_s["a100-80g"]  # estimates untouched


@pytest.mark.parametrize("whole", [{}, {"train_s": 0.0}, {"train_s": 90.0}, {"train_s": 1.0}])
def test_calibration_is_skipped_without_a_usable_training_time(whole) -> None:
    # missing, zero, or outside CALIBRATION_RANGE (10x / 0.11x the ops' sum: the per-op method failed)
    problem = build_problem(with_whole_model(chain(3), **whole), cluster(2), microbatches=2, schedule="1f1b")
    assert problem.calibration == {}
    assert problem.blocks[1].time_s["cpu"] == (1.0, 2.0)


def test_optimizer_update_rate_is_measured_on_the_profiled_type_and_estimated_elsewhere() -> None:
    from planner.formats.catalog import load_catalog
    from planner.roofline import estimate_update_s_per_param_byte

    prof = with_whole_model(chain(3), update_s={"adam": 0.3, "sgd": 0.1}, update_param_bytes=30)
    net = cluster(2, types=["cpu", "a100-80g"])
    adam = build_problem(prof, net, catalog=load_catalog(), microbatches=2, schedule="1f1b", optimizer="adam")
    sgd = build_problem(prof, net, catalog=load_catalog(), microbatches=2, schedule="1f1b", optimizer="sgd")
    assert adam.update_s_per_param_byte["cpu"] == pytest.approx(0.01)
    assert sgd.update_s_per_param_byte["cpu"] == pytest.approx(0.1 / 30)
    a100 = load_catalog()["a100-80g"]
    assert adam.update_s_per_param_byte["a100-80g"] == pytest.approx(estimate_update_s_per_param_byte("adam", a100))
    assert sgd.update_s_per_param_byte["a100-80g"] < adam.update_s_per_param_byte["a100-80g"]
    # a profile without the measurement: no update time on its (measured, non-catalog-estimated) type
    assert "cpu" not in build_problem(chain(3), net, microbatches=2, schedule="1f1b").update_s_per_param_byte


def test_each_stage_pays_the_update_of_its_own_parameters() -> None:
    from planner.partition.model.cost import evaluate, stage_sims
    from planner.partition.model.problem import StageSpec

    prof = with_whole_model(chain(4), update_s={"adam": 0.4, "sgd": 0.1}, update_param_bytes=40)
    problem = build_problem(prof, cluster(2), microbatches=2, schedule="1f1b")
    split = (StageSpec(0, 2, "d0"), StageSpec(2, 5, "d1"))  # chain(4): input + 4 ops of 10 param bytes
    sims = stage_sims(problem, split)
    assert [s.update_s for s in sims] == pytest.approx([0.1, 0.3])
    plain = build_problem(chain(4), cluster(2), microbatches=2, schedule="1f1b")
    assert evaluate(problem, split).step_time_s > evaluate(plain, split).step_time_s


def test_a_stage_pays_the_optimizer_step_per_tensor_besides_per_byte() -> None:
    """An optimizer step costs a sweep over the bytes and a fixed cost per tensor: a stage of a few small tensors
    pays for their count (the digits CNN's step is mostly that on CPU), the whole model still pays its measured
    step, and a profile without ``update_tensor_s`` prices bytes alone, as before."""
    from planner.errors import InputFileError
    from planner.partition.model.cost import stage_sims
    from planner.partition.model.problem import StageSpec

    nodes = [node("x", op="input")]
    for i, (nbytes, names) in enumerate([(10, ["a.w", "a.b"]), (10, ["b.w", "b.b"]), (1000, ["c.w"]), (1000, ["d.w"])]):
        nodes.append({**node(f"op{i}", [nodes[-1]["name"]], params=nbytes), "params": names})
    whole = dict(update_s={"adam": 0.4, "sgd": 0.1}, update_param_bytes=2020)
    per_tensor = dict(update_tensor_s={"adam": 0.05, "sgd": 0.01}, update_param_tensors=6)
    split = (StageSpec(0, 3, "d0"), StageSpec(3, 5, "d1"))  # the four small tensors, the two large ones
    measured = build_problem(with_whole_model(profile(*nodes), **whole, **per_tensor), cluster(2), microbatches=2,
                             schedule="1f1b")
    rate = (0.4 - 6 * 0.05) / 2020
    assert measured.update_s_per_param_tensor["cpu"] == pytest.approx(0.05)
    assert measured.update_s_per_param_byte["cpu"] == pytest.approx(rate)
    assert [s.update_s for s in stage_sims(measured, split)] == pytest.approx([4 * 0.05 + 20 * rate, 2 * 0.05 + 2000 * rate])
    assert stage_sims(measured, (StageSpec(0, 5, "d0"),))[0].update_s == pytest.approx(0.4)  # the measured step
    older = build_problem(with_whole_model(profile(*nodes), **whole), cluster(2), microbatches=2, schedule="1f1b")
    assert [s.update_s for s in stage_sims(older, split)] == pytest.approx([0.4 * 20 / 2020, 0.4 * 2000 / 2020])
    for bad in ({"update_tensor_s": {"adam": -1.0}}, {"update_tensor_s": [0.05]},
                {"update_tensor_s": {"adam": "fast"}}, {"update_tensor_s": {"adam": 0.05}, "update_param_tensors": "six"}):
        with pytest.raises(InputFileError, match="update_tensor_s"):
            build_problem(with_whole_model(profile(*nodes), **whole, **bad), cluster(2), microbatches=2, schedule="1f1b")


def test_asynchronous_stages_also_pay_their_weight_versions_at_each_update() -> None:
    """The version bookkeeping (snapshot, delta, predicted copy) is measured per parameter byte on the profiled type,
    estimated elsewhere, and charged on top of the optimizer step under async-1f1b and 2bw only; a profile older
    than the measurement charges none."""
    from planner.formats.catalog import load_catalog
    from planner.partition.model.cost import stage_sims
    from planner.partition.model.problem import StageSpec
    from planner.roofline import estimate_version_s_per_param_byte

    prof = with_whole_model(chain(4), update_s={"adam": 0.4, "sgd": 0.1}, update_param_bytes=40, version_s=0.2)
    net = cluster(2, types=["cpu", "a100-80g"])
    split = (StageSpec(0, 2, "d0"), StageSpec(2, 5, "d1"))  # chain(4): input + 4 ops of 10 param bytes
    updates = {}
    for schedule in ("1f1b", "async-1f1b", "2bw"):
        problem = build_problem(prof, net, catalog=load_catalog(), microbatches=4, schedule=schedule)
        updates[schedule] = [s.update_s for s in stage_sims(problem, split)]
    assert problem.version_s_per_param_byte["cpu"] == pytest.approx(0.2 / 40)
    a100 = load_catalog()["a100-80g"]
    assert problem.version_s_per_param_byte["a100-80g"] == pytest.approx(estimate_version_s_per_param_byte(a100))
    adam_a100 = problem.update_s_per_param_byte["a100-80g"]
    assert updates["1f1b"] == pytest.approx([0.1, 30 * adam_a100])
    assert updates["async-1f1b"] == updates["2bw"] == pytest.approx(
        [0.1 + 0.05, 30 * (adam_a100 + estimate_version_s_per_param_byte(a100))])
    older = with_whole_model(chain(4), update_s={"adam": 0.4, "sgd": 0.1}, update_param_bytes=40)
    old = build_problem(older, cluster(2), microbatches=4, schedule="async-1f1b")
    assert old.version_s_per_param_byte == {} and [s.update_s for s in stage_sims(old, split)] == pytest.approx([0.1, 0.3])


def test_the_default_loss_is_paid_by_the_last_block() -> None:
    from planner.formats.catalog import load_catalog
    from planner.roofline import estimate_loss_s

    prof = with_whole_model(chain(3), loss={"name": "mse", "fwd_s": 0.25, "bwd_s": 0.5, "output_bytes": 4096})
    net = cluster(2, types=["cpu", "a100-80g"])
    problem = build_problem(prof, net, catalog=load_catalog(), microbatches=2, schedule="1f1b")
    assert problem.blocks[-1].time_s["cpu"] == pytest.approx((1.25, 2.5))
    assert problem.blocks[1].time_s["cpu"] == (1.0, 2.0)
    raw = build_problem(chain(3), net, microbatches=2, schedule="1f1b")
    extra = estimate_loss_s(4096, load_catalog()["a100-80g"])
    assert problem.blocks[-1].time_s["a100-80g"] == pytest.approx(
        tuple(a + b for a, b in zip(raw.blocks[-1].time_s["a100-80g"], extra)))
    assert raw.loss_s == {}


@pytest.mark.parametrize("train_s, factor", [(10.8, 1.2), (90.0, None)])
def test_profile_summary_reports_the_factor_the_cost_model_applies(train_s, factor) -> None:
    from planner.report.profile_summary import profile_summary

    whole = profile_summary(with_whole_model(chain(3), train_s=train_s, sum_ops_fwd_s=3.0, sum_ops_bwd_s=6.0))
    assert whole["whole_model"].get("calibration") == (pytest.approx(factor) if factor else None)


def test_a_type_the_profile_lacks_needs_the_catalog_passed_in() -> None:
    """The core reads no file: estimating a type the profile did not time needs the caller's catalog."""
    with pytest.raises(PlannerError, match="needs the device catalog"):
        build_problem_without_catalog(chain(2), cluster(2, types=["cpu", "t4"]), microbatches=1, schedule="gpipe")


def test_a_problems_variants_are_built_once_and_share_its_tables() -> None:
    """The same change gives the same problem again (its step times are then remembered); another device order is
    another problem, and the same order asked for again, on a new copy of the cluster, finds the one built first."""
    from planner.partition.model.problem import with_device_order, with_microbatches

    problem = build_problem(chain(4), cluster(3), microbatches=4, schedule="1f1b")
    fewer = with_microbatches(problem, 2)
    assert with_microbatches(problem, 2) is fewer and fewer.microbatches == 2 and fewer.tables is problem.tables
    assert with_device_order(problem, ["d0", "d1", "d2"]) is problem
    turned = with_device_order(problem, ["d2", "d0", "d1"])
    assert turned.cluster.device_ids == ("d2", "d0", "d1") and turned.tables is problem.tables
    assert with_device_order(problem, ["d2", "d0", "d1"]) is turned
    assert with_device_order(problem, ["d1", "d2", "d0"]).cluster.device_ids == ("d1", "d2", "d0")
