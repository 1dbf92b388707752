"""Split a captured graph into one ``fx.GraphModule`` per pipeline stage, following a plan's node lists.

Why our own split instead of ``torch.distributed.pipelining.pipeline(split_policy=...)`` (docs/run.md,
"How a plan becomes a pipeline"): that API re-exports the model (node names may change, so plans no longer map back) and a
later stage that reads a model input directly fails with ``PipeliningMetadataError ... got root arg``.
Here the exported graph is cut directly with ``torch.fx``:

* a stage's placeholders are the values *live* across the cut in front of it (produced by an earlier
  stage, read by this stage or a later one); stage 0's placeholders are the model inputs;
* a stage's outputs are the values live across the cut behind it; the last stage returns the model
  output. A value that skips stages is therefore received and forwarded by every stage in between
  (liveness routing, as in GPipe implementations that carry skip connections stage by stage);
* parameters, buffers and constants become ``get_attr`` nodes whose targets are their original fully
  qualified names, attached to the stage module *by reference* to the live model's tensors, so a
  parameter shared by several stages on one rank is one tensor.

A node the plan does not name is placed where it can run: with the last of its producers (side-effect
ops such as a BatchNorm's ``num_batches_tracked.add_``), or with its first consumer when it has no
producers (``arange``). ``getitem`` nodes on a tuple-valued op (``split``) go with that op, so no tuple
ever crosses a cut.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import fx, nn

from planner.errors import PlanMismatchError
from planner.profile.capture import Captured

__all__ = ["StageGraph", "assign_nodes", "split_graph", "canonical_param_names"]


@dataclass(frozen=True)
class StageGraph:
    """One stage cut out of the captured graph."""

    index: int
    module: fx.GraphModule
    """Runs the stage: positional args are ``input_names`` values, returns ``output_names`` values."""
    input_names: tuple[str, ...]
    """Values received from the previous stage (stage 0: the model inputs, in call order)."""
    output_names: tuple[str, ...]
    """Values sent to the next stage (last stage: the model outputs)."""
    param_names: tuple[str, ...]
    """Canonical FQNs (see ``canonical_param_names``) of the trainable parameters this stage reads."""


def canonical_param_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name``: the first name ``named_parameters()`` gives each parameter object.

    Tied parameters (an LM head sharing the embedding's weight) have several FQNs but one object;
    every rank builds the same model, so this name is the same everywhere and identifies the tensor
    for gradient synchronisation, optimizer state and migration.
    """
    return {id(p): name for name, p in module.named_parameters()}


def assign_nodes(captured: Captured, node_stage: Mapping[str, int], num_stages: int) -> dict[str, int]:
    """Stage index of every op of the captured graph, from a plan's ``node -> stage`` map.

    Raises ``PlanMismatchError`` when the plan names a node the graph lacks, or an edge runs backwards.
    """
    nodes = _compute_nodes(captured)
    by_name = {n.name: n for n in nodes}
    unknown = sorted(set(node_stage) - set(by_name))
    if unknown:
        raise PlanMismatchError(
            f"the plan names {len(unknown)} node(s) the model's graph does not have (first: {unknown[0]!r}); "
            f"the plan was made for another model or model version: re-profile and re-partition")
    stage: dict[str, int] = {}
    for node in nodes:  # topological order
        if node.op == "placeholder":
            stage[node.name] = 0  # model inputs enter at stage 0 and are routed onwards
        elif node.name in node_stage and not _is_tuple_getitem(node):
            stage[node.name] = node_stage[node.name]
        else:
            stage[node.name] = _fallback_stage(node, stage, node_stage, num_stages)
    for node in nodes:
        for src in _producers(node, by_name):
            if stage[src.name] > stage[node.name]:
                raise PlanMismatchError(
                    f"the plan puts {node.name!r} on stage {stage[node.name]} but its input {src.name!r} "
                    f"on later stage {stage[src.name]}; stages must follow the graph: re-partition")
    return stage


def split_graph(captured: Captured, module: nn.Module, stage_of: Mapping[str, int],
                num_stages: int, stages: Sequence[int] | None = None) -> tuple[StageGraph, ...]:
    """Build ``StageGraph`` s for ``stages`` (default: all) of ``captured`` placed by ``stage_of``.

    ``module`` is the live model whose parameters the stage modules share (by reference).
    """
    nodes = _compute_nodes(captured)
    order = {n.name: i for i, n in enumerate(nodes)}
    out_node = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    model_outputs = [a.name for a in out_node.all_input_nodes]
    last_use = _last_use(nodes, stage_of, model_outputs, num_stages)
    user_inputs = [n.name for n in nodes if n.op == "placeholder"]
    tensors = _attr_sources(captured, module)
    canonical = canonical_param_names(module)
    result = []
    for k in (range(num_stages) if stages is None else stages):
        inputs = user_inputs if k == 0 else _live_across(k - 1, nodes, stage_of, last_use, order)
        outputs = model_outputs if k == num_stages - 1 else _live_across(k, nodes, stage_of, last_use, order)
        if not outputs:
            raise PlanMismatchError(f"stage {k} passes nothing to stage {k + 1}; the plan is not a pipeline")
        _check_tensors(k, outputs, {n.name: n for n in nodes})
        members = [n for n in nodes if stage_of[n.name] == k and n.op != "placeholder"]
        gm = _stage_module(members, inputs, outputs, tensors, last=k == num_stages - 1)
        params = tuple(sorted(dict.fromkeys(canonical[id(p)] for p in gm.parameters())))
        result.append(StageGraph(k, gm, tuple(inputs), tuple(outputs), params))
    return tuple(result)


