"""Load and cross-check what a run needs -- plan, profile, model, graph, data -- before any collective.

Every check here is deterministic and made identically on every rank (and by ``plan run`` before it
launches), so a mismatch ends the run with one message instead of ranks waiting on each other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from planner.errors import DistributedError, InputFileError, PlanMismatchError, UsageError
from planner.profile.device import detect_device_type
from planner.formats.plan import ASYNC_SCHEDULES, SERVER_SYNCS, STALENESS_SYNCS, Plan, load_plan
from planner.formats.profile import Profile, load_profile
from planner.profile.capture import Captured, capture
from planner.profile.loader import batch_size, load_factory, select_output
from planner.data import factory as data_mod
from planner.runtime.launch.config import RunConfig
from planner.runtime.options import parse_link, parse_target
from planner.runtime.launch.resume import Resume, check_resume, run_identity
from planner.partition.search.sync_period import AdaptiveRule
from planner.runtime.data_parallel import AdaptiveOptions, sync_for
from planner.runtime.pipeline.stages import check_zero_bubble, rank_of_stages, replica_layout
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
    val_batch: BatchFn | None = None
    """Held-out batch number -> (inputs, target), on CPU (``None``: the data has no validation split)."""
    custom_loss: Callable[..., Any] | None = None
    """``--loss``: the user's ``fn(output, target)``."""
    data_fingerprint: str | None = None
    """A fingerprint of the data set when its module offers one (``fingerprint()``, e.g. the text corpus)."""
    device_mismatch: tuple[str, ...] = ()
    """The plan's device types that differ from the ranks' (allowed by ``--allow-device-mismatch``)."""
    identity: Mapping[str, Any] = field(default_factory=dict)
    """What the run depends on (``resume.run_identity``), recorded in its checkpoints."""
    resume: Resume | None = None
    """The checkpoint this run resumes from, checked against the run (``None``: it starts afresh)."""
    sync_options: AdaptiveOptions | None = None
    """``--sync adaptive``'s knobs (``None``: the defaults)."""


def load_checked_plan(plan_path: str, profile_path: str | None) -> tuple[Plan, Profile, str]:
    """The plan and its profile (``--profile`` or the plan's ``profile.path``), checked against each other."""
    plan = load_plan(plan_path)
    path = _profile_path(plan, plan_path, profile_path)
    profile = load_profile(path)
    where = f"profile {str(path)!r}"
    check_plan_nodes(plan, profile, where)
    rank_of_stages(plan)
    check_zero_bubble(plan)  # a zero-bubble order torch would refuse is refused here, before any rank starts
    if not plan.shape().served:  # a parameter-server plan runs without the pipeline's sync (run_rank)
        sync_for(plan)  # a sync mode this runtime lacks is refused here, before any rank starts
    return plan, profile, where


def with_sync_mode(plan: Plan, profile: Profile, config: "RunConfig") -> Plan:
    """The plan under ``--sync MODE`` and ``--sync-period H``: its ``data_parallel`` rewritten and its step time
    re-simulated with one aggregation per period (``adaptive`` without ``--sync-period``: the rule's first
    interval on the plan's predicted times). A plan without replicas is refused: there is nothing to combine."""
    if config.sync is None and config.sync_period is None and config.staleness is None:
        return plan
    shape = plan.shape()
    sync = config.sync or shape.sync
    if not shape.replicated:
        raise UsageError(f"--sync {sync} combines replicas, but the plan {config.plan!r} is a pure pipeline of "
                         f"{len(plan.stages)} stage(s) with none; re-partition with --data-parallel N (N > 1) "
                         f"or drop --sync")
    if sync in SERVER_SYNCS and len(plan.stages) != 1:
        raise UsageError(f"--sync {sync} serves replicas of the whole model through a parameter server rank, but the "
                         f"plan {config.plan!r} has {len(plan.stages)} stages per replica (a server rank is not a "
                         f"pipeline stage); re-partition with plan partition --sync {sync}, or use --sync ssgd")
    period = config.sync_period if config.sync_period is not None else (shape.period if sync == shape.sync else None)
    staleness = config.staleness if config.staleness is not None else \
        (shape.staleness if sync == shape.sync and sync in STALENESS_SYNCS else None)
    from planner.partition.model.cost import shape_of
    from planner.partition.model.convert import partition_of
    from planner.partition.model.problem import check_sync, with_sync
    from planner.runtime.rebalancing.replan import RoundModel

    period = check_sync(sync, period, staleness)
    if not isinstance(plan.extra.get("cluster"), Mapping):
        raise UsageError(f"--sync {sync} re-predicts the plan's step, and the plan {config.plan!r} embeds no "
                         f"cluster; make the plan with plan partition --sync {sync}, which embeds it")
    from planner.clusters import embedded_cluster
    from planner.formats.catalog import load_catalog

    model = RoundModel.build(profile, embedded_cluster(plan), plan, planned_rows(config, plan), load_catalog())
    problem = with_sync(model.problem, sync, period, staleness)
    synced = shape_of(problem, partition_of(problem, plan))
    resynced = replace(plan, extra={**plan.extra, "data_parallel": synced.data_parallel()})
    step = model.step_time_s(resynced, dict(plan.extra.get("speed_factors") or {}))
    return replace(resynced, predicted={**plan.predicted, "step_time_s": step})


