"""Load and cross-check what a run needs -- plan, profile, model, graph, data -- before any collective.

Every check here is deterministic and made identically on every rank (and by ``plan run`` before it
launches), so a mismatch ends the run with one message instead of ranks waiting on each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from planner.errors import DistributedError, InputFileError
from planner.formats.plan import Plan, load_plan
from planner.formats.profile import Profile, load_profile
from planner.profile.capture import Captured, capture
from planner.profile.loader import batch_size, load_factory
from planner.data import factory as data_mod
from planner.runtime.launch.config import RunConfig
from planner.runtime.data_parallel import sync_for
from planner.runtime.pipeline.stages import rank_of_stages
from planner.runtime.pipeline.training import TrainSettings, check_graph, check_plan_nodes, resolve_optimizer, split_batch


__all__ = ["Prepared", "load_checked_plan", "prepare", "preflight", "world_size_of"]

BatchFn = Callable[[int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]


@dataclass(frozen=True)
class Prepared:
    plan: Plan
    profile: Profile
    module: nn.Module
    """The live model (every rank builds all of it; a rank trains the parameters of its stages)."""
    captured: Captured
    spec: data_mod.DataSpec
    settings: TrainSettings
    batch: BatchFn
    """Step -> (inputs, target) of the whole batch, on CPU."""


def load_checked_plan(plan_path: str, profile_path: str | None) -> tuple[Plan, Profile, str]:
    """The plan and its profile (``--profile`` or the plan's ``profile.path``), checked against each other."""
    plan = load_plan(plan_path)
    path = _profile_path(plan, plan_path, profile_path)
    profile = load_profile(path)
    where = f"profile {str(path)!r}"
    check_plan_nodes(plan, profile, where)
    rank_of_stages(plan)
    sync_for(plan)  # a plan with replicas is refused here, before any rank starts
    return plan, profile, where


def world_size_of(plan: Plan) -> int:
    """Ranks a plan needs: its distinct devices."""
    return max(rank_of_stages(plan)) + 1


def prepare(config: "RunConfig", world_size: int | None, device: torch.device) -> Prepared:
    """Everything a rank needs that does not talk to other ranks; raises ``PlannerError`` on a mismatch.

    ``world_size``: the ranks started, which must be the plan's device count (``None``: not checked)."""
    plan, profile, where = load_checked_plan(config.plan, config.profile)
    need = world_size_of(plan)
    if world_size is not None and world_size != need:
        raise DistributedError(f"the plan places stages on {need} devices but {world_size} ranks were started; "
                               f"start {need} ranks (--nproc-per-node {need}) or re-partition for {world_size}")
    mbs = config.microbatch_size or int(profile.model.get("microbatch_size", 0)) or None
    torch.manual_seed(config.seed)  # factories that do not seed themselves still build the same model on every rank
    module, example = load_factory(config.model, microbatch_size=mbs)
    mbs = mbs or batch_size(example)
    module.to(device).train()
    captured = capture(module, tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example))
    check_graph(captured, profile, mbs, where)
    spec = data_mod.data_spec(example, _output_meta(captured))
    name, lr = resolve_optimizer(plan, config.optimizer, config.lr)
    settings = TrainSettings(name, lr, plan.microbatches, mbs, config.seed)
    batch = make_batch_fn(spec, settings, config.data)
    split_batch(batch(0)[0], plan.microbatches)
    return Prepared(plan, profile, module, captured, spec, settings, batch)


def preflight(config: "RunConfig") -> int:
    """Every check ``prepare`` makes, in this process on CPU, before ranks start; returns the world size."""
    return world_size_of(prepare(config, None, torch.device("cpu")).plan)


def make_batch_fn(spec: data_mod.DataSpec, settings: TrainSettings, data: str | None) -> BatchFn:
    """Step -> whole batch (``microbatches x microbatch_size`` rows), synthetic or from ``--data``."""
    rows = settings.microbatches * settings.microbatch_size
    if data is None:
        return lambda step: data_mod.make_batch(spec, settings.seed, step, rows)
    factory = data_mod.load_data_factory(data)
    return lambda step: data_mod.custom_batch(factory, spec, settings.seed, step, rows)


def _output_meta(captured: Captured) -> Any:
    out = next(n for n in captured.graph_module.graph.nodes if n.op == "output")
    values = [a.meta.get("val") for a in out.all_input_nodes]
    return values[0] if len(values) == 1 else tuple(values)


def _profile_path(plan: Plan, plan_path: str, override: str | None) -> Path:
    if override:
        return Path(override)
    info = plan.extra.get("profile")
    raw = info.get("path") if isinstance(info, dict) or hasattr(info, "get") else None
    if not raw:
        raise InputFileError(f"plan {plan_path!r} does not name its profile (profile.path); pass --profile PATH")
    path = Path(str(raw))
    for candidate in (path, Path(plan_path).parent / path, Path(plan_path).parent / path.name):
        if candidate.is_file():
            return candidate
    raise InputFileError(f"the plan's profile {str(path)!r} was not found (also looked next to {plan_path!r}); "
                         f"pass --profile PATH")
