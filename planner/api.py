"""A small library API for people with their own training loop: load a plan, get this rank's pipeline
stages and torch's own schedule for it, and rebalance from waits measured yourself.

    import planner
    plan = planner.load_plan("plan.json")
    pipe = planner.build_pipeline(model, example_inputs, plan, rank=rank, loss_fn=F.cross_entropy)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad()
        losses = []
        pipe.schedule.step(*(inputs if pipe.is_first else ()), target=target if pipe.is_last else None,
                           losses=losses, **pipe.step_kwargs)
        pipe.finish_backward()          # mean over micro-batches; tied weights summed over their ranks
        optimizer.step()

``build_pipeline`` cuts the model exactly as ``plan run`` does (``runtime.pipeline.graph_split``) and
returns ``torch.distributed.pipelining`` objects (``PipelineStage`` subclasses and ``Schedule1F1B``,
``ScheduleGPipe`` or ``ScheduleInterleaved1F1B``); a process group must be initialised (``torchrun``).
``examples/own_loop.py`` is a complete loop; ``tests/test_api.py`` checks that it trains exactly as
``plan run``. Plans with replicated stages (``data_parallel`` degree > 1) need the gradient all-reduce and
the per-replica batches that ``plan run`` adds; ``build_pipeline`` refuses them in one line before any
collective starts. Torch is imported only when these functions are called.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from planner.errors import UsageError
from planner.formats.plan import Plan, load_plan

__all__ = ["Pipeline", "load_plan", "build_pipeline", "rebalance"]


@dataclass(frozen=True)
class Pipeline:
    """This rank's part of a plan: its stages, torch's schedule over them, and the parameters they train."""

    stages: tuple[Any, ...]
    """``torch.distributed.pipelining.PipelineStage`` objects (one per stage this rank holds)."""
    schedule: Any
    """The plan's schedule (``scale_grads=False``: call ``finish_backward`` after each ``step``)."""
    rank_stages: Any
    """The runtime's record of the split (``planner.runtime.pipeline.stages.RankStages``)."""

    @property
    def is_first(self) -> bool:
        """This rank feeds the model inputs to ``schedule.step``."""
        return bool(self.rank_stages.has_first)

    @property
    def is_last(self) -> bool:
        """This rank passes ``target`` (and collects ``losses``)."""
        return bool(self.rank_stages.has_last)

    @property
    def step_kwargs(self) -> dict[str, Any]:
        """Keywords for a training ``schedule.step``: ``return_outputs=False`` where torch's schedule takes it, so the
        last stage does not keep every micro-batch's output and concatenate them (what ``plan run`` passes)."""
        from planner.runtime.pipeline.stages import training_step_kwargs

        return training_step_kwargs(self.schedule)

    @property
    def last_rank(self) -> int:
        """The rank holding the last stage: it computes the losses (broadcast them from here)."""
        return int(self.rank_stages.rank_of_stage[-1])

    def named_parameters(self) -> Mapping[str, Any]:
        """The parameters this rank trains, by the model's own (first) names."""
        return self.rank_stages.params

    def parameters(self) -> Iterator[Any]:
        return iter(self.rank_stages.params.values())

    def finish_backward(self) -> None:
        """After ``schedule.step``: turn the gradients summed over micro-batches into their mean, and sum a
        tied weight's gradient over the ranks that hold it (what ``plan run`` does before its optimizer step)."""
        from planner.runtime.pipeline.stages import average_grads, sync_tied_grads

        average_grads(self.rank_stages.params, self.rank_stages.plan.microbatches)
        sync_tied_grads(self.rank_stages)