# ----------------------------------------------------------------------------- helpers


def _compute_nodes(captured: Captured) -> list[fx.Node]:
    """Model-input placeholders and ops, in graph order (parameters, get_attr and output excluded)."""
    params = set(captured.placeholder_params or {})
    return [n for n in captured.graph_module.graph.nodes
            if n.op not in ("output", "get_attr") and n.name not in params]


def _producers(node: fx.Node, by_name: Mapping[str, fx.Node]) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if a.name in by_name]


def _is_tuple_getitem(node: fx.Node) -> bool:
    if node.target is not operator.getitem or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    return not isinstance(node.args[0].meta.get("val"), torch.Tensor)


def _fallback_stage(node: fx.Node, stage: Mapping[str, int], node_stage: Mapping[str, int], num_stages: int) -> int:
    producers = [stage[a.name] for a in node.all_input_nodes if a.name in stage]
    if producers:
        return max(producers)
    consumers = [node_stage[u.name] for u in node.users if u.name in node_stage]
    return min(consumers) if consumers else 0


def _last_use(nodes: Sequence[fx.Node], stage_of: Mapping[str, int], model_outputs: Sequence[str],
              num_stages: int) -> dict[str, int]:
    """Latest stage that reads each value (the last stage for model outputs)."""
    last = {n.name: stage_of[n.name] for n in nodes}
    for node in nodes:
        for src in node.all_input_nodes:
            if src.name in last:
                last[src.name] = max(last[src.name], stage_of[node.name])
    for name in model_outputs:
        last[name] = num_stages - 1
    return last


def _live_across(cut: int, nodes: Sequence[fx.Node], stage_of: Mapping[str, int], last_use: Mapping[str, int],
                 order: Mapping[str, int]) -> list[str]:
    """Values produced at or before stage ``cut`` and read after it, in graph order (shape constants are not
    sent: the stages that read them use their value, see ``_shape_constant``)."""
    live = [n.name for n in nodes if stage_of[n.name] <= cut < last_use[n.name] and _shape_constant(n) is None]
    return sorted(live, key=order.__getitem__)


def _shape_constant(node: fx.Node) -> Any:
    """The value of a shape computation (``x.size(1)``, ``x.shape``: ints, sizes; fx graphs have them, export's
    fold them), ``None`` for anything else. The micro-batch shape is fixed for a run, so a stage reading one
    from an earlier stage uses the value instead of receiving it (p2p sends carry tensors only)."""
    val = node.meta.get("val")
    flat = torch.utils._pytree.tree_leaves(val) if isinstance(val, (tuple, list)) else [val]
    if val is None or isinstance(val, bool) or not flat or not all(type(v) is int for v in flat):
        return None
    return val


def _check_tensors(k: int, names: Sequence[str], by_name: Mapping[str, fx.Node]) -> None:
    for name in names:
        val = by_name[name].meta.get("val") if name in by_name else None
        if val is not None and not isinstance(val, torch.Tensor):
            raise PlanMismatchError(
                f"stage {k} would send {name!r}, a {type(val).__name__}, not a tensor; "
                f"cut the graph elsewhere (re-partition) or make the model return tensors")


def _attr_sources(captured: Captured, module: nn.Module) -> dict[str, Any]:
    """Placeholder name (export) or get_attr/call_module target (fx) -> the live object it stands for."""
    live: dict[str, Any] = dict(module.named_buffers(remove_duplicate=False))
    live.update(module.named_parameters(remove_duplicate=False))
    sources: dict[str, Any] = {}
    program = captured.program
    for placeholder, fqn in (captured.placeholder_params or {}).items():
        if fqn in live:
            sources[placeholder] = (fqn, live[fqn])
        elif program is not None and fqn in program.constants:
            sources[placeholder] = (fqn, program.constants[fqn])
        else:
            sources[placeholder] = (fqn, program.state_dict[fqn])
    for node in captured.graph_module.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            target = str(node.target)
            sources[node.name] = (target, live.get(target, _resolve(captured.graph_module, target)))
    return sources


def _resolve(root: nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _stage_module(members: Sequence[fx.Node], inputs: Sequence[str], outputs: Sequence[str],
                  sources: Mapping[str, Any], last: bool) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[str, fx.Node] = {name: graph.placeholder(name) for name in inputs}
    attrs: dict[str, Any] = {}

    def lookup(arg: fx.Node) -> Any:
        if arg.name in env:
            return env[arg.name]
        constant = _shape_constant(arg)
        if constant is not None:
            return constant
        if arg.name not in sources:
            raise PlanMismatchError(f"value {arg.name!r} is read before it reaches this stage; re-partition")
        target, obj = sources[arg.name]
        attrs[target] = obj
        env[arg.name] = graph.get_attr(target)
        return env[arg.name]

    for node in members:
        if node.op == "call_module":
            attrs[str(node.target)] = sources[node.name][1]
        env[node.name] = graph.node_copy(node, lookup)
    values = [env[name] for name in outputs]
    if not last:  # p2p sends need contiguous tensors; a cut may fall after a transpose or a view
        values = [graph.call_method("contiguous", (v,)) for v in values]
    graph.output(values[0] if last and len(values) == 1 else tuple(values))
    graph.lint()
    return fx.GraphModule(attrs, graph, class_name="Stage")
