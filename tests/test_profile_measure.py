"""Measurement bookkeeping: bytes, parameters counted once (tied too), FLOPs, saved bytes, order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.formats.profile import load_profile, save_profile
from planner.profile import profile_model
from planner.profile.capture import capture
from planner.profile.measure import measure
from planner.profile.profiler import build_profile

B, S, C, V = 2, 16, 32, 128  # gpt_tiny: batch, sequence, width, vocabulary


@pytest.fixture(scope="module")
def tiny():
    return profile_model("planner.examples.gpt:gpt_tiny", repeats=2, warmup=1)


def by_name(profile):
    return {n.name: n for n in profile.nodes}


def test_every_node_has_a_measured_cpu_time(tiny):
    assert tiny.extra["device_type"] == "cpu"
    for node in tiny.nodes:
        t = node.time_s["cpu"]
        assert t.source == "measured" and t.fwd >= 0 and t.bwd >= 0
    working = [n for n in tiny.nodes if n.extra["op_class"] not in ("input", "view")]
    assert sum(n.time_s["cpu"].fwd for n in working) > 0
    assert sum(n.time_s["cpu"].bwd for n in working) > 0
    assert "measure_failures" not in tiny.extra


def test_nodes_are_topological_and_start_with_the_input(tiny):
    seen: set[str] = set()
    for node in tiny.nodes:
        assert set(node.inputs) <= seen
        seen.add(node.name)
    assert tiny.nodes[0].op == "input" and tiny.nodes[0].output_bytes == B * S * 8


def test_parameters_count_once_including_the_tied_head(tiny):
    model_bytes = tiny.model["param_bytes"]
    assert sum(n.param_bytes for n in tiny.nodes) == model_bytes
    names = [p for n in tiny.nodes for p in n.params]
    assert len(names) == len(set(names))
    nodes = by_name(tiny)
    assert nodes["embedding"].param_bytes == V * C * 4  # the tied weight, at its first use
    head = [n for n in tiny.nodes if n.module_path == "lm_head"][0]
    assert head.param_bytes == 0 and head.params == ()
    assert tiny.extra["tied_parameters"] == [
        {"params": ["lm_head.weight", "wte.weight"], "nodes": ["embedding", head.name], "bytes": V * C * 4}]


def test_output_bytes_flops_and_classes_of_a_linear(tiny):
    qkv = [n for n in tiny.nodes if n.module_path == "blocks.0.attn.qkv"][0]
    assert qkv.output_bytes == B * S * 3 * C * 4
    assert qkv.flops == 2 * B * S * C * 3 * C
    assert qkv.bwd_flops == 2 * qkv.flops
    assert qkv.extra["op_class"] == "matmul" and qkv.extra["dtype"] == "float32" and qkv.extra["grad"] is True
    assert qkv.extra["bytes_moved"] == B * S * C * 4 + (3 * C * C + 3 * C) * 4 + qkv.output_bytes


def test_views_move_no_bytes_and_inputs_need_no_backward(tiny):
    nodes = by_name(tiny)
    for node in tiny.nodes:
        if node.op in ("aten.view.default", "operator.getitem", "aten.transpose.int"):
            assert node.extra["op_class"] == "view" and node.extra["bytes_moved"] == 0
    assert nodes["idx"].extra["grad"] is False
    assert nodes["arange"].extra["grad"] is False and nodes["arange"].time_s["cpu"].bwd == 0.0


def test_saved_bytes_are_attributed_to_the_ops_that_save(tiny):
    nodes = by_name(tiny)
    assert nodes["layer_norm"].saved_bytes >= B * S * C * 4  # its input is kept for backward
    assert sum(n.saved_bytes for n in tiny.nodes) > 0
    assert all(n.saved_bytes == 0 for n in tiny.nodes if n.op == "operator.getitem")


def test_uncounted_flops_list_working_ops_without_a_formula(tiny):
    ops = {u["op"] for u in tiny.extra["uncounted_flops"]}
    assert {"aten.gelu.default", "aten.layer_norm.default"} <= ops
    assert "aten.linear.default" not in ops and "aten.scaled_dot_product_attention.default" not in ops


def test_whole_model_is_recorded_next_to_the_sum_of_ops(tiny):
    whole = tiny.extra["whole_model"]
    assert set(whole) == {"fwd_s", "bwd_s", "sum_ops_fwd_s", "sum_ops_bwd_s", "train_s", "update_s",
                          "update_param_bytes", "update_tensor_s", "update_param_tensors", "version_s",
                          "split_backward", "loss", "rows_scaling"}
    assert whole["version_s"] > 0
    scaling = whole["rows_scaling"]  # a micro-batch of twice the rows, timed beside train_s
    rows = tiny.model["microbatch_size"]
    assert scaling["rows"] == [rows, 2 * rows] and scaling["train_s"][0] == whole["train_s"]
    assert scaling["train_s"][1] > 0 and 0 <= scaling["fixed_fraction"] <= 1
    points = whole["split_backward"]  # token ids in: from the embedding on, then the later half
    assert len(points) == 2 and all(set(p) == {"saved_bytes", "fused_s", "input_s", "weight_s"} for p in points)
    assert all(t > 0 for p in points for t in p.values())
    assert points[0]["saved_bytes"] == sum(n.saved_bytes for n in tiny.nodes)
    assert 0.3 < points[1]["saved_bytes"] / points[0]["saved_bytes"] <= 0.6
    assert whole["loss"]["name"] in ("lm-cross-entropy", "mse") and whole["loss"]["fwd_s"] >= 0
    assert whole["loss"]["output_bytes"] > 0
    assert whole["fwd_s"] > 0 and whole["bwd_s"] > 0 and whole["train_s"] > 0
    assert whole["sum_ops_fwd_s"] == pytest.approx(sum(n.time_s["cpu"].fwd for n in tiny.nodes))
    assert set(whole["update_s"]) == {"sgd", "adam"} and all(t > 0 for t in whole["update_s"].values())
    assert whole["update_param_bytes"] == tiny.model["param_bytes"]
    assert set(whole["update_tensor_s"]) == {"sgd", "adam"} and all(t > 0 for t in whole["update_tensor_s"].values())
    assert whole["update_param_tensors"] == len({name for n in tiny.nodes for name in n.params})  # each tensor once


def test_training_and_update_measurements_leave_the_model_as_it_was():
    from planner.profile.whole_model import measure_training as _measure_training, measure_update as _measure_update, probe as _probe
    from planner.profile.whole_model import measure_split_backward, measure_versions
    from planner.profile.timer import Timer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    timer = Timer(torch.device("cpu"), repeats=3, warmup=1)
    inputs = (torch.randn(4, 8),)
    _, grads_out = _probe(model, inputs)
    assert _measure_training(model, inputs, grads_out, timer) > 0
    assert set(_measure_update(model, timer)) == {"sgd", "adam"}
    assert measure_versions(model, timer) > 0
    assert set(measure_split_backward(model, inputs, timer)) == {"fused_s", "input_s", "weight_s"}
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class TwoHeads(nn.Module):
    """Token ids in; a dict out whose ``hidden`` an op after it also saved for its backward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(16, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = torch.tanh(self.lin(self.emb(idx)))
        return {"logits": self.head(hidden), "hidden": hidden}


def test_the_split_backward_is_timed_on_what_torchs_zero_bubble_runtime_runs(monkeypatch):
    """The halves timed compute the fused backward's weight gradients, from the first activation on when the inputs
    are token ids (the embedding's weight gets none, as on a stage that receives activations), on outputs of their
    own (``I`` detaches them in place, and ``hidden`` is also saved by the head)."""
    from torch.distributed.pipelining import _backward
    from planner.profile.timer import Timer
    from planner.profile.whole_model import measure_split_backward

    torch.manual_seed(0)
    model, idx = TwoHeads(), torch.randint(0, 16, (4, 5))
    seen: dict = {}
    real_input, real_weight = _backward.stage_backward_input, _backward.stage_backward_weight

    def input_half(outputs, output_grads, inputs, weights):
        seen["output_grads"] = list(output_grads)
        return real_input(outputs, output_grads, inputs, weights)

    def weight_half(weights, groups, retain_graph=False):
        before = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        out = real_weight(weights, groups, retain_graph)
        seen["dw"] = {n: p.grad - before[n] for n, p in model.named_parameters() if p.grad is not None}
        return out

    monkeypatch.setattr(_backward, "stage_backward_input", input_half)
    monkeypatch.setattr(_backward, "stage_backward_weight", weight_half)
    split = measure_split_backward(model, (idx,), Timer(torch.device("cpu"), repeats=1, warmup=0))
    assert set(split) == {"fused_s", "input_s", "weight_s"} and all(p.grad is None for p in model.parameters())
    out = model(idx)
    names = ["lin.weight", "lin.bias", "head.weight", "head.bias"]
    params = dict(model.named_parameters())
    fused = torch.autograd.grad([out["logits"], out["hidden"]], [params[n] for n in names], seen["output_grads"])
    assert set(seen["dw"]) == set(names)  # not the embedding: the stage starts after it
    for name, grad in zip(names, fused):
        torch.testing.assert_close(seen["dw"][name], grad, rtol=1e-5, atol=1e-6)
    assert measure_split_backward(nn.Sequential(nn.Embedding(16, 8)).requires_grad_(False), (idx,),
                                  Timer(torch.device("cpu"), repeats=1, warmup=0)) == {}


def test_profile_round_trips_through_the_file_format(tiny, tmp_path):
    path = save_profile(tiny, tmp_path / "p.json")
    again = load_profile(path)
    assert [n.name for n in again.nodes] == [n.name for n in tiny.nodes]
    assert again.nodes[5].extra["bytes_moved"] == tiny.nodes[5].extra["bytes_moved"]


class Shared(nn.Module):
    """One Linear applied twice: its parameters are shared between two nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.lin(x)))


@pytest.mark.parametrize("tracer", ["export", "fx"])
def test_a_module_used_twice_counts_its_parameters_once(tracer):
    model, x = Shared(), torch.randn(4, 8)
    cap = capture(model, (x,), tracer)
    m = measure(cap, model, (x,), device=torch.device("cpu"), repeats=1, warmup=0)
    profile = build_profile("test:shared", model, (x,), cap, m, "cpu")
    users = [n for n in profile.nodes if n.extra["op_class"] == "matmul"]
    assert [n.param_bytes for n in users] == [(64 + 8) * 4, 0]
    assert [n.params for n in users] == [("lin.weight", "lin.bias"), ()]
    assert [g["params"] for g in profile.extra["tied_parameters"]] == [["lin.bias"], ["lin.weight"]]
    assert all(g["nodes"] == [u.name for u in users] for g in profile.extra["tied_parameters"])


def test_estimates_are_added_next_to_the_measured_times():
    profile = profile_model("planner.examples.gpt:gpt_tiny", repeats=1, warmup=0, estimate=("h100-sxm", "cpu"))
    assert profile.extra["estimated_device_types"] == ["h100-sxm"]  # the local type stays measured
    assert profile.device_types == ("cpu", "h100-sxm")
    assert {n.time_s["h100-sxm"].source for n in profile.nodes} == {"estimated"}
    assert {n.time_s["cpu"].source for n in profile.nodes} == {"measured"}


def test_microbatch_size_rescales_the_inputs():
    profile = profile_model("planner.examples.gpt:gpt_tiny", repeats=1, warmup=0, microbatch_size=3)
    assert profile.model["microbatch_size"] == 3
    assert profile.nodes[0].output_bytes == 3 * S * 8


def test_timer_runs_setup_outside_every_call_and_never_returns_negative():
    from planner.profile.timer import Timer

    timer = Timer(torch.device("cpu"), repeats=3, warmup=2)
    calls = []
    elapsed = timer.time(lambda state: calls.append(state), lambda: len(calls))
    assert calls == [0, 1, 2, 3, 4] and elapsed >= 0.0
    with pytest.raises(ValueError):
        Timer(torch.device("cpu"), repeats=0, warmup=0)


def test_single_threaded_cpu_timing_uses_the_thread_clock(tiny):
    from planner.profile.timer import default_clock

    measurement = tiny.extra["measurement"]
    assert measurement["threads"] == 1 and measurement["clock"] == "thread_cpu"
    assert measurement["repeats"] == 2 and measurement["warmup"] == 1
    assert default_clock(torch.device("cuda")) == "cuda_events"


def test_tensors_without_readable_storage_get_key_zero_and_are_never_aliases():
    from planner.profile.memory import aliases as _aliases, storage_key as _storage_key

    sparse = torch.eye(3).to_sparse()
    with pytest.raises(NotImplementedError):  # torch refuses: the except branch of _storage_key
        sparse.untyped_storage()
    meta = torch.empty(3, device="meta")
    assert meta.untyped_storage().data_ptr() == 0  # torch answers 0 itself
    dense = torch.ones(3)
    assert _storage_key(sparse) == 0 and _storage_key(meta) == 0
    assert _storage_key(dense) != 0 and _storage_key(dense.view(3, 1)) == _storage_key(dense)
    assert _aliases(dense.view(3, 1), (dense,), [])
    assert not _aliases(torch.empty(3, device="meta"), (meta,), [])  # both key 0: unknown, not shared
    assert not _aliases(torch.eye(3).to_sparse(), (sparse,), [])


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


@pytest.mark.slow  # measures for real: outside the fast tier (docs/ci.md)
def test_identical_blocks_measure_alike_the_first_included() -> None:
    """Issue 12: every op is warmed before any is timed, so the first of N identical blocks is not inflated
    by the allocator's growth, cold caches or one-off kernel setup (it measured 15% to 4x its twins). A ratio
    between ops of one profile, with a wide tolerance: no absolute time is asserted.

    This machine (2 shared cores) has slow spells of about half a second that inflate whichever block is timed
    then by 25-55% (thread CPU time: 8 profiles in a row inflated block 0 twice and block 1 once, 2026-11-30), so
    a profile outside the bounds is taken once more: an inflation due to the order shows in both."""
    from planner.profile.capture import capture
    from planner.profile.measure import measure

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Block(192) for _ in range(6)])
    inputs = (torch.randn(32, 16, 192),)
    captured = capture(model, inputs)
    for _ in range(2):
        measurement = measure(captured, model, inputs, device=torch.device("cpu"), repeats=7, warmup=2)
        per_block: dict[str, float] = {}
        for op, m in zip(captured.ops, measurement.ops):
            block = op.module_path.split(".")[0]
            if block.isdigit():
                per_block[block] = per_block.get(block, 0.0) + m.fwd_s + m.bwd_s
        times = [per_block[str(i)] for i in range(6)]
        others = sorted(times[1:])[2]
        # Not inflated (measured here: 0.94-1.15, 10% noise between runs), nor much faster than its twins. Against
        # the fastest twin rather than the median: the suite runs beside other tests, whose load can change during
        # the measurement, and one run on a fresh clone timed the six blocks 0.016, 0.019, 0.023, 0.024, 0.023,
        # 0.022 s, a trend of the host's speed, not of the order.
        checks = {"not inflated": times[0] / others < 1.35, "not much faster": times[0] / min(times[1:]) > 1 / 1.35,
                  "twins alike": max(times) / min(times) < 2.0}
        if all(checks.values()):
            break
    assert all(checks.values()), (checks, times)