def with_round_drains(plan: Plan, profile: Profile, config: "RunConfig") -> Plan:
    """An asynchronous plan with its step re-predicted for the rounds this run drains at (``--round-steps``: the
    engine drains the pipeline at every round end, so each round pays one fill and drain; ``Problem.drain_every``),
    recorded as its ``async.drain_every``; so the summary compares the measured step with a prediction of the same
    rounds. A run that ends within the plan's synchronous warm-up drains every step (``async_spans``), and is priced
    so. Other plans, plans already predicted for these rounds, and plans without an embedded cluster are kept."""
    from planner.partition.sim.schedules import run_drain_every

    drains = run_drain_every(config.steps, config.round_steps, plan.async_warmup)
    if (plan.schedule not in ASYNC_SCHEDULES or plan.drain_every == drains
            or not isinstance(plan.extra.get("cluster"), Mapping)):
        return plan
    from planner.clusters import embedded_cluster
    from planner.formats.catalog import load_catalog
    from planner.runtime.rebalancing.replan import RoundModel

    model = RoundModel.build(profile, embedded_cluster(plan), plan, planned_rows(config, plan), load_catalog(),
                             drain_every=drains)
    step = model.step_time_s(plan, dict(plan.extra.get("speed_factors") or {}))
    drained = {**dict(plan.extra.get("async") or {}), "drain_every": drains}
    return replace(plan, extra={**plan.extra, "async": drained}, predicted={**plan.predicted, "step_time_s": step})


def world_size_of(plan: Plan) -> int:
    """Ranks a plan needs: its distinct devices, replicas included, and one more for a parameter server (the last
    rank, ``planner.runtime.parameter_server``)."""
    layout, _ = replica_layout(plan)
    return max(max(row) for row in layout) + 1 + (1 if plan.shape().served else 0)


def prepare(config: "RunConfig", world_size: int | None, device: torch.device) -> Prepared:
    """Everything a rank needs that does not talk to other ranks; raises ``PlannerError`` on a mismatch.

    ``world_size``: the ranks started, which must be the plan's device count (``None``: not checked)."""
    plan, profile, where = load_checked_plan(config.plan, config.profile)
    mismatch = check_device_types(plan, device, config.allow_device_mismatch)
    plan = with_round_drains(with_sync_mode(with_emulated_link(plan, profile, config), profile, config), profile,
                             config)
    need = world_size_of(plan)
    if world_size is not None and world_size != need:
        layout, _ = replica_layout(plan)
        what = (f"{len(layout)} replicas of {len(plan.stages)} stage(s)" if len(layout) > 1 else "stages")
        raise DistributedError(f"the plan places {what} on {need} devices but {world_size} ranks were started; "
                               f"start {need} ranks (--nproc-per-node {need}) or re-partition for {world_size}")
    # --microbatch-size, else the rows the plan was made for (--microbatches auto), else the profile's
    mbs = planned_rows(config, plan) or int(profile.model.get("microbatch_size", 0)) or None
    torch.manual_seed(config.seed)  # factories that do not seed themselves still build the same model on every rank
    module, example = load_factory(config.model, microbatch_size=mbs)
    mbs = mbs or batch_size(example)
    selector = profile.model.get("output")  # plan profile --model-output: the output to train on
    module = select_output(module, None if selector is None else str(selector))
    module.to(device).train()
    example = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in example)
    tracer = str(profile.extra.get("tracer") or "auto")  # the graph the profile's node names come from
    captured = capture(module, example, tracer)
    check_graph(captured, profile, mbs, where)
    spec = data_mod.data_spec(example, _example_output(module, example, device))
    name, lr = resolve_optimizer(plan, config.optimizer, config.lr)
    settings = TrainSettings(name, lr, plan.microbatches, mbs, config.seed)
    data = make_data(spec, settings, config)
    target = parse_target(config.target)
    if target is not None and target.metric == "accuracy" and not data_mod.has_accuracy(data.spec):
        raise UsageError(f"--target {config.target}: this task has no accuracy (its loss is {data.spec.loss}: "
                         f"accuracy needs class labels or next-token ids); use --target loss=VALUE")
    split_batch(data.batch(0)[0], plan.microbatches)
    identity = run_identity(config, captured, module, settings, plan)
    if plan.shape().served and config.options.get("checkpoint_dir"):
        raise UsageError(f"--checkpoint-dir saves the ranks' stages, but --sync {plan.shape().sync} keeps the model on "
                         f"a parameter server rank, which plan run does not checkpoint yet; drop --checkpoint-dir")
    resume = check_resume(config.options.get("checkpoint_dir"), config.steps, identity, plan, config.plan)
    return Prepared(plan, profile, module, captured, data.spec, settings, data.batch, val_batch=data.val_batch,
                    custom_loss=data.custom_loss, data_fingerprint=data.fingerprint, device_mismatch=mismatch,
                    identity=identity, resume=resume, sync_options=sync_options(config, plan))


