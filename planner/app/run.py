"""``plan run``: validate the options, check the plan against the model, start the ranks, return rank 0's summary.

Outside torchrun it checks everything it can in this process (plan, profile, model graph, world size)
and then starts the ranks with torch's elastic launcher. Under ``torchrun`` (``TORCHELASTIC_RUN_ID`` is
set) this process is one of the ranks and trains in-process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from planner.errors import UsageError
from planner.runtime.launch.config import ASYNC_RECEIVES, RunConfig
from planner.runtime.options import parse_link, parse_target, run_options

__all__ = ["Launch", "run_config", "run_plan"]


@dataclass(frozen=True)
class Launch:
    """How to start the ranks (as torchrun's options)."""

    nproc_per_node: int | None = None
    """Ranks on this node (default: the plan's device count / nnodes)."""
    nnodes: str = "1"
    rdzv_endpoint: str | None = None
    rdzv_id: str = "plan-run"
    max_restarts: int = 0


def run_config(*, plan: str, model: str, steps: int, round_steps: int, timeout_s: float, max_restarts: int = 0,
               options: Mapping[str, Any], **fields: Any) -> RunConfig:
    """Check the counts and the hooks' options (no torch imported yet) and build the ranks' config."""
    for name, value, low in (("--steps", steps, 1), ("--round-steps", round_steps, 1), ("--max-restarts", max_restarts, 0)):
        if value < low:
            raise UsageError(f"{name} must be at least {low}, found {value}")
    if not timeout_s > 0:
        raise UsageError(f"--timeout-s must be positive, found {timeout_s}")
    check_learning_options(fields)
    return RunConfig(plan=plan, model=model, steps=steps, round_steps=round_steps, timeout_s=timeout_s,
                     options=run_options(**options), **fields)


def check_learning_options(fields: Mapping[str, Any]) -> None:
    """Evaluation, target, loss and link options, checked before torch is imported."""
    eval_every, eval_batches = int(fields.get("eval_every") or 0), int(fields.get("eval_batches", 4))
    if eval_every < 0 or eval_batches < 1:
        raise UsageError(f"--eval-every must be >= 0 and --eval-batches >= 1, found {eval_every} and {eval_batches}")
    target = parse_target(fields.get("target"))
    if target is not None and not eval_every:
        raise UsageError(f"--target {fields['target']} is judged on evaluations; pass --eval-every K as well")
    if fields.get("stop_at_target") and target is None:
        raise UsageError("--stop-at-target needs --target METRIC=VALUE")
    parse_link(fields.get("emulate_link"))
    receives = fields.get("async_receives", "auto")
    if receives not in ASYNC_RECEIVES:
        raise UsageError(f"unknown --async-receives {receives!r}; expected one of {', '.join(ASYNC_RECEIVES)}")
    check_sync_options(fields)
    loss = fields.get("loss")
    if loss is not None and (":" not in str(loss) or not str(loss).rpartition(":")[2]):
        raise UsageError(f"--loss must look like pkg.mod:fn or file.py:fn, found {loss!r}")


def check_sync_options(fields: Mapping[str, Any]) -> None:
    """``--sync`` and its knobs, checked before torch is imported (the plan is checked against them later)."""
    from planner.formats.plan import SYNC_MODES
    from planner.partition.search.sync_period import AdaptiveRule

    sync, period = fields.get("sync"), fields.get("sync_period")
    if sync is not None and sync not in SYNC_MODES:
        raise UsageError(f"unknown --sync {sync!r}; expected one of {', '.join(SYNC_MODES)}")
    if period is not None and period < 1:
        raise UsageError(f"--sync-period must be a whole number of local steps, 1 or more, found {period}; pass for "
                         f"example --sync-period 4")
    elastic = float(fields.get("sync_elastic", 0.0))
    if not 0.0 <= elastic < 1.0:
        raise UsageError(f"--sync-elastic must be at least 0 and below 1, found {elastic}; pass for example 0.1")
    momentum = float(fields.get("sync_momentum", 0.0))
    if not 0.0 <= momentum < 1.0:
        raise UsageError(f"--sync-momentum must be at least 0 and below 1, found {momentum}; pass for example 0.5")
    chunk = fields.get("sync_chunk_bytes")
    if chunk is not None and int(chunk) < 4:
        raise UsageError(f"--sync-chunk-bytes must be at least 4 (one float), found {chunk}; leave it out to size the "
                         f"sub-tensors from the links")
    try:
        AdaptiveRule(overhead=float(fields.get("sync_overhead", 0.1)), max_period=int(fields.get("sync_max_period", 32)))
    except UsageError as exc:
        raise UsageError(f"--sync-overhead / --sync-max-period: {exc}") from None
    from planner.formats.plan import STALENESS_SYNCS
    from planner.runtime.parameter_server.rule import DaspRule

    staleness = fields.get("staleness")
    if staleness is not None and staleness < 0:
        raise UsageError(f"--staleness must be a whole number of steps, 0 or more, found {staleness}; pass for "
                         f"example --staleness 3")
    if staleness is not None and sync is not None and sync not in STALENESS_SYNCS:
        raise UsageError(f"--staleness bounds {' and '.join(STALENESS_SYNCS)}, but --sync is {sync}; pass --sync ssp "
                         f"or drop --staleness")
    knobs = {"slow_factor": float, "rejoin_factor": float, "patience": int, "async_update": str}
    DaspRule(**{knob: kind(fields[f"dasp_{knob}"]) for knob, kind in knobs.items()
                if fields.get(f"dasp_{knob}") is not None})  # the knobs given; DaspRule holds the defaults


def run_plan(config: RunConfig, launch: Launch = Launch(),
             announce: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Train with the plan; return rank 0's summary (``None`` on the other ranks under torchrun).

    ``announce`` receives one line before the ranks start (the CLI prints it).
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        from planner.runtime.launch.main import rank_main

        result = rank_main(config)
        return result if result.get("primary", result["rank"] == 0) else None
    from planner.runtime.launch.elastic import LaunchOptions, launch as start, parse_nnodes
    from planner.runtime.launch.prepare import preflight, world_size_of
    from planner.runtime.slowdown import parse_slowdown_patterns, parse_slowdowns

    min_nodes, max_nodes = parse_nnodes(launch.nnodes)
    checked = preflight(config)
    world = world_size_of(checked.plan)
    nproc = launch.nproc_per_node or max(1, world // max_nodes)
    served = checked.plan.shape().served
    # a rank the job lacks (or, for a pipeline, a time-varying pattern): refused before any rank starts
    (parse_slowdown_patterns if served else parse_slowdowns)(config.options.get("emulate_slowdown"),
                                                             world - 1 if served else world)
    if min_nodes == max_nodes and nproc * max_nodes != world:
        raise UsageError(f"the plan places stages on {world} devices but {max_nodes} node(s) x {nproc} ranks "
                         f"= {nproc * max_nodes} would start; pass --nproc-per-node {world // max_nodes or 1} "
                         f"or re-partition for {nproc * max_nodes} devices")
    if announce is not None:
        if checked.resume is not None:
            from planner.report.render import describe_resume

            announce(f"resuming from {describe_resume(checked.resume.to_dict())}")
        announce(f"starting {nproc} rank(s) per node on {max_nodes} node(s) ...")
    results = start(config, LaunchOptions(nproc_per_node=nproc, nnodes=launch.nnodes, rdzv_endpoint=launch.rdzv_endpoint,
                                          rdzv_id=launch.rdzv_id, max_restarts=launch.max_restarts))
    return next((r for r in results.values() if r.get("primary")), results[min(results)])