def build_pipeline(model: Any, example_inputs: Sequence[Any], plan: Plan | str | Path, *, rank: int,
                   loss_fn: Callable[[Any, Any], Any], device: Any = None, tracer: str = "auto",
                   group: Any = None) -> Pipeline:
    """This rank's stages of ``plan`` over ``model`` (captured on ``example_inputs``, one micro-batch) and the
    plan's schedule. Collective: every rank calls it. ``tracer`` must be the profile's (``auto`` = export)."""
    _warn_if_imported_after_init()
    import torch

    from planner.profile.capture import capture
    from planner.runtime.pipeline.stages import build_rank_stages, build_schedule, rank_devices, sync_tied_params

    plan = load_plan(plan) if isinstance(plan, (str, Path)) else plan
    degree = plan.shape().degree
    if degree > 1:  # every rank refuses before capture or any collective, so none waits for the others
        raise UsageError(f"build_pipeline runs pure pipelines (one replica per stage), but this plan has {degree} "
                         f"replicas of each stage (data_parallel degree {degree}), which need the gradient all-reduce "
                         f"and per-replica batches of `plan run`: train it with `plan run`, or re-partition with "
                         f"--data-parallel 1")
    import torch.distributed as dist

    ranks = len(rank_devices(plan))
    world = dist.get_world_size(group) if dist.is_initialized() else None
    if world is not None and world != ranks:  # a rank with no stage would fail inside torch's schedule
        raise UsageError(f"this plan runs on {ranks} rank(s) (devices {', '.join(rank_devices(plan))}), but the job "
                         f"has {world}: start it with `torchrun --nproc-per-node {ranks}`, or re-partition so that the plan uses "
                         f"{world} devices (`plan partition -m uniform` gives every device a stage)")
    device = torch.device(device) if device is not None else torch.device("cpu")
    model.to(device)
    inputs = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example_inputs)
    rank_stages = build_rank_stages(capture(model, inputs, tracer), model, plan, rank, device, group=group)
    sync_tied_params(rank_stages)
    return Pipeline(rank_stages.stages, build_schedule(rank_stages, loss_fn), rank_stages)


def _warn_if_imported_after_init() -> None:
    """Warn when torch's pipelining is about to be imported after ``init_process_group``: its import of
    ``torch.distributed.nn.functional`` binds the default group into ten functions' default arguments
    (``group=group.WORLD``), so ``destroy_process_group`` no longer frees the group, its gloo threads live on into
    interpreter shutdown, and one that frees the last collective's tensors there aborts the rank ("terminate
    called without an active exception": 2 runs in 31 of ``examples/own_loop.py`` on a loaded 2-core machine)."""
    import sys

    import torch.distributed as dist

    if dist.is_initialized() and "torch.distributed.nn.functional" not in sys.modules:
        import warnings

        warnings.warn("torch.distributed.pipelining was first imported after init_process_group, so the default "
                      "process group outlives destroy_process_group and a gloo rank can abort at exit: import "
                      "torch.distributed.pipelining before init_process_group (examples/own_loop.py does)",
                      RuntimeWarning, stacklevel=3)


def rebalance(plan: Plan, waits: Mapping[str, float], compute: Mapping[str, float], *, threshold: float = 0.05,
              gain: float = 1.0) -> dict[str, Any]:
    """The patent's S5 as a function, for waits measured yourself over one round of ``wall_s`` = compute + wait
    per device: whether the round was balanced and the device weights to re-partition with
    (pass them to ``planner.partition.partition(..., weights=...)`` for the next plan)."""
    from planner.partition.search.rebalance import DeviceRound, RoundStats, imbalance, update_weights

    devices = list(dict.fromkeys(stage.device for stage in plan.stages))
    stats = RoundStats(0, 0, 1, max(compute[d] + waits[d] for d in devices),
                       tuple(DeviceRound(d, compute_s=compute[d], wait_s=waits[d]) for d in devices))
    weights = dict(plan.extra.get("weights") or {d: 1.0 for d in devices})
    gap = imbalance(stats)
    # The load each device carried, in the weights' units (as the offline loop passes it): a device that
    # waited gets more of it, in proportion to its wait over its compute.
    new = update_weights(weights, stats, weights, gain=gain) if gap > threshold else weights
    return {"balanced": gap <= threshold, "imbalance": gap, "weights": new}
