"""Roofline estimates from a profile node alone, the op classifier and the device catalog."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import UsageError
from planner.formats.profile import Node, OpTime
from planner.formats.catalog import device_spec, load_catalog
from planner.profile.device import detect_device_type
from planner.roofline import EFFICIENCY, PRECISIONS, add_estimates, classify, estimate_node_time

TYPES = ("h100-sxm", "h200", "a100-80g", "a100-40g", "v100-32g", "t4", "l4", "cpu")


def _estimate_node_time(node, device_type, precision=None):  # type: ignore[no-untyped-def]
    """The roofline with the bundled catalog (the core takes the catalog as an argument)."""
    return estimate_node_time(node, device_type, load_catalog(), precision)


def _add_estimates(nodes, device_types, precision=None):  # type: ignore[no-untyped-def]
    return add_estimates(nodes, device_types, load_catalog(), precision)


def node(op: str = "aten.linear.default", flops: int = 0, bwd_flops: int = 0, **extra) -> Node:
    return Node(name="n", op=op, inputs=(), output_bytes=1000, param_bytes=500,
                time_s={"cpu": OpTime(1.0, 2.0, "measured")}, flops=flops, bwd_flops=bwd_flops, extra=extra)


def test_catalog_lists_every_type_with_sources():
    catalog = load_catalog()
    assert set(TYPES) <= set(catalog)
    for spec in catalog.values():
        assert spec.bf16_flops >= spec.fp32_flops > 0 and spec.memory_bandwidth_Bps > 0 and spec.memory_bytes > 0
        assert {"bf16_flops", "fp32_flops", "memory_bandwidth_Bps", "memory_bytes"} <= set(spec.sources)


def test_unknown_device_type_names_the_known_ones():
    with pytest.raises(UsageError, match="unknown device type 'h900'.*a100-80g.*h100-sxm"):
        device_spec("h900", load_catalog())


def test_local_device_type_is_detected():
    assert detect_device_type("cpu") == "cpu"


def test_compute_bound_matmul_golden():
    h100 = device_spec("h100-sxm", load_catalog())
    t = _estimate_node_time(node(flops=2 * 10**12, bwd_flops=4 * 10**12, bytes_moved=10**6, op_class="matmul",
                                dtype="float32"), "h100-sxm")
    eff = EFFICIENCY["matmul"][0]
    assert t.source == "estimated"
    assert t.fwd == pytest.approx(2e12 / (66.9e12 * eff) + h100.launch_overhead_s)
    assert t.bwd == pytest.approx(4e12 / (66.9e12 * eff) + h100.launch_overhead_s)


def test_half_precision_uses_the_tensor_core_peak():
    fp32 = _estimate_node_time(node(flops=10**12, op_class="matmul", dtype="float32", bytes_moved=0), "a100-80g")
    bf16 = _estimate_node_time(node(flops=10**12, op_class="matmul", dtype="bfloat16", bytes_moved=0), "a100-80g")
    launch = device_spec("a100-80g", load_catalog()).launch_overhead_s
    assert (fp32.fwd - launch) / (bf16.fwd - launch) == pytest.approx(312 / 19.5)


def test_memory_bound_elementwise_golden():
    spec = device_spec("t4", load_catalog())
    t = _estimate_node_time(node(op="aten.gelu.default", bytes_moved=320 * 10**6, op_class="elementwise"), "t4")
    assert t.fwd == pytest.approx(320e6 / (320e9 * EFFICIENCY["elementwise"][1]) + spec.launch_overhead_s)
    assert t.bwd == pytest.approx(2 * 320e6 / (320e9 * EFFICIENCY["elementwise"][1]) + spec.launch_overhead_s)


def test_views_inputs_and_no_grad_ops():
    assert _estimate_node_time(node(op="aten.view.default", op_class="view"), "l4") == OpTime(0.0, 0.0, "estimated")
    assert _estimate_node_time(node(op="input"), "l4").fwd == 0.0
    no_grad = _estimate_node_time(node(op="aten.arange.default", grad=False, bytes_moved=100), "l4")
    assert no_grad.fwd > 0 and no_grad.bwd == 0.0


def test_nodes_without_extra_fields_fall_back_to_output_and_parameter_bytes():
    bare = _estimate_node_time(node(op="aten.add.Tensor"), "v100-32g")
    spec = device_spec("v100-32g", load_catalog())
    assert bare.fwd == pytest.approx((2 * 1000 + 500) / (900e9 * 0.7) + spec.launch_overhead_s)


def test_missing_bwd_flops_default_to_twice_forward():
    t = _estimate_node_time(node(flops=10**12, op_class="matmul", bytes_moved=0), "h200")
    spec = device_spec("h200", load_catalog())
    assert t.bwd - spec.launch_overhead_s == pytest.approx(2 * (t.fwd - spec.launch_overhead_s))


@pytest.mark.parametrize("op,cls", [
    ("aten.linear.default", "matmul"), ("aten.conv2d.default", "matmul"), ("aten.addmm.default", "matmul"),
    ("aten.scaled_dot_product_attention.default", "attention"), ("aten.view.default", "view"),
    ("operator.getitem", "view"), ("aten.t.default", "view"), ("aten.sum.dim_IntList", "reduction"),
    ("aten._softmax.default", "elementwise"), ("aten.softmax.int", "reduction"), ("aten.gelu.default", "elementwise"),
    ("input", "input"), ("module:torch.nn.modules.linear.Linear", "matmul"), ("Tensor.view", "view"),
])
def test_classify(op, cls):
    assert classify(op) == cls


def test_add_estimates_keeps_measured_times_and_rejects_unknown_types():
    nodes = (node(flops=10**9, op_class="matmul", bytes_moved=10),)
    out = _add_estimates(nodes, ("cpu", "h100-sxm"))
    assert out[0].time_s["cpu"] == OpTime(1.0, 2.0, "measured")
    assert out[0].time_s["h100-sxm"].source == "estimated"
    with pytest.raises(UsageError):
        _add_estimates(nodes, ("tpu",))


# --- --estimate-precision -------------------------------------------------------------------------

@pytest.mark.parametrize(("device", "precision", "peak"), [
    ("a100-80g", "fp32", 19.5e12), ("a100-80g", "tf32", 156e12), ("a100-80g", "bf16", 312e12),
    ("v100-32g", "fp32", 15.7e12), ("v100-32g", "tf32", 15.7e12), ("v100-32g", "bf16", 125e12),
    ("h100-sxm", "tf32", 494.7e12), ("l4", "tf32", 60e12), ("t4", "tf32", 8.1e12),
])
def test_precision_sets_the_matmul_peak(device: str, precision: str, peak: float) -> None:
    t = _estimate_node_time(node(flops=10**13, bwd_flops=2 * 10**13, op_class="matmul", dtype="float32", bytes_moved=0),
                           device, precision=precision)
    launch = device_spec(device, load_catalog()).launch_overhead_s
    assert t.fwd == pytest.approx(1e13 / (peak * EFFICIENCY["matmul"][0]) + launch)
    assert t.bwd == pytest.approx(2e13 / (peak * EFFICIENCY["matmul"][0]) + launch)


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_precision_keeps_non_tensor_core_ops_at_the_fp32_peak(precision: str) -> None:
    t = _estimate_node_time(node(op="aten.gelu.default", flops=10**12, op_class="elementwise", dtype="float32",
                                bytes_moved=0), "a100-80g", precision=precision)
    launch = device_spec("a100-80g", load_catalog()).launch_overhead_s
    assert t.fwd == pytest.approx(1e12 / (19.5e12 * EFFICIENCY["elementwise"][0]) + launch)


@pytest.mark.parametrize(("precision", "factor"), [("fp32", 1.0), ("tf32", 1.0), ("bf16", 0.5)])
def test_bytes_moved_scale_with_the_element_size(precision: str, factor: float) -> None:
    bandwidth = 2.039e12 * EFFICIENCY["elementwise"][1]
    t = _estimate_node_time(node(op="aten.add.Tensor", op_class="elementwise", dtype="float32", bytes_moved=8 * 10**8),
                           "a100-80g", precision=precision)
    launch = device_spec("a100-80g", load_catalog()).launch_overhead_s
    assert t.fwd == pytest.approx(factor * 8e8 / bandwidth + launch)
    assert t.bwd == pytest.approx(2 * factor * 8e8 / bandwidth + launch)


def test_a_bf16_profile_estimated_in_fp32_moves_twice_the_bytes() -> None:
    half = node(op="aten.add.Tensor", op_class="elementwise", dtype="bfloat16", bytes_moved=10**9)
    as_profiled = _estimate_node_time(half, "h100-sxm")
    as_fp32 = _estimate_node_time(half, "h100-sxm", precision="fp32")
    launch = device_spec("h100-sxm", load_catalog()).launch_overhead_s
    assert as_fp32.fwd - launch == pytest.approx(2 * (as_profiled.fwd - launch))


def test_default_precision_is_the_profiled_dtype() -> None:
    n = node(flops=10**12, op_class="matmul", dtype="float32", bytes_moved=10**6)
    assert _estimate_node_time(n, "a100-80g") == _estimate_node_time(n, "a100-80g", precision="fp32")


def test_non_float_outputs_are_not_rescaled() -> None:
    ids = node(op="aten.arange.default", op_class="elementwise", dtype="int64", bytes_moved=10**9)
    assert _estimate_node_time(ids, "a100-80g", precision="bf16") == _estimate_node_time(ids, "a100-80g")


def test_unknown_precision_is_one_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown estimate precision 'fp8'; expected one of fp32, tf32, bf16"):
        _estimate_node_time(node(), "a100-80g", precision="fp8")


def test_add_estimates_re_estimates_in_another_precision_and_keeps_measured_times() -> None:
    n = node(flops=10**13, op_class="matmul", dtype="float32", bytes_moved=0)
    fp32 = _add_estimates((n,), ("a100-80g",))
    bf16 = _add_estimates(fp32, ("a100-80g", "cpu"), precision="bf16")[0]
    assert bf16.time_s["cpu"] == OpTime(1.0, 2.0, "measured")
    assert bf16.time_s["a100-80g"].fwd < fp32[0].time_s["a100-80g"].fwd / 10


def test_build_problem_estimates_in_the_requested_precision() -> None:
    from planner.formats.cluster import Cluster, Device, Link
    from planner.formats.profile import Profile
    from planner.partition.model.problem import build_problem

    nodes = _add_estimates((node(flops=10**13, op_class="matmul", dtype="float32", bytes_moved=0),), ("a100-80g",))
    profile = Profile(model={"name": "m"}, nodes=nodes)
    cluster = Cluster("c", (Device("g0", "a100-80g", "h", 80 * 2**30), Device("g1", "v100-32g", "h", 32 * 2**30)),
                      intra_host=Link(1e11, 0.0), inter_host=Link(1e10, 0.0))
    default = build_problem(profile, cluster, catalog=load_catalog(), microbatches=2, schedule="1f1b")
    bf16 = build_problem(profile, cluster, catalog=load_catalog(), microbatches=2, schedule="1f1b", estimate_precision="bf16")
    for dev_type, fp32_peak, bf16_peak in (("a100-80g", 19.5e12, 312e12), ("v100-32g", 15.7e12, 125e12)):
        launch = device_spec(dev_type, load_catalog()).launch_overhead_s
        # the profile's estimated a100 entry and the missing v100 type are both estimated in bf16
        assert default.blocks[0].time_s[dev_type][0] - launch == pytest.approx(1e13 / (fp32_peak * 0.7))
        assert bf16.blocks[0].time_s[dev_type][0] - launch == pytest.approx(1e13 / (bf16_peak * 0.7))
    assert set(bf16.estimated_types) == {"a100-80g", "v100-32g"}


def test_colocation_scales_measured_times_only_where_a_host_shares_its_devices() -> None:
    """Issue 12: a profile measured under co-location (plan profile --colocate N) carries the slowdown;
    the cost model applies it on a host with N or more devices of the profiled type, nowhere else."""
    from dataclasses import replace
    from types import MappingProxyType

    from planner.clusters import resolve_cluster
    from planner.formats.cluster import load_cluster
    from planner.formats.profile import load_profile
    from planner.partition.model.times import calibration_factors

    profile = load_profile(Path(__file__).resolve().parent / "golden" / "profiles" / "gpt_tiny.json")
    local = str(profile.extra["device_type"])
    ops_s = sum(n.time_s[local].fwd + n.time_s[local].bwd for n in profile.nodes)
    measured = dict(profile.extra["whole_model"], train_s=1.1 * ops_s)
    profile = replace(profile, extra=MappingProxyType(dict(profile.extra, whole_model=measured)))
    plain = calibration_factors(profile)[local]
    assert plain == pytest.approx(1.1)
    whole = dict(measured, colocation={"ranks": 2, "train_s": 1.375 * ops_s, "factor": 1.25})
    colocated = replace(profile, extra=MappingProxyType(dict(profile.extra, whole_model=whole)))
    shared = load_cluster(resolve_cluster("cpu-2"))  # two cpu devices on one host
    assert calibration_factors(colocated, shared)[local] == pytest.approx(plain * 1.25)
    assert calibration_factors(colocated)[local] == pytest.approx(plain)  # no cluster: the profile alone
    alone = replace(shared, devices=(shared.devices[0],))
    assert calibration_factors(colocated, alone)[local] == pytest.approx(plain)
    # a loaded time under the lone one is noise: other ranks cannot make a rank faster
    faster = dict(measured, colocation={"ranks": 2, "train_s": 0.97 * 1.1 * ops_s, "factor": 0.97})
    noisy = replace(profile, extra=MappingProxyType(dict(profile.extra, whole_model=faster)))
    assert calibration_factors(noisy, shared)[local] == pytest.approx(plain)
    # with the lone times taken around the loaded windows (MEASUREMENT_VERSION 6 on): the lone micro-batch is the mean
    # of every lone timing, and a shared host takes the loaded one as measured, not a factor over one lone time
    def with_colocation(loaded: float) -> object:
        timed = {"ranks": 2, "train_s": loaded * ops_s, "factor": loaded / 1.05, "alone_s": [1.0 * ops_s, 1.05 * ops_s],
                 "loaded_s": [loaded * ops_s] * 3}
        whole_model = dict(measured, colocation=timed)
        return replace(profile, extra=MappingProxyType(dict(profile.extra, whole_model=whole_model)))

    lone = (1.1 + 1.0 + 1.05) / 3
    assert calibration_factors(with_colocation(1.2))[local] == pytest.approx(lone)
    assert calibration_factors(with_colocation(1.2), shared)[local] == pytest.approx(1.2)
    assert calibration_factors(with_colocation(1.02), shared)[local] == pytest.approx(lone)  # under the lone: noise
