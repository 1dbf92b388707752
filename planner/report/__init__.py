"""The plan report: the stage table, the per-device timeline picture and the Chrome/Perfetto trace.

Public: ``stage_table``, ``summary_text``, ``plan_summary`` (tables), ``write_report`` (what
``plan show`` writes), ``default_report_paths``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from planner.formats.jsonio import check_writable, write_bytes_atomic
from planner.formats.plan import Plan, load_plan
from planner.report.events import TimedEvent
from planner.report.table import device_types, plan_summary, stage_table, summary_text

__all__ = ["ReportFiles", "default_report_paths", "plan_summary", "stage_table", "summary_text", "write_report"]


@dataclass(frozen=True)
class ReportFiles:
    """What ``write_report`` produced: the plan it read and the files it wrote (format -> path)."""

    plan: Plan
    files: Mapping[str, Path]
    step_time_s: float | None
    """Step time of the re-simulation (equals the plan's prediction unless the plan was edited);
    ``None`` when no file was asked for, so nothing was simulated."""


def default_report_paths(plan_path: str | Path) -> dict[str, Path]:
    """``run/plan.json`` -> ``run/plan.timeline.png``, ``run/plan.timeline.svg``, ``run/plan.trace.json``."""
    path = Path(plan_path)
    stem = path.name[: -len(path.suffix)] if path.suffix else path.name
    return {"png": path.with_name(f"{stem}.timeline.png"), "svg": path.with_name(f"{stem}.timeline.svg"),
            "trace": path.with_name(f"{stem}.trace.json")}


def write_report(plan_path: str | Path, paths: Mapping[str, Path]) -> ReportFiles:
    """Load a plan, re-simulate it, and write the timeline (``png``, ``svg``) and ``trace`` files asked for.

    Every output path is checked before any work, so a bad path leaves no file behind.
    """
    from planner.report.events import split_tracks
    from planner.report.replay import simulate_plan
    from planner.report.timeline import write_timeline
    from planner.report.trace import chrome_trace

    for path in paths.values():
        check_writable(path, "report")
    plan = load_plan(plan_path)
    if not paths:
        return ReportFiles(plan=plan, files={}, step_time_s=None)
    sim = simulate_plan(plan, f"plan {str(plan_path)!r}")
    device_order = [s.device for s in plan.stages]
    devices, links = split_tracks(sim.events, device_order)
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
    return ReportFiles(plan=plan, files=written, step_time_s=sim.step_time_s)


def _memory(plan: Plan, events: Sequence[TimedEvent]) -> dict[str, list[tuple[float, int]]]:
    """Each device's memory over the step, from the static and activation bytes its stages carry."""
    from planner.report.events import memory_timeline
    from planner.report.replay import sim_stage

    static: dict[str, int] = {}
    activation: dict[int, int] = {}
    for stage in plan.stages:
        sim = sim_stage(stage)
        static[stage.device] = static.get(stage.device, 0) + sim.static_bytes
        activation[stage.index] = sim.activation_bytes
    return memory_timeline(events, static, activation)
