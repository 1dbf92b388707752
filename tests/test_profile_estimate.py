"""Roofline estimates from a profile node alone, the op classifier and the device catalog."""

from __future__ import annotations

import pytest

from planner.errors import UsageError
from planner.formats.profile import Node, OpTime
from planner.profile.catalog import detect_device_type, device_spec, load_catalog
from planner.profile.estimate import EFFICIENCY, add_estimates, classify, estimate_node_time

TYPES = ("h100-sxm", "h200", "a100-80g", "a100-40g", "v100-32g", "t4", "l4", "cpu")


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
        device_spec("h900")


def test_local_device_type_is_detected():
    assert detect_device_type("cpu") == "cpu"


def test_compute_bound_matmul_golden():
    h100 = device_spec("h100-sxm")
    t = estimate_node_time(node(flops=2 * 10**12, bwd_flops=4 * 10**12, bytes_moved=10**6, op_class="matmul",
                                dtype="float32"), "h100-sxm")
    eff = EFFICIENCY["matmul"][0]
    assert t.source == "estimated"
    assert t.fwd == pytest.approx(2e12 / (66.9e12 * eff) + h100.launch_overhead_s)
    assert t.bwd == pytest.approx(4e12 / (66.9e12 * eff) + h100.launch_overhead_s)


def test_half_precision_uses_the_tensor_core_peak():
    fp32 = estimate_node_time(node(flops=10**12, op_class="matmul", dtype="float32", bytes_moved=0), "a100-80g")
    bf16 = estimate_node_time(node(flops=10**12, op_class="matmul", dtype="bfloat16", bytes_moved=0), "a100-80g")
    launch = device_spec("a100-80g").launch_overhead_s
    assert (fp32.fwd - launch) / (bf16.fwd - launch) == pytest.approx(312 / 19.5)


def test_memory_bound_elementwise_golden():
    spec = device_spec("t4")
    t = estimate_node_time(node(op="aten.gelu.default", bytes_moved=320 * 10**6, op_class="elementwise"), "t4")
    assert t.fwd == pytest.approx(320e6 / (320e9 * EFFICIENCY["elementwise"][1]) + spec.launch_overhead_s)
    assert t.bwd == pytest.approx(2 * 320e6 / (320e9 * EFFICIENCY["elementwise"][1]) + spec.launch_overhead_s)


def test_views_inputs_and_no_grad_ops():
    assert estimate_node_time(node(op="aten.view.default", op_class="view"), "l4") == OpTime(0.0, 0.0, "estimated")
    assert estimate_node_time(node(op="input"), "l4").fwd == 0.0
    no_grad = estimate_node_time(node(op="aten.arange.default", grad=False, bytes_moved=100), "l4")
    assert no_grad.fwd > 0 and no_grad.bwd == 0.0


def test_nodes_without_extra_fields_fall_back_to_output_and_parameter_bytes():
    bare = estimate_node_time(node(op="aten.add.Tensor"), "v100-32g")
    spec = device_spec("v100-32g")
    assert bare.fwd == pytest.approx((2 * 1000 + 500) / (900e9 * 0.7) + spec.launch_overhead_s)


def test_missing_bwd_flops_default_to_twice_forward():
    t = estimate_node_time(node(flops=10**12, op_class="matmul", bytes_moved=0), "h200")
    spec = device_spec("h200")
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
    out = add_estimates(nodes, ("cpu", "h100-sxm"))
    assert out[0].time_s["cpu"] == OpTime(1.0, 2.0, "measured")
    assert out[0].time_s["h100-sxm"].source == "estimated"
    with pytest.raises(UsageError):
        add_estimates(nodes, ("tpu",))
