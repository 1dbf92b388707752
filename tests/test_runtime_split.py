"""Graph splitting, routing, tied-parameter groups, data and the reference trainer, in one process."""

from __future__ import annotations

from types import MappingProxyType

import pytest
import torch

from planner.errors import PlanMismatchError
from planner.examples.gpt import gpt_tiny
from planner.examples.unet import UNet
from planner.formats.plan import Plan, Stage
from planner.profile.capture import capture
from planner.data import factory as data_mod
from planner.runtime.pipeline.graph_split import assign_nodes, split_graph
from planner.runtime.pipeline.stages import rank_of_stages, tied_groups
from planner.runtime.pipeline.training import TrainSettings, train_reference


@pytest.fixture(scope="module")
def gpt():
    module, inputs = gpt_tiny()
    return module, inputs, capture(module, inputs)


def _even(captured, parts: int) -> dict[str, int]:
    names = [op.name for op in captured.ops]
    return {name: i * parts // len(names) for i, name in enumerate(names)}


def _chain(stages, inputs):
    values = tuple(inputs)
    for stage in stages:
        out = stage.module(*values)
        values = out if isinstance(out, tuple) else (out,)
    return values[0]


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_chained_stages_equal_the_model(gpt, parts):
    module, inputs, captured = gpt
    stage_of = assign_nodes(captured, _even(captured, parts), parts)
    stages = split_graph(captured, module, stage_of, parts)
    assert [s.index for s in stages] == list(range(parts))
    torch.testing.assert_close(_chain(stages, inputs), module(*inputs), rtol=0, atol=0)


def test_stage_inputs_are_the_values_live_across_each_cut(gpt):
    module, inputs, captured = gpt
    stage_of = assign_nodes(captured, _even(captured, 3), 3)
    stages = split_graph(captured, module, stage_of, 3)
    assert stages[0].input_names == ("idx",)
    for before, after in zip(stages, stages[1:]):
        assert before.output_names == after.input_names
    assert stages[-1].output_names == ("linear_8",)
    users = {op.name: set() for op in captured.ops}
    for op in captured.ops:
        for src in op.inputs:
            users[src].add(stage_of[op.name])
    for k, stage in enumerate(stages[1:], start=1):  # live = made before k, read at k or later
        expected = {n for n, s in stage_of.items() if s < k and any(u >= k for u in users[n])}
        assert set(stage.input_names) == expected


def test_a_model_input_read_late_is_routed_through_the_stages_between():
    class Late(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) * ids.unsqueeze(-1)

    module = Late()
    inputs = (torch.randn(2, 4), torch.tensor([1, 2]))
    captured = capture(module, inputs)
    last = {op.name: 2 for op in captured.ops}
    last.update({captured.ops[i].name: 0 for i in range(3)})
    last.update({op.name: 1 for op in captured.ops if "linear_1" == op.name})
    stage_of = assign_nodes(captured, last, 3)
    stages = split_graph(captured, module, stage_of, 3)
    assert "ids" in stages[1].input_names and "ids" in stages[1].output_names
    torch.testing.assert_close(_chain(stages, inputs), module(*inputs))


def test_stage_modules_share_the_live_parameters(gpt):
    module, _, captured = gpt
    stages = split_graph(captured, module, assign_nodes(captured, _even(captured, 2), 2), 2)
    live = {id(p) for p in module.parameters()}
    assert all(id(p) in live for s in stages for p in s.module.parameters())
    assert sum(len(s.param_names) for s in stages) == len(live) + 1  # the tied weight is on both


def test_tied_embedding_and_head_form_one_group_over_their_ranks(gpt):
    module, _, captured = gpt
    stages = split_graph(captured, module, assign_nodes(captured, _even(captured, 3), 3), 3)
    assert tied_groups(stages, (0, 1, 2)) == [("wte.weight", (0, 2))]
    assert tied_groups(stages, (0, 1, 0)) == []  # both uses on rank 0: one tensor, no sync


def test_unknown_node_and_backward_edge_are_refused(gpt):
    _, _, captured = gpt
    placement = _even(captured, 2)
    with pytest.raises(PlanMismatchError, match="does not have"):
        assign_nodes(captured, {**placement, "no_such_node": 0}, 2)
    first_linear = next(op.name for op in captured.ops if op.op == "aten.linear.default")
    with pytest.raises(PlanMismatchError, match="stages must follow the graph"):
        assign_nodes(captured, {**placement, first_linear: 1, captured.ops[-1].name: 0}, 2)


def test_unplaced_ops_go_where_they_can_run():
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    captured = capture(module, (torch.randn(2, 3, 6, 6),))
    side_effect = next(op.name for op in captured.ops if op.op.endswith("add_.Tensor"))
    placement = {op.name: (0 if op.op in ("input", "aten.conv2d.default") else 1) for op in captured.ops}
    del placement[side_effect]
    stage_of = assign_nodes(captured, placement, 2)
    assert stage_of[side_effect] == 0  # with its producer (the buffer is not a node)


def _plan(devices: list[str], schedule: str) -> Plan:
    stages = tuple(Stage(i, d, ()) for i, d in enumerate(devices))
    return Plan("hand", schedule, 4, stages, MappingProxyType({"step_time_s": 1.0}))


def test_ranks_follow_devices_and_the_schedule():
    assert rank_of_stages(_plan(["b", "a"], "1f1b")) == (0, 1)
    assert rank_of_stages(_plan(["a", "b", "a", "b"], "interleaved-1f1b")) == (0, 1, 0, 1)
    with pytest.raises(PlanMismatchError, match="one stage per device"):
        rank_of_stages(_plan(["a", "b", "a"], "gpipe"))
    with pytest.raises(PlanMismatchError, match="interleaved"):
        rank_of_stages(_plan(["a", "b", "b", "a"], "interleaved-1f1b"))


def test_synthetic_batches_are_a_pure_function_of_seed_and_step(gpt):
    module, inputs, _ = gpt
    spec = data_mod.data_spec(inputs, module(*inputs))
    assert spec.loss == data_mod.LM_CROSS_ENTROPY
    a, b = data_mod.make_batch(spec, 7, 3, 8), data_mod.make_batch(spec, 7, 3, 8)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.equal(a[0][0], data_mod.make_batch(spec, 7, 4, 8)[0][0])
    ids, target = a[0][0], a[1]
    assert ids.shape == (8, 16) and torch.equal(target[:, :-1], ids[:, 1:])  # next-token targets
    assert int(ids.max()) < 128 and int(target.max()) < 128


def test_non_token_models_default_to_mse():
    module = UNet(widths=(8, 16))
    x = torch.randn(1, 3, 16, 16)
    spec = data_mod.data_spec((x,), module(x))
    inputs, target = data_mod.make_batch(spec, 0, 0, 2)
    assert spec.loss == data_mod.MSE and target.shape == (2, 3, 16, 16)


def test_reference_trainer_averages_micro_batches(gpt):
    module, inputs, _ = gpt
    spec = data_mod.data_spec(inputs, module(*inputs))
    settings = TrainSettings("sgd", 0.1, 2, 2, 0)
    batch = lambda step: data_mod.make_batch(spec, 0, step, 4)  # noqa: E731
    torch.manual_seed(0)
    whole, _ = gpt_tiny()
    result = train_reference(module, spec, settings, batch, 2)
    optimizer = torch.optim.SGD(whole.parameters(), lr=0.1)
    for step in range(2):  # the same steps on the whole batch (mean loss): equal within fp32 rounding
        x, y = batch(step)
        optimizer.zero_grad()
        loss = data_mod.loss_fn(spec)(whole(*x), y)
        loss.backward()
        optimizer.step()
        assert result.losses[step] == pytest.approx(float(loss.detach()), rel=1e-5)
    for name, value in whole.named_parameters():
        torch.testing.assert_close(result.params[name], value.detach(), rtol=1e-5, atol=1e-5)


def test_torch_fx_captures_split_too():
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    captured = capture(module, (x,), tracer="fx")
    stage_of = assign_nodes(captured, {op.name: (0 if i < 2 else 1) for i, op in enumerate(captured.ops)}, 2)
    stages = split_graph(captured, module, stage_of, 2)
    torch.testing.assert_close(_chain(stages, (x,)), module(x))
    assert stages[0].param_names == ("0.bias", "0.weight") and stages[1].param_names == ("2.bias", "2.weight")


def test_micro_batch_counts_the_schedules_cannot_run_are_refused():
    plan = _plan(["a", "b", "c"], "1f1b")
    with pytest.raises(PlanMismatchError, match="at least as many micro-batches"):
        rank_of_stages(Plan("hand", "1f1b", 2, plan.stages, plan.predicted))
    stages = _plan(["a", "b", "a", "b"], "interleaved-1f1b").stages
    with pytest.raises(PlanMismatchError, match="splits into 2 equal rounds"):
        rank_of_stages(Plan("hand", "interleaved-1f1b", 5, stages, plan.predicted))
    assert rank_of_stages(Plan("hand", "interleaved-1f1b", 6, stages, plan.predicted)) == (0, 1, 0, 1)


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_fx_graphs_of_gpt_split_anywhere(parts):
    """fx keeps shape arithmetic (``x.size(1)``) as nodes; a cut after one must not try to send an int."""
    module, inputs = gpt_tiny()
    captured = capture(module, inputs, tracer="fx")
    assert any(type(n.meta.get("val")) is int for n in captured.graph_module.graph.nodes)
    stage_of = assign_nodes(captured, _even(captured, parts), parts)
    stages = split_graph(captured, module, stage_of, parts)
    torch.testing.assert_close(_chain(stages, inputs), module(*inputs))
