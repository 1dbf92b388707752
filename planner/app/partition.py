"""The library side of ``plan partition``: load a profile and a cluster, partition, save the plan.

The placers themselves are ``planner.partition.partition``; this module only does the file work
around them (the output path is checked before any planning, the plan is written atomically, and
records the profile it was made from by path and SHA-256).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from types import MappingProxyType
from pathlib import Path
from typing import Any

from planner.clusters import load_cluster_spec
from planner.errors import InfeasibleError, UsageError
from planner.formats.catalog import load_catalog
from planner.formats.jsonio import check_writable
from planner.formats.plan import (ASYNC_CORRECTIONS, ASYNC_SCHEDULES, DEFAULT_ASYNC_WARMUP, SCHEDULES, SERVER_SYNCS, Plan,
                                  save_plan, valid_warmup)
from planner.formats.profile import load_profile


RECOMPUTE_CHOICES = ("off", "on", "auto")
"""``--recompute``: activation recomputation never, in every stage, or only where it pays: ``auto`` places as if every
stage recomputed and keeps it only on the stages whose devices cannot hold their saved activations, and takes that
plan when nothing fits without recomputation or when it is faster than the plan without (memory may have bent that
plan's cuts; docs/cost-model.md, "Recomputation")."""


def check_recompute(recompute: str, schedule: str) -> None:
    """``--recompute``: one of ``RECOMPUTE_CHOICES``, and not ``on`` with an asynchronous schedule."""
    if recompute not in RECOMPUTE_CHOICES:
        raise UsageError(f"--recompute must be one of {', '.join(RECOMPUTE_CHOICES)}, found {recompute!r}")
    if recompute == "on" and schedule in ASYNC_SCHEDULES:
        raise UsageError(f"--recompute on is not built for the asynchronous schedule {schedule} (its stages run on "
                         f"stashed weight versions); use --schedule 1f1b or gpipe, or --recompute off")


def profile_ref(path: str | Path, model_name: str | None) -> dict[str, Any]:
    """What a plan records about its profile: the path as given, its SHA-256 and the model's name."""
    return {"path": str(path), "sha256": hashlib.sha256(Path(path).read_bytes()).hexdigest(), "model": model_name}


def check_settings(method: str, microbatches: int | None, schedule: str, optimizer: str) -> None:
    """Refuse bad option values as usage errors (exit code 2) before any file is read (``microbatches`` and
    ``schedule`` may be chosen: ``None`` and ``"auto"``)."""
    from planner.partition.placers.registry import get as get_method
    from planner.partition.model.problem import validate_settings

    if schedule != "auto" and schedule not in SCHEDULES:  # plan partition also takes auto
        raise UsageError(f"unknown schedule {schedule!r}; expected auto or one of {', '.join(SCHEDULES)}")
    validate_settings(8 if microbatches is None else microbatches, "1f1b" if schedule == "auto" else schedule,
                      optimizer)
    get_method(method)


def partition_file(profile_path: str | Path, cluster_spec: str, output: str | Path | None, *, method: str,
                   microbatches: int | str, schedule: str, optimizer: str = "adam", refine: bool = False,
                   granularity: str | None = None, time_limit_s: float | None = None,
                   estimate_precision: str | None = None, data_parallel: str | int = "auto",
                   global_batch: int | None = None, sync: str = "ssgd", sync_period: int | None = None,
                   staleness: int | None = None, async_correction: str = "predict", recompute: str = "off",
                   round_steps: int | None = None, async_warmup: int | None = None) -> Plan:
    """Partition the profile at ``profile_path`` over the cluster ``cluster_spec`` (a path or a bundled
    name) and write the plan to ``output`` (when given). ``schedule="auto"`` and ``microbatches="auto"`` (with
    ``global_batch`` samples) are chosen by simulated step time (``planner.partition.search.settings``). Raises
    ``PlannerError`` on bad input; on any error nothing is written. ``sync``, ``sync_period`` and ``staleness``: how
    replicas combine their updates (``planner.partition.partition``). ``async_correction``: what an asynchronous
    schedule does about delayed gradients (docs/async.md) and ``async_warmup`` the steps it first runs synchronously
    (``None``: ``DEFAULT_ASYNC_WARMUP``), both recorded in the plan's ``async`` field. ``recompute``:
    activation recomputation -- ``off``, ``on`` (every stage), or ``auto`` (only in the stages that need it, for a
    candidate when nothing fits without it or when that is faster than the plan without; ``RECOMPUTE_CHOICES``).
    ``round_steps``: the steps ``plan run`` will run between an asynchronous pipeline's drains
    (``Problem.drain_every``; ``None``: the steady state)."""
    from planner.partition import partition
    from planner.partition.search.settings import TIE, choose, parse_microbatches

    count = parse_microbatches(microbatches, global_batch)
    check_settings(method, count, schedule, optimizer)
    from planner.partition.search.hybrid import parse_degree

    degree = parse_degree(data_parallel)
    if async_warmup is None:
        async_warmup = DEFAULT_ASYNC_WARMUP
    if schedule in ASYNC_SCHEDULES or schedule == "auto":
        if async_correction not in ASYNC_CORRECTIONS:
            raise UsageError(f"--async-correction must be one of {', '.join(ASYNC_CORRECTIONS)}, found "
                             f"{async_correction!r}")
        if not valid_warmup(async_warmup):
            raise UsageError(f"--async-warmup must be a whole number of steps >= 0 (0: no synchronous warm-up), found "
                             f"{async_warmup!r}")
        if schedule != "auto" and degree not in (None, 1) and sync in SERVER_SYNCS:
            raise UsageError(f"--schedule {schedule} runs replica pipelines that combine their updates among "
                             f"themselves (ssgd, local-sgd, adaptive), found --sync {sync}, which trains through a "
                             f"parameter server; use one of those, or --schedule 1f1b for {sync}")
    from planner.partition.model.problem import check_sync

    check_sync(sync, sync_period, staleness)
    check_recompute(recompute, schedule)
    from planner.partition.model.problem import check_drain_every

    check_drain_every(round_steps)
    if count is None and degree is not None and global_batch is not None:
        from planner.partition.search.settings import microbatch_counts

        most = max(microbatch_counts(global_batch))
        if most < degree:
            raise UsageError(f"--data-parallel {degree} needs at least {degree} micro-batches, but --global-batch "
                             f"{global_batch} splits into at most {most}; pass a --global-batch of {degree} or more "
                             f"(a multiple of {degree} splits evenly), or --data-parallel {most} or less")
    if granularity is not None:
        from planner.partition.model.granularity import parse_granularity

        parse_granularity(granularity)
    if time_limit_s is not None and not time_limit_s > 0:
        raise UsageError(f"--time-limit must be positive seconds, found {time_limit_s}")
    if time_limit_s is not None and method != "ilp":
        raise UsageError(f"--time-limit applies to --method ilp only, found --method {method}")
    from planner.roofline import check_precision

    check_precision(estimate_precision)
    if output is not None:
        check_writable(output, "plan")
    profile = load_profile(profile_path)
    cluster = load_cluster_spec(cluster_spec)
    options = {} if time_limit_s is None else {"time_limit_s": time_limit_s}  # --time-limit: the ilp method's
    catalog, ref = load_catalog(), profile_ref(profile_path, profile.model.get("name"))

    def plan_with(source: Any, count: int, schedule_name: str, refine: bool = refine, full: bool = True) -> Plan:
        asynchronous = schedule_name in ASYNC_SCHEDULES

        def place(again: bool | str) -> Plan:
            return partition(source, cluster, method=method, microbatches=count, schedule=schedule_name,
                             optimizer=optimizer, refine=refine, granularity=granularity,
                             estimate_precision=estimate_precision, catalog=catalog,
                             data_parallel=data_parallel, profile_ref=ref, sync=sync,
                             sync_period=sync_period, sync_staleness=staleness, recompute=again,
                             drain_every=round_steps if asynchronous else None, thorough=full, **options)

        if recompute == "on":
            if asynchronous:
                raise UsageError(f"{schedule_name} does not recompute activations (stashed weight versions)")
            return place(True)
        if recompute == "off" or asynchronous:
            return place(False)
        try:
            plain = place(False)
        except InfeasibleError:
            return place("auto")  # nothing fits without it: recompute in the stages that need it
        where_needed = place("auto")  # the cuts of recomputation, kept only where needed: faster where memory bent
        return where_needed if where_needed.step_time_s < plain.step_time_s * (1 - TIE) else plain  # plain's cuts

    if schedule == "auto" or count is None:  # --refine: only the finalists (settings.choose)
        # the first pass over every candidate: no refine, no class-count groupings (about 1 s each); the finalists
        # get both
        quick = functools.partial(plan_with, refine=False, full=False) if refine else plan_with
        plan = choose(profile, schedule, count, global_batch, quick, plan_with if refine else None, catalog)
    else:
        plan = plan_with(profile, count, schedule)
    if plan.schedule in ASYNC_SCHEDULES:
        plan = dataclasses.replace(plan, extra=MappingProxyType(
            {**plan.extra, "async": {**plan.extra["async"], "correction": async_correction, "warmup": async_warmup}}))
    if output is not None:
        save_plan(plan, output)
    return plan