def sync_options(config: "RunConfig", plan: Plan) -> AdaptiveOptions:
    """``--sync adaptive``'s knobs from the config (checked by ``planner.app.run`` before any rank starts); the
    sub-tensor size, unless given, from the links of ``plan`` (``auto_chunk_bytes``)."""
    return AdaptiveOptions(AdaptiveRule(overhead=config.sync_overhead, max_period=config.sync_max_period),
                           elastic=config.sync_elastic, momentum=config.sync_momentum,
                           chunk_bytes=config.sync_chunk_bytes or auto_chunk_bytes(plan))


def auto_chunk_bytes(plan: Plan) -> int:
    """The sub-tensor size the cost model prices for ``plan``'s replicas (``allreduce.sync_chunk_bytes`` on the
    links of its embedded cluster, under ``--emulate-link`` the slowed ones): the largest over its stages' replica
    groups, one figure for the run; ``CHUNK_FLOOR_BYTES`` for a plan that embeds no cluster."""
    from planner.clusters import embedded_cluster
    from planner.partition.model.allreduce import CHUNK_FLOOR_BYTES, sync_chunk_bytes

    groups = [devices for devices in plan.replicas() if len(devices) > 1]
    if not groups or not isinstance(plan.extra.get("cluster"), Mapping):
        return CHUNK_FLOOR_BYTES
    cluster = embedded_cluster(plan)
    return max(sync_chunk_bytes(devices, cluster.link) for devices in groups)


def preflight(config: "RunConfig") -> Prepared:
    """Every check ``prepare`` makes, in this process on CPU, before ranks start (``world_size_of(result.plan)``
    ranks are to start; ``result.resume`` is the checkpoint they will resume from).

    The device-type check uses the device the ranks will get (a GPU where CUDA is available)."""
    rank_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan, _, _ = load_checked_plan(config.plan, config.profile)
    check_device_types(plan, rank_device, config.allow_device_mismatch)
    return prepare(replace(config, allow_device_mismatch=True), None, torch.device("cpu"))


def with_emulated_link(plan: Plan, profile: Profile, config: "RunConfig") -> Plan:
    """Under ``--emulate-link``, the plan as the cost model sees those links: its embedded cluster's links
    slowed by the same figures (so re-plans use them too) and its step time re-simulated on them."""
    link = parse_link(config.emulate_link)
    raw = plan.extra.get("cluster")
    if link is None:
        return plan
    if not isinstance(raw, Mapping):
        raise UsageError("--emulate-link needs the plan's cluster to predict the slowed links, and this plan embeds "
                         "none; make the plan with plan partition, which embeds it")
    from planner.formats.catalog import load_catalog
    from planner.formats.cluster import cluster_from_dict
    from planner.runtime.rebalancing.replan import RoundModel

    cluster = cluster_from_dict(dict(raw), "the plan's cluster").slowed(link.bandwidth_Bps, link.latency_s)
    extra = {**plan.extra, "cluster": cluster.to_dict(), "emulated_link": link.to_dict()}
    slowed = replace(plan, extra=extra)
    model = RoundModel.build(profile, cluster, slowed, planned_rows(config, plan), load_catalog(),
                             drain_every=plan.drain_every)
    step = model.step_time_s(slowed, dict(plan.extra.get("speed_factors") or {}))
    return replace(slowed, predicted={**plan.predicted, "step_time_s": step,
                                      "step_time_s_without_emulated_link": plan.step_time_s})


