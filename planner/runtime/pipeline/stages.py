"""Per-rank pipeline objects: timed ``PipelineStage`` s, the schedule, and groups for tied parameters.

Ranks follow the plan: devices numbered in order of first appearance over the stages, so stage 0's
device is rank 0. GPipe and 1F1B put one stage on each rank; interleaved 1F1B puts stage ``i`` on rank
``i % world_size`` (the loop placement ``ScheduleInterleaved1F1B`` runs), and ``zbv`` stages ``i`` and
``2 world_size - 1 - i`` on rank ``i`` (the V placement ``ScheduleZBVZeroBubble`` runs). Schedules are
``torch.distributed.pipelining``'s own; stages wrap ``graph_split`` modules in ``PipelineStage``. Per-stage timing and the emulated
slowdown wrap these stages' compute methods (``planner.runtime.timing.instrument_stage``).

Gradients are averaged over micro-batches here rather than by the schedule (``scale_grads=False``): a
parameter shared by two stages of one rank would otherwise be divided twice.

Hybrid plans (stages with ``replicas``): replica ``r``'s pipeline is ``replicas[r]`` of every stage. Ranks are
numbered replica by replica (devices by first appearance over replica 0's stages, then replica 1's, ...), and
a 2-D ``DeviceMesh`` with dimensions ``("dp", "pp")`` holds them: row ``r`` is replica ``r``'s pipeline (its
``pp`` group carries the stages' sends), column ``s`` the replicas of stage ``s`` (their ``dp`` group syncs
gradients, ``planner.runtime.data_parallel``). Each replica runs its share of the step's micro-batches.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from planner.errors import PlanMismatchError
from planner.formats.plan import GENERATED_ORDER_SCHEDULES, V_SCHEDULES, ZERO_BUBBLE_SCHEDULES, Plan
from planner.partition.model.feasibility import replica_violations
from planner.partition.sim.schedules import device_orders, stage_ranks
from planner.profile.capture import Captured
from planner.runtime.pipeline.graph_split import StageGraph, assign_nodes, canonical_param_names, split_graph

__all__ = ["ContiguousStage", "OwnOutputs", "kept_outputs", "Recomputed", "RankStages", "TiedGroup", "rank_of_stages",
           "build_rank_stages",
           "build_schedule", "training_step_kwargs", "check_zero_bubble", "stage_graphs", "zero_bubble_actions",
           "tied_groups", "sync_tied_params", "sync_tied_grads", "average_grads"]


class ContiguousStage(PipelineStage):
    """A ``PipelineStage`` that sends contiguous gradients and infers its metadata from zeroed integer inputs.

    gloo and NCCL send only contiguous tensors, but an input's gradient can be a strided view (the
    gradient of one operand of a ``cat`` along channels is a slice of the output's gradient). Both the
    gradients sent and the gradient metadata the previous stage sizes its receive buffers from
    (torch's backward metadata inference, ``_compute_input_grads``) are made contiguous.

    torch's forward metadata inference runs a stage on inputs made from the previous stage's metadata with
    ``torch.empty``: an integer input then holds whatever the allocator reused. A stage whose input is an index
    (the position ids a GPT's ``arange`` makes, cut before their ``embedding``) indexed out of range, but only once
    memory had been used, after a mid-run re-plan moved the cut there. ``_to_tensor`` zeroes integer and boolean
    inputs made from metadata (index 0 is valid for any table); floating inputs stay as torch makes them.
    """

    def _to_tensor(self, arg: Any) -> torch.Tensor:
        tensor = super()._to_tensor(arg)
        if not isinstance(arg, torch.Tensor) and not (tensor.is_floating_point() or tensor.is_complex()):
            with torch.no_grad():
                tensor.zero_()
        return tensor

    def _compute_input_grads(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor | None, ...]:
        grads = super()._compute_input_grads(*args, **kwargs)
        return tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        grads = self.bwd_cache.get(bwd_chunk_id)
        if grads is not None:
            self.bwd_cache[bwd_chunk_id] = tuple(
                g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads)
        return super().get_bwd_send_ops(bwd_chunk_id)


class Recomputed(nn.Module):
    """A stage that keeps only its inputs for the backward and runs its forward again inside it (the stage's
    ``recompute: "full"``): ``torch.utils.checkpoint`` in its non-reentrant form, which saves the random state so that
    dropout draws the same mask twice. Its parameters are the wrapped stage's own."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class OwnOutputs(nn.Module):
    """A stage whose outputs that an op of the stage may have saved are tensors of their own (a copy), for the
    zero-bubble schedules.

    torch's runtime splits a backward into the input gradient (``stage_backward_input``) and the weight gradient,
    run later on the retained graph; after the first it detaches the stage's outputs in place. An output that an op
    inside the stage also saved for its backward (the residual stream at a cut inside a transformer block feeds
    the next ``layer_norm`` here and the ``add`` on the next stage) then breaks the weight gradient: "Trying to use
    a saved tensor that has been detached in-place". Returning a copy of such an output leaves the saved tensors
    alone, at the cost of one copy of it. An output only the next stage reads, made by an op that does not keep its
    own result (a GPT's logits, from its head's ``linear``), is returned as it is: its copy cost the last stage of
    gpt_small 3-7 ms of a 30 ms forward. ``kept``: per output, whether another op of the stage reads it or it is a
    stage input passed on (``kept_outputs``); ``None``: copy every output that needs a gradient. (A stage of the
    same rank, in a V, reads an output through a detached alias, ``set_local_fwd_input``: it needs no copy.)"""

    def __init__(self, inner: nn.Module, kept: Sequence[bool] | None = None) -> None:
        super().__init__()
        self.inner = inner
        self.kept = None if kept is None else tuple(kept)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs)

        def own(i: int, t: Any) -> Any:
            if not (isinstance(t, torch.Tensor) and t.requires_grad):
                return t
            if self.kept is None or i >= len(self.kept) or self.kept[i] or t._is_view() or _keeps_its_result(t):
                return t.clone()  # a view too: torch detaches outputs in place, which a view refuses
            return t

        return tuple(own(i, t) for i, t in enumerate(out)) if isinstance(out, tuple) else own(0, out)


def kept_outputs(module: nn.Module) -> tuple[bool, ...] | None:
    """Per output of a stage's graph (``StageGraph.module``), whether an op of the stage may have saved it for its
    backward: another op of the stage reads it, or it is not made by an op of the stage (a stage input or a
    parameter passed on); ``None`` for a module without a graph (every output counts as kept)."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return None
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None:
        return None
    values = output.args[0]

    def kept(value: Any, reader: Any) -> bool:
        if not isinstance(value, torch.fx.Node) or value.op not in ("call_function", "call_method", "call_module"):
            return True
        if any(user is not reader for user in value.users):
            return True
        if _may_return_its_input(module, value):  # the split's own .contiguous() on a cut; an in-place op
            return not value.args or kept(value.args[0], value)
        return False

    return tuple(kept(v, output) for v in (values if isinstance(values, (tuple, list)) else (values,)))


_MAY_RETURN_SELF = frozenset({"contiguous", "to", "type", "type_as", "float", "double", "half", "bfloat16", "cpu",
                              "cuda", "iadd", "isub", "imul", "itruediv"})
"""Tensor methods (and ``operator``'s in-place functions) that may return the tensor itself."""


def _may_return_its_input(module: nn.Module, node: Any) -> bool:
    """Whether ``node``'s result may be its first argument itself, so that what saved the argument saved the result:
    a method or function of ``_MAY_RETURN_SELF``, an in-place one (``add_``, ``aten.relu_.default``), or a submodule
    built with ``inplace=True``."""
    if node.op == "call_module":
        with contextlib.suppress(AttributeError):
            return bool(getattr(module.get_submodule(node.target), "inplace", False))
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    base = str(name).split(".")[0]  # "add_.Tensor" (an aten overload's name) -> "add_"
    in_place = base.endswith("_") and not base.startswith("_") or base.startswith("__i") and base.endswith("__")
    return base in _MAY_RETURN_SELF or in_place


def _keeps_its_result(t: torch.Tensor) -> bool:
    """Whether the op that made ``t`` saved its own result for its backward (``tanh``, ``sigmoid``, ``exp``,
    ``relu``, ``softmax``, ...: autograd names those saved variables ``result``), or no op made it."""
    return t.grad_fn is None or _saves_result(type(t.grad_fn))


@functools.lru_cache(maxsize=None)
def _saves_result(node_type: type) -> bool:
    """Whether autograd nodes of ``node_type`` save their op's result (their saved variables are properties of the
    node's class: read once per class, not per pass)."""
    return any(name.startswith("_saved_result") for name in dir(node_type))


@dataclass(frozen=True)
class TiedGroup:
    """A parameter read by stages on several ranks; their gradients are summed over ``ranks``."""

    name: str
    ranks: tuple[int, ...]
    group: Any = None
    """The ``dist`` process group of ``ranks`` (None until created, or when this rank is not in it)."""


@dataclass(frozen=True)
class RankStages:
    """Everything one rank runs for a plan (rebuild it with ``build_rank_stages`` for a new plan)."""

    plan: Plan
    rank: int
    rank_of_stage: tuple[int, ...]
    """Rank of each stage in this rank's replica pipeline."""
    graphs: tuple[StageGraph, ...]
    """Every stage's graph (cheap: modules share the live model's parameters); local ones are in ``stages``."""
    stages: tuple[PipelineStage, ...]
    params: Mapping[str, nn.Parameter]
    """Canonical name -> parameter, for the parameters this rank's stages read (what its optimizer steps)."""
    tied: tuple[TiedGroup, ...]
    replica: int = 0
    """This rank's replica pipeline (0 in a pure pipeline)."""
    layout: tuple[tuple[int, ...], ...] = ()
    """``layout[r][s]``: the rank of stage ``s`` in replica ``r`` (``(rank_of_stage,)`` in a pure pipeline)."""
    shares: tuple[int, ...] = ()
    """Micro-batches of each replica per step (``(plan.microbatches,)`` in a pure pipeline)."""
    mesh: Any = None
    """The ``DeviceMesh`` (``("dp", "pp")``) of a hybrid plan; ``None`` in a pure pipeline."""

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        """This rank's stage graphs as modules (what ``stages`` run, without a ``Recomputed`` wrapper)."""
        return tuple(g.module for g in self.graphs if self.rank_of_stage[g.index] == self.rank)

    @property
    def world_size(self) -> int:
        return max(max(row) for row in (self.layout or (self.rank_of_stage,))) + 1

    @property
    def degree(self) -> int:
        return len(self.layout) or 1

    @property
    def microbatches(self) -> int:
        """This replica's micro-batches per step."""
        return self.shares[self.replica] if self.shares else self.plan.microbatches

    @property
    def first_microbatch(self) -> int:
        """Index, in the step's micro-batches, of this replica's first one."""
        return sum(self.shares[:self.replica]) if self.shares else 0

    @property
    def has_first(self) -> bool:
        return self.rank_of_stage[0] == self.rank

    @property
    def has_last(self) -> bool:
        return self.rank_of_stage[-1] == self.rank


def replica_layout(plan: Plan) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """``(layout, shares)``: ``layout[r][s]`` is the rank of stage ``s`` in replica ``r``; ``shares[r]`` its
    micro-batches per step. Devices are numbered by first appearance, replica by replica (so a hybrid plan's
    ranks fill its ``DeviceMesh`` row by row); validated against the feasibility rule.

    A plan re-made by the rebalancer carries ``device_ranks`` (device ids in rank order) so that every
    rank keeps its device when the placer orders the stages' devices differently.
    """
    _check_shape(plan)
    replicas = plan.replicas()
    degree = len(replicas[0])
    shares = plan.replica_shares()
    ranks = {device: i for i, device in enumerate(rank_devices(plan))}
    layout = tuple(tuple(ranks[devs[r]] for devs in replicas) for r in range(degree))
    return layout, tuple(shares)


def rank_devices(plan: Plan) -> tuple[str, ...]:
    """Device ids in rank order: the plan's ``device_ranks`` when it has them, else by first appearance over
    replica 0's stages, then replica 1's, and so on."""
    devices = plan.replica_devices()
    fixed = [str(d) for d in plan.extra.get("device_ranks") or ()]
    if fixed and set(fixed) != set(devices):
        raise PlanMismatchError(f"the plan's device_ranks {fixed} do not list exactly its stages' devices "
                                f"{sorted(devices)}; remove device_ranks or fix it")
    return tuple(fixed or devices)


def rank_of_stages(plan: Plan) -> tuple[int, ...]:
    """Rank of each stage of replica 0 (the whole plan when it has no replicas); see ``replica_layout``."""
    layout, _ = replica_layout(plan)
    result = layout[0]
    world = len(set(result))
    # The shape rule already holds; what remains is the runtime's own: with ``device_ranks`` reordering the
    # ranks, interleaved stages must still go round-robin over the *ranks*, and zbv's in a V.
    several = ("interleaved-1f1b",) + V_SCHEDULES
    if plan.schedule in several and result != stage_ranks(plan.schedule, world, len(result)):
        rule = ("in a V (stage i on device i, then 2p-1-i)" if plan.schedule in V_SCHEDULES
                else f"on device i mod {world}")
        raise PlanMismatchError(
            f"{plan.schedule} runs stage i {rule} (devices {list(rank_devices(plan))}), but the plan "
            f"places stages on ranks {list(result)}; re-partition with --schedule {plan.schedule}")
    return result


def _check_shape(plan: Plan) -> None:
    """The feasibility rule's shape part (``planner.partition.model.feasibility``), as ``plan check`` applies it."""
    found = replica_violations(plan.schedule, plan.microbatches, plan.replicas(), plan.shares())
    if found:
        raise PlanMismatchError(f"the plan cannot run: {found[0]}")


def stage_graphs(captured: Captured, module: nn.Module, plan: Plan) -> tuple[StageGraph, ...]:
    """Every stage of ``plan`` cut out of ``captured`` (all ranks' stages, in stage order)."""
    num = len(plan.stages)
    return split_graph(captured, module, assign_nodes(captured, plan.assignment(), num), num)


def build_rank_stages(captured: Captured, module: nn.Module, plan: Plan, rank: int, device: torch.device,
                      group: Any = None) -> RankStages:
    """Cut ``captured`` by ``plan`` and wrap this rank's stages (hook: call again with a new plan mid-run).

    Every rank must call this together: it creates the process groups of tied parameters (and of a hybrid
    plan's ``DeviceMesh``).
    """
    rows, shares = replica_layout(plan)
    replica = next((r for r, row in enumerate(rows) if rank in row), 0)
    layout = rows[replica]
    num = len(plan.stages)
    graphs = stage_graphs(captured, module, plan)
    local = [g for g in graphs if layout[g.index] == rank]
    mesh = None
    if len(rows) > 1:
        from torch.distributed.device_mesh import DeviceMesh

        # one row of distinct ranks per replica pipeline (a rank holding several stages appears once)
        mesh = DeviceMesh(device.type, torch.tensor([list(dict.fromkeys(row)) for row in rows]),
                          mesh_dim_names=("dp", "pp"))
        group = mesh.get_group("pp")
        stage_rank = {s: dist.get_group_rank(group, layout[s]) for s in range(num)}
    else:
        stage_rank = dict(enumerate(layout))  # a fixed device order (device_ranks) may put stage i on a rank other than i
    recompute = plan.recomputed()
    split = plan.schedule in ZERO_BUBBLE_SCHEDULES

    def wrapped(module: nn.Module, index: int) -> nn.Module:
        kept = kept_outputs(module)
        module = Recomputed(module) if recompute[index] else module
        return OwnOutputs(module, kept) if split else module

    stages = tuple(ContiguousStage(wrapped(g.module, g.index), g.index, num, device, group=group) for g in local)
    for st in stages:
        st.stage_index_to_group_rank = dict(stage_rank)
    canonical = canonical_param_names(module)
    params = {canonical[id(p)]: p for g in local for p in g.module.parameters()}
    return RankStages(plan, rank, layout, graphs, stages, dict(sorted(params.items())),
                      _make_tied(graphs, rows, rank), replica=replica, layout=rows, shares=shares, mesh=mesh)


def tied_groups(graphs: Sequence[StageGraph], layout: Sequence[int]) -> list[tuple[str, tuple[int, ...]]]:
    """Parameters read on more than one rank, with those ranks, sorted by name (same on every rank)."""
    holders: dict[str, set[int]] = {}
    for g in graphs:
        for name in g.param_names:
            holders.setdefault(name, set()).add(layout[g.index])
    return [(name, tuple(sorted(r))) for name, r in sorted(holders.items()) if len(r) > 1]


def _make_tied(graphs: Sequence[StageGraph], rows: Sequence[Sequence[int]], rank: int) -> tuple[TiedGroup, ...]:
    """This rank's tied groups; every replica's groups are created, in replica order, by every rank."""
    groups: dict[tuple[int, ...], Any] = {}
    result = []
    for layout in rows:
        for name, ranks in tied_groups(graphs, layout):
            if ranks not in groups:  # new_group is collective: every rank creates the same groups in order
                groups[ranks] = dist.new_group(list(ranks)) if dist.is_initialized() else None
            if rank in ranks:
                result.append(TiedGroup(name, ranks, groups[ranks]))
    return tuple(result)


def build_schedule(rank_stages: RankStages, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """The plan's schedule from ``torch.distributed.pipelining`` over this rank's stages. An asynchronous plan
    trains through its own engine (``asynchronous.AsyncEngine``) and uses this only to evaluate, forward only:
    GPipe, which takes any micro-batch count (torch's 1F1B refuses fewer micro-batches than stages, which an
    asynchronous plan may have)."""
    plan = rank_stages.plan
    stages = list(rank_stages.stages)
    count = rank_stages.microbatches  # this replica's share
    if plan.schedule in ZERO_BUBBLE_SCHEDULES:
        return zero_bubble_schedule(rank_stages, loss)
    if plan.schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B(stages, count, loss_fn=loss, scale_grads=False)
    kind = Schedule1F1B if plan.schedule == "1f1b" else ScheduleGPipe
    return kind(stages[0], count, loss_fn=loss, scale_grads=False)


def training_step_kwargs(schedule: Any) -> dict[str, Any]:
    """What a training step passes ``schedule.step`` besides the batch: ``return_outputs=False`` where torch's schedule
    takes it (an older release's ``step`` hands keywords it does not know to the model). By default the last stage
    keeps every micro-batch's output until the step ends and concatenates them (a language model's logits: ``m`` x
    rows x sequence x vocabulary, 64 MiB a step for gpt_small at 8 micro-batches), memory the cost model does not
    count and a copy no one reads: training reads the losses."""
    return {"return_outputs": False} if _step_takes_return_outputs(type(schedule)) else {}


@functools.lru_cache(maxsize=None)
def _step_takes_return_outputs(kind: type) -> bool:
    """Asked once per schedule class: a training step calls ``training_step_kwargs`` every step."""
    return "return_outputs" in inspect.signature(kind.step).parameters


def zero_bubble_schedule(rank_stages: RankStages, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """A zero-bubble plan's schedule: torch's ``_PipelineScheduleRuntime`` running the plan's ``schedule_order`` as
    written (``zero_bubble_actions``); torch validates the lists and inserts the sends and receives. It splits each
    backward with autograd into the input gradient (sent at once) and the weight gradient (run where the order
    says)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    plan = rank_stages.plan
    actions = zero_bubble_actions(plan, rank_stages.rank_of_stage, rank_stages.microbatches)
    schedule = _PipelineScheduleRuntime(list(rank_stages.stages), rank_stages.microbatches, loss_fn=loss,
                                        scale_grads=False)
    try:
        schedule._prepare_schedule_with_comms(actions)
    except (AssertionError, ValueError, RuntimeError) as exc:
        raise PlanMismatchError(f"torch's pipeline runtime refuses the plan's schedule_order: {exc}; re-partition "
                                f"with --schedule {plan.schedule}") from None
    return schedule


def zero_bubble_actions(plan: Plan, layout: Sequence[int], microbatches: int) -> dict[int, list[Any]]:
    """One replica pipeline's passes as torch's ``_Action`` s, keyed by rank in the pipeline's group: the plan's
    ``schedule_order`` (whose keys number the devices by first appearance, ``Plan.replica_devices``, so a re-plan's
    ``device_ranks`` does not change them), or the schedule's fixed pattern when a hand-made ``zb-h1`` or ``zb-h2``
    plan has none."""
    from torch.distributed.pipelining.schedules import _Action

    order = plan.extra.get("schedule_order")
    if not order and plan.schedule in GENERATED_ORDER_SCHEDULES:
        raise PlanMismatchError(f"a {plan.schedule} plan must carry its schedule_order (plan partition writes it); "
                                f"re-partition with --schedule {plan.schedule}")
    default = {dev: i for i, dev in enumerate(plan.replica_devices())}
    devices = rank_devices(plan)
    ranks = list(dict.fromkeys(layout))
    actions: dict[int, list[Any]] = {}
    for group_rank, rank in enumerate(ranks):
        if order:
            key = str(default[devices[rank]])
            if key not in order:
                raise PlanMismatchError(f"the plan's schedule_order has no passes for rank {key} (device "
                                        f"{devices[rank]!r}); re-partition with --schedule {plan.schedule}")
            actions[group_rank] = [_Action.from_str(a) for a in order[key]]
        else:
            orders = device_orders(plan.schedule, len(ranks), len(layout) // len(ranks), microbatches)
            actions[group_rank] = [_Action.from_str(f"{s}{kind}{j}") for kind, s, j in orders[group_rank]]
    return actions


def check_zero_bubble(plan: Plan) -> None:
    """Before ranks start: every replica pipeline's order passes torch's own ``_validate_schedule`` (every stage's
    forward, input and weight passes of every micro-batch of its share, each after what it needs)."""
    if plan.schedule not in ZERO_BUBBLE_SCHEDULES:
        return
    from torch.distributed.pipelining.schedules import _validate_schedule

    rows, shares = replica_layout(plan)
    for replica, (layout, share) in enumerate(zip(rows, shares)):
        actions = zero_bubble_actions(plan, layout, share)
        try:
            _validate_schedule(actions, len(actions), len(layout), share)  # type: ignore[arg-type]
        except (AssertionError, ValueError, RuntimeError) as exc:
            where = f" of replica {replica}" if len(rows) > 1 else ""
            raise PlanMismatchError(f"the plan's schedule_order{where} is not a valid schedule for {len(layout)} "
                                    f"stages and {share} micro-batches: {exc}; re-partition with --schedule "
                                    f"{plan.schedule}") from None


def average_grads(params: Mapping[str, nn.Parameter], microbatches: int) -> None:
    """Turn gradients summed over micro-batches into their mean."""
    for p in params.values():
        if p.grad is not None:
            p.grad.div_(microbatches)


def sync_tied_params(rank_stages: RankStages) -> None:
    """Copy each tied parameter from the lowest rank holding it to the others (once, at the start), so a
    factory that is not deterministic cannot leave the copies different."""
    for tie in rank_stages.tied:
        if tie.group is not None:
            dist.broadcast(rank_stages.params[tie.name].data, src=tie.ranks[0], group=tie.group)


def sync_tied_grads(rank_stages: RankStages) -> None:
    """Sum each tied parameter's gradient over the ranks that hold it, so their copies stay identical."""
    for tie in rank_stages.tied:
        if tie.group is None:
            continue
        param = rank_stages.params[tie.name]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=tie.group)
