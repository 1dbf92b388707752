"""Re-simulate a saved plan from what it carries: per-stage simulator figures and the embedded cluster.

Every field of ``planner.partition.sim.simulate.SimStage`` except ``device`` (``fwd_s``, ``bwd_s``,
``send_fwd_bytes``, ``send_bwd_bytes``, ``static_bytes``, ``activation_bytes``, ``update_s``, for zero-bubble plans
``bwd_weight_s`` and ``split_excess_s``, and for recomputing stages ``recompute_bytes``) is stored on each stage of a
plan by ``build_plan``; reading them back by the dataclass's own field list keeps this module in step with the
simulator. A field with a default (``update_s``, ``bwd_weight_s``, ``split_excess_s``, ``recompute_bytes``) may be
missing from plans written before it existed or
that do not need it; the default is used.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from planner.clusters import embedded_cluster
from planner.errors import InputFileError
from planner.formats.plan import Plan, Stage
from planner.partition.sim.simulate import SimResult, SimStage
from planner.partition.sim.step import simulate_step


def sim_stage(stage: Stage, what: str = "plan") -> SimStage:
    """The simulator's view of one stored stage; a missing or non-numeric figure is an input error."""
    values: dict[str, Any] = {"device": stage.device}
    for f in dataclasses.fields(SimStage):
        if f.name == "device":
            continue
        raw = stage.extra.get(f.name)
        if raw is None and f.default is not dataclasses.MISSING:
            continue
        if not isinstance(raw, (int, float)) or isinstance(raw, bool) or raw < 0:
            raise InputFileError(
                f"{what}: stage {stage.index} has no usable {f.name!r} (found {raw!r}); the plan cannot be "
                f"re-simulated. Re-create it with `plan partition`"
            )
        values[f.name] = int(raw) if f.type in ("int", int) else float(raw)
    return SimStage(**values)


def simulate_plan(plan: Plan, what: str = "plan") -> SimResult:
    """Simulate one training step of ``plan`` on its embedded cluster, recording every event (a hybrid plan: every
    replica pipeline with its share, from each stage's ``replica_times``, then the stages' ``sync_s``)."""
    stages = [sim_stage(stage, what) for stage in plan.stages]
    shape = plan.shape()
    tied = _tied(plan, what)
    if not shape.replicated:
        return simulate_step([stages], [plan.microbatches], [], embedded_cluster(plan, what), plan.schedule,
                             drain_every=plan.drain_every, tied=tied)
    pipelines = []
    for r in range(shape.degree):
        pipelines.append([dataclasses.replace(sim, device=devices[r], **_replica_figures(stage, r, what))
                          for sim, stage, devices in zip(stages, plan.stages, shape.replicas)])
    shares = shape.shares
    sync = [float(stage.extra.get("sync_s") or 0.0) for stage in plan.stages]
    return simulate_step(pipelines, shares, sync, embedded_cluster(plan, what), plan.schedule, period=shape.period,
                         overlap=shape.sync == "adaptive", tied=tied)


def _tied(plan: Plan, what: str) -> list[tuple[list[int], int]]:
    """The plan's ``tied_sync`` (absent: none, as plans written before it) as ``simulate``'s ``tied``."""
    out = []
    for entry in plan.extra.get("tied_sync") or ():
        stages = entry.get("stages") if isinstance(entry, dict) else None
        nbytes = entry.get("bytes") if isinstance(entry, dict) else None
        if (not isinstance(stages, list) or not all(isinstance(s, int) and 0 <= s < len(plan.stages) for s in stages)
                or not isinstance(nbytes, int) or nbytes < 0):
            raise InputFileError(f"{what}: its tied_sync entry {entry!r} is not {{'stages': [stage indices], "
                                 f"'bytes': int}}; the plan cannot be re-simulated. Re-create it with `plan partition`")
        out.append((stages, nbytes))
    return out


def _replica_figures(stage: Stage, r: int, what: str) -> dict[str, float]:
    rows = stage.extra.get("replica_times")
    if not isinstance(rows, list) or len(rows) <= r or not isinstance(rows[r], dict):
        raise InputFileError(f"{what}: stage {stage.index} has replicas but no usable 'replica_times' for replica {r}; "
                             f"the plan cannot be re-simulated. Re-create it with `plan partition`")
    return {k: float(rows[r][k]) for k in ("fwd_s", "bwd_s", "update_s", "bwd_weight_s", "split_excess_s")
            if k in rows[r]}