def planned_rows(config: "RunConfig", plan: Plan) -> int | None:
    """The run's rows per micro-batch as far as the config and the plan say (``None``: the profile's)."""
    return config.microbatch_size or int(plan.extra.get("microbatch_size") or 0) or None


def plan_device_types(plan: Plan) -> dict[str, str]:
    """Device id -> type, for the plan's stages: from each stage's ``device_type``, else the embedded cluster."""
    types = {}
    cluster = plan.extra.get("cluster")
    listed = {str(d.get("id")): str(d.get("type")) for d in (cluster or {}).get("devices", ()) if isinstance(d, dict)} \
        if isinstance(cluster, dict) else {}
    for stage in plan.stages:
        kind = stage.extra.get("device_type") or listed.get(stage.device)
        if kind:
            types[stage.device] = str(kind)
    return types


def check_device_types(plan: Plan, device: torch.device, allow: bool) -> tuple[str, ...]:
    """The plan's device types that differ from the type of ``device`` (what the ranks run on); refused unless
    ``allow`` (``--allow-device-mismatch``): the plan's split and its predictions were made for other devices."""
    local = detect_device_type(device)
    other = tuple(sorted({t for t in plan_device_types(plan).values() if t != local}))
    if other and not allow:
        raise PlanMismatchError(
            f"the plan was made for {', '.join(other)} devices but the ranks run on {local}, so its split and "
            f"predicted step time do not hold here; re-partition for a cluster of {local} devices (for CPU ranks: "
            f"--cluster cpu-2), or pass --allow-device-mismatch to train with it anyway")
    return other


@dataclass(frozen=True)
class Data:
    """The run's batches and task, as ``make_data`` finds them."""

    spec: data_mod.DataSpec
    batch: BatchFn
    val_batch: BatchFn | None
    custom_loss: Callable[..., Any] | None
    fingerprint: str | None


def make_data(spec: data_mod.DataSpec, settings: TrainSettings, config: "RunConfig") -> Data:
    """Step -> whole batch (``microbatches x microbatch_size`` rows), synthetic or from ``--data``; the held-out
    batches for ``--eval-every``; the task (``data_mod.task_spec``) and the loss."""
    rows = settings.microbatches * settings.microbatch_size
    custom = data_mod.load_loss(config.loss) if config.loss else None
    if config.data is None:
        spec = data_mod.task_spec(spec, torch.zeros(0), custom is not None)
        return Data(spec, lambda step: data_mod.make_batch(spec, settings.seed, step, rows),
                    lambda step: data_mod.make_batch(spec, settings.seed, step, rows, "val"), custom, None)
    factory = data_mod.load_data_factory(config.data)
    data_mod.check_data_factory(factory, config.data, spec, settings.seed, rows, settings.microbatches)
    spec = data_mod.task_spec(spec, data_mod.custom_batch(factory, spec, settings.seed, 0, rows)[1], custom is not None)
    val = None
    if data_mod.takes_split(factory):
        val = lambda step: data_mod.custom_batch(factory, spec, settings.seed, step, rows, "val")  # noqa: E731
    elif config.eval_every:
        raise UsageError(f"--eval-every needs held-out batches, but the --data factory {config.data} has no split "
                         f"argument; give it split: str = 'train' and return validation batches for split='val'")
    probe = getattr(sys.modules.get(factory.__module__), "fingerprint", None)
    return Data(spec, lambda step: data_mod.custom_batch(factory, spec, settings.seed, step, rows), val, custom,
                str(probe()) if callable(probe) else None)


def _example_output(module: nn.Module, example: tuple[Any, ...], device: torch.device) -> Any:
    """The model's output on the example inputs (one eager forward; the random streams are left as they were)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        return module(*example)


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
