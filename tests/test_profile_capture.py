"""Capture: node names, topological order, module paths, parameters, tracer fallback and failures."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.errors import CaptureError, UsageError
from planner.examples.gpt import gpt_tiny
from planner.profile.capture import capture


@pytest.fixture(scope="module")
def tiny():
    model, inputs = gpt_tiny()
    return model, inputs, capture(model, inputs)


def test_export_is_the_default_tracer_and_names_are_the_graphs_own(tiny):
    model, inputs, cap = tiny
    assert cap.tracer == "export"
    graph_names = {n.name for n in cap.graph_module.graph.nodes}
    assert all(op.name in graph_names for op in cap.ops)
    assert len({op.name for op in cap.ops}) == len(cap.ops)


def test_inputs_are_nodes_and_parameters_are_not(tiny):
    _, _, cap = tiny
    assert cap.ops[0].name == "idx" and cap.ops[0].op == "input"
    assert [op.name for op in cap.ops if op.op == "input"] == ["idx"]
    assert not any(op.name.startswith("p_") for op in cap.ops)


def test_ops_are_topologically_ordered(tiny):
    _, _, cap = tiny
    seen: set[str] = set()
    for op in cap.ops:
        assert set(op.inputs) <= seen, op.name
        seen.add(op.name)


def test_module_paths_and_parameters_are_kept(tiny):
    _, _, cap = tiny
    qkv = [op for op in cap.ops if op.module_path == "blocks.1.attn.qkv"]
    assert [op.op for op in qkv] == ["aten.linear.default"]
    assert qkv[0].params == ("blocks.1.attn.qkv.weight", "blocks.1.attn.qkv.bias")
    paths = {op.module_path for op in cap.ops}
    assert {"wte", "wpe", "blocks.0.ln_1", "blocks.0.mlp.fc", "ln_f", "lm_head"} <= paths


def test_tied_weight_is_read_by_embedding_and_head(tiny):
    _, _, cap = tiny
    users = [op.module_path for op in cap.ops if any(p in ("wte.weight", "lm_head.weight") for p in op.params)]
    assert users == ["wte", "lm_head"]


def test_graph_runs_with_the_live_parameters(tiny):
    model, inputs, cap = tiny
    out = cap.graph_module(*cap.graph_args(model, inputs))
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, model(*inputs))


def test_fx_tracer_on_request():
    model, inputs = gpt_tiny()
    cap = capture(model, inputs, tracer="fx")
    assert cap.tracer == "fx"
    lm_head = [op for op in cap.ops if op.module_path == "lm_head"]
    assert lm_head[0].op == "module:torch.nn.modules.linear.Linear"
    assert lm_head[0].params == ("lm_head.weight",)
    torch.testing.assert_close(cap.graph_module(*inputs), model(*inputs))


class NumpyRoundTrip(nn.Module):
    """torch.export cannot fake ``.numpy()``; torch.fx records it as a method call."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + x.detach().numpy().mean()


class DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # control flow on a tensor value: neither tracer can follow it
            return x * 2
        return x


def test_auto_falls_back_to_fx_when_export_fails():
    cap = capture(NumpyRoundTrip(), (torch.randn(2, 4),))
    assert cap.tracer == "fx"


def test_export_failure_names_the_line_and_suggests_fx():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(3),), tracer="export")
    assert "test_profile_capture.py" in str(info.value) and "if x.sum() > 0" in str(info.value)
    assert "--tracer fx" in str(info.value)


def test_neither_tracer_names_both_failures():
    with pytest.raises(CaptureError, match="neither tracer") as info:
        capture(DataDependent(), (torch.randn(3),))
    assert "torch.export failed" in str(info.value) and "symbolic_trace failed" in str(info.value)


def test_unknown_tracer_is_a_usage_error():
    with pytest.raises(UsageError, match="auto, export, fx"):
        capture(DataDependent(), (torch.randn(3),), tracer="jit")
