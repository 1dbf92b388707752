"""``plan show``: load a plan, re-simulate it, and write the timeline pictures and the trace asked for."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from planner.formats.jsonio import check_writable, write_bytes_atomic
from planner.formats.plan import Plan, load_plan
from planner.partition.sim.simulate import SimStage, held_bytes
from planner.report.events import TimedEvent, memory_timeline, split_tracks
from planner.report.replay import sim_stage, simulate_plan
from planner.report.table import device_types
from planner.report.timeline import write_timeline
from planner.report.trace import chrome_trace

__all__ = ["ShowResult", "default_report_paths", "show_plan"]


@dataclass(frozen=True)
class ShowResult:
    """What ``show_plan`` produced: the plan it read and the files it wrote (format -> path)."""

    plan: Plan
    files: Mapping[str, Path]
    step_time_s: float | None
    """Step time of the re-simulation (equals the plan's prediction unless the plan was edited);
    ``None`` when no file was asked for, so nothing was simulated."""


def default_report_paths(plan_path: str | Path) -> dict[str, Path]:
    """``run/plan.json`` -> ``run/plan.timeline.png``, ``run/plan.timeline.svg``, ``run/plan.trace.json``."""
    path = Path(plan_path)
    stem = path.with_suffix("") if path.suffix == ".json" else path
    return {"png": Path(f"{stem}.timeline.png"), "svg": Path(f"{stem}.timeline.svg"), "trace": Path(f"{stem}.trace.json")}


def show_plan(plan_path: str | Path, paths: Mapping[str, Path]) -> ShowResult:
    """Load a plan, re-simulate it, and write the timeline (``png``, ``svg``) and ``trace`` files asked for.

    Every output path is checked before any work, so a bad path leaves no file behind.
    """
    for path in paths.values():
        check_writable(path, "report")
    plan = load_plan(plan_path)
    if not paths:
        return ShowResult(plan=plan, files={}, step_time_s=None)
    sim = simulate_plan(plan, f"plan {str(plan_path)!r}")
    devices, links = split_tracks(sim.events, plan.replica_devices())
    types = device_types(plan)
    labels = {d: f"{d} ({types[d]})" if d in types else d for d in devices}
    title = f"{Path(plan_path).name}: {plan.method}, {plan.schedule}, {plan.microbatches} micro-batches"
    written: dict[str, Path] = {}
    pictures = {fmt: paths[fmt] for fmt in ("png", "svg") if fmt in paths}
    if pictures:
        written.update(write_timeline(sim.events, devices, links, labels, title, pictures))
    if "trace" in paths:
        trace = chrome_trace(sim.events, devices, links, labels, title, memory=_memory(plan, sim.events))
        written["trace"] = write_bytes_atomic(paths["trace"], (json.dumps(trace) + "\n").encode("utf-8"))
    return ShowResult(plan=plan, files=written, step_time_s=sim.step_time_s)


def _memory(plan: Plan, events: Sequence[TimedEvent]) -> dict[str, list[tuple[float, int]]]:
    """Each device's memory over the step, from the static and activation bytes its stages carry."""
    held: dict[str, list[SimStage]] = {}
    activation: dict[int, int] = {}
    for stage in plan.stages:
        sim = sim_stage(stage)
        held.setdefault(stage.device, []).append(sim)
        activation[stage.index] = sim.activation_bytes
    return memory_timeline(events, {device: held_bytes(sims) for device, sims in held.items()}, activation)
