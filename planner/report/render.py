"""Console rendering of the application layer's results: one ``render_*`` function per command result.

The CLI calls these after the library call returns; nothing else prints tables. Every cell that holds
data (node names, paths) goes in as ``Text`` so that it is never read as rich markup.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.formats.plan import SCHEDULES, Plan
from planner.report.table import device_table, fmt_bytes, fmt_time, stage_table, summary_text

if TYPE_CHECKING:
    from planner.app.check import CheckResult, PlanDiff

__all__ = ["render_plan", "render_check", "render_diff", "render_run", "render_links", "render_strategy", "render_train"]


def render_plan(console: Console, plan: Plan, *, title: str | None = None, simulated_step_time_s: float | None = None,
                files: Mapping[str, Any] | None = None) -> None:
    """The stage table and summary of ``plan`` (``plan partition``, ``plan show``) and the files written."""
    console.print(stage_table(plan, title=title))
    devices = device_table(plan)
    if devices is not None:
        console.print(devices)
    console.print(summary_text(plan))
    predicted = plan.step_time_s
    if simulated_step_time_s is not None and abs(simulated_step_time_s - predicted) > 1e-9 * max(predicted, 1e-12):
        console.print(Text(f"note: re-simulated step time {simulated_step_time_s:.6g} s differs from the plan's "
                           f"predicted {predicted:.6g} s (edited plan, or made by another version)", style="yellow"))
    for kind, path in (files or {}).items():
        console.print(Text(f"wrote {path}" if kind == "plan" else f"wrote {kind}: {path}"), soft_wrap=True)  # a path stays whole


def render_check(console: Console, result: CheckResult) -> None:
    """``plan check``: the problems, the metrics against the baseline, notes and the verdict line."""
    for problem in result.problems:
        console.print(Text(f"invalid: {problem}", style="red"))
    if result.metrics:
        table = Table(title=Text(f"{result.plan} vs baseline {result.baseline}"), title_justify="left",
                      header_style="bold")
        for name in ("metric", "baseline", "current", "change", "limit", "verdict"):
            table.add_column(name, justify="left" if name in ("metric", "verdict") else "right")
        for m in result.metrics:
            fmt = fmt_time if m.unit == "s" else fmt_bytes
            verdict = Text("regressed", style="red bold") if m.regressed else Text("ok", style="green")
            table.add_row(Text(m.name), fmt(m.baseline), fmt(m.current), f"{m.change:+.2%}", f"+{m.tolerance:.2%}",
                          verdict)
        console.print(table)
    for note in result.notes:
        console.print(Text(f"note: {note}", style="yellow"))
    detail = []
    if result.problems:
        detail.append(f"{len(result.problems)} problem(s)")
    if result.regressions:
        detail.append("regressed: " + ", ".join(m.name for m in result.regressions))
    console.print(Text(f"{'PASS' if result.passed else 'FAIL'}: {result.plan}" + (f" ({'; '.join(detail)})" if detail else ""),
                       style="green bold" if result.passed else "red bold"))


def render_diff(console: Console, result: PlanDiff) -> None:
    """``plan diff``: changed settings, one row per stage, and the step time and memory either side."""
    for key, (va, vb) in result.settings.items():
        console.print(Text(f"{key}: {va} -> {vb}"))
    table = Table(title=Text(f"{result.a} -> {result.b}"), title_justify="left", header_style="bold")
    for name in ("stage", "device", "nodes", "moved in", "moved out", "compute", "memory"):
        table.add_column(name, justify="right" if name in ("stage", "nodes", "compute", "memory") else "left")
    for s in result.stages:
        cells = (str(s.index), _arrow(s.device_a, s.device_b), _arrow(s.nodes_a, s.nodes_b),
                 _names(s.moved_in), _names(s.moved_out),
                 _arrow(fmt_time(s.compute_s_a), fmt_time(s.compute_s_b)),
                 _arrow(fmt_bytes(s.memory_bytes_a), fmt_bytes(s.memory_bytes_b)))
        table.add_row(*(Text(cell) for cell in cells))
    console.print(table)
    (ta, tb), (ma, mb) = result.step_time_s, result.peak_memory_bytes
    change = f" ({tb / ta - 1:+.2%})" if ta > 0 else ""
    console.print(Text(f"step time: {fmt_time(ta)} -> {fmt_time(tb)}{change}; peak memory: {fmt_bytes(ma)} -> "
                       f"{fmt_bytes(mb)}; moved nodes: {result.moved_nodes}"))
    for label, names in (("only in A", result.only_in_a), ("only in B", result.only_in_b)):
        if names:
            console.print(Text(f"{label}: {_names(names, 8)}", style="yellow"))
    if result.identical:
        console.print(Text("the plans place every node identically"))


def render_run(console: Console, result: Mapping[str, Any]) -> None:
    """``plan run``: what trained, the loss, and the measured step time against the plan's prediction."""
    first = int(result.get("first_step") or 0)
    losses = result["losses"][first:]  # this run's part: a resumed run's earlier losses came from the checkpoint
    ranks = f"{result['world_size']} rank{'s' if result['world_size'] != 1 else ''}"
    resumed = result.get("resumed")
    if resumed:
        console.print(Text(f"resumed from {describe_resume(resumed)}", style="cyan"), soft_wrap=True)
    steps = (f"steps {first}-{result['steps'] - 1} ({result['steps'] - first} steps)" if first
             else f"{result['steps']} steps")
    sync = result.get("sync") or {}
    replicas = (f", {sync['degree']} replicas (data parallel; micro-batches "
                f"{'/'.join(map(str, sync.get('shares') or ()))}, {sync.get('mode')})" if sync.get("degree", 1) > 1 else "")
    console.print(Text(f"trained {steps} on {ranks} ({result['backend']}, {result['schedule']}, "
                       f"{result['microbatches']} x {result['microbatch_size']} micro-batches{replicas})"),
                  soft_wrap=True)
    warmup = int((result.get("async") or {}).get("warmup") or 0)
    if warmup > first:
        after = ("; the step time below is measured on the rounds after it, where any ran" if warmup < result["steps"]
                 else "; the run ended within it")
        console.print(Text(f"synchronous warm-up: steps {first}-{min(warmup, result['steps']) - 1} each drained, as "
                           f"under 1F1B (async.warmup){after}"), soft_wrap=True)
    if losses:
        console.print(Text(f"{result['optimizer']} lr {result['lr']:g}, {result['loss']} loss {losses[0]:.6f} -> "
                           f"{losses[-1]:.6f} in {result['wall_s']:.2f} s"), soft_wrap=True)
    for record in result.get("eval") or ():
        accuracy = f", accuracy {record['accuracy']:.2%}" if record.get("accuracy") is not None else ""
        console.print(Text(f"eval at step {record['step']} ({record['wall_s']:.2f} s of training): loss "
                           f"{record['loss']:.4f}{accuracy}"), soft_wrap=True)
    target = result.get("target")
    if target:
        reached = result.get("time_to_target_s")
        console.print(Text(f"target {target['metric']} {'>=' if target['metric'] == 'accuracy' else '<='} "
                           f"{target['value']:g}: " + (f"reached after {reached:.2f} s of training" if reached is not None
                                                       else "not reached"),
                           style="green" if reached is not None else "yellow"), soft_wrap=True)
    if result.get("bytes_sent") is not None:
        link = result.get("emulated_link")
        emulated = (f"; emulated link {link['bandwidth_Bps']:.3g} B/s + {link['latency_s'] * 1e3:g} ms added "
                    f"{result.get('emulated_link_s', 0.0):.2f} s over all ranks" if link else "")
        console.print(Text(f"sent {result['bytes_sent'] / 1e6:.2f} MB between ranks{emulated}"), soft_wrap=True)
    measured, predicted = result.get("step_time_s"), result.get("predicted_step_time_s")
    if result.get("device_mismatch"):
        console.print(Text(f"note: the plan was made for {', '.join(result['device_mismatch'])} devices "
                           f"(--allow-device-mismatch); its prediction does not apply here", style="yellow"),
                      soft_wrap=True)
    elif measured and predicted:
        console.print(Text(f"step time {measured:.3f} s measured (last rounds after the first), {predicted:.3f} s "
                           f"predicted by the plan in force ({_slower(measured, predicted)})"), soft_wrap=True)
        calibration = result.get("calibration")
        if calibration and calibration.get("calibrated_step_time_s"):
            calibrated = float(calibration["calibrated_step_time_s"])
            factors = ", ".join(f"{d} x{f:.2f}" for d, f in calibration["compute_factors"].items())
            console.print(Text(f"calibrated on this machine ({calibration['rounds']} steady rounds; compute measured "
                               f"/ predicted: {factors}): {calibrated:.3f} s predicted "
                               f"({_slower(measured, calibrated)})"), soft_wrap=True)


def _slower(measured: float, predicted: float) -> str:
    """The gap in words, so its sign cannot be misread: '+9%: measured slower than predicted'."""
    gap = measured / predicted - 1
    return f"{gap:+.0%}: measured {'slower' if gap > 0 else 'faster'} than predicted" if abs(gap) >= 0.005 else \
        "measured as predicted"


def render_links(console: Console, summary: Mapping[str, Any]) -> None:
    """``plan profile --probe-links``: one line per probed pair."""
    for pair in summary["pairs"]:
        console.print(Text(f"{pair['a']} <-> {pair['b']}: {pair['bandwidth_Bps'] / 1e9:.2f} GB/s, latency "
                           f"{pair['latency_s'] * 1e6:.1f} us"))
    console.print(Text(f"wrote {summary['output']}"), soft_wrap=True)


def _arrow(a: object, b: object) -> str:
    none = "-"
    a_text, b_text = none if a is None else str(a), none if b is None else str(b)
    return a_text if a_text == b_text else f"{a_text} -> {b_text}"


def _names(names: tuple[str, ...], limit: int = 3) -> str:
    if not names:
        return ""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} (+{len(names) - limit})"


def describe_resume(resumed: Mapping[str, Any]) -> str:
    """``step N of checkpoint P`` and, when it differs from the plan given, the plan the run continues under
    (``Resume.to_dict``): the words ``plan run`` prints before the ranks start and in its summary."""
    text = f"step {resumed['step']} of checkpoint {resumed['path']!s}"
    if resumed.get("other_start"):
        return (f"{text}, under the plan in force there, not the plan given (the checkpoint's run started from "
                f"another plan)")
    if resumed.get("plan_changed"):
        return f"{text}, under the plan in force there (rebalanced from the plan given)"
    return text



def render_strategy(console: Console, strategy: Mapping[str, Any], show: int) -> None:
    """``plan train``: the chosen strategy and the next best candidates, with why each lost (one table)."""
    rows = list(strategy["candidates"])
    fits = [r for r in rows if r.get("step_time_s") is not None]
    failed = [r for r in rows if r.get("step_time_s") is None]
    table = Table(title=f"strategy: {len(fits)} candidates fit, {len(failed)} do not (searched in "
                        f"{strategy['search_s']:.1f} s); shape: stages x replicas", title_justify="left",
                  box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in (("schedule", "left"), ("m x rows", "right"), ("shape", "left"), ("sync", "left"),
                          ("step", "right"), ("peak mem", "right"), ("verdict", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for row in [*fits[:show + 1], *failed[:1]]:
        stages, raw = int(row.get("stages") or 0), row.get("recompute")
        again = stages if raw is True else int(raw or 0)  # stages that recompute (earlier versions: true for all)
        shape = f"{row.get('stages')}x{int(row.get('degree') or 1)}" + (
            "" if not again else " +AC" if again >= stages else f" +AC{again}")
        memory = (f"{fmt_bytes(row['peak_memory_bytes'])} {row['memory_fraction']:.0%}"
                  if row.get("peak_memory_bytes") and row.get("memory_fraction") is not None else "")
        size = f"x{row['microbatch_size']}" if row.get("microbatch_size") else ""
        table.add_row(row["schedule"], f"{row['microbatches']}{size}", shape, row.get("sync") or "",
                      fmt_time(row["step_time_s"]) if row.get("step_time_s") else "-", memory, Text(str(row["verdict"])))
    console.print(table)
    verdicts = {str(r["verdict"]) for r in [*fits[:show + 1], *failed[:1]]}
    if any(v.startswith("+0.0%") or v == "tie" for v in verdicts):
        console.print(Text(f"tie: the same predicted step; the earlier schedule ({', '.join(SCHEDULES)}), fewer "
                           f"micro-batches and fewer replicas win"), soft_wrap=True)
    if failed:
        console.print(Text(f"no fit: {failed[0]['schedule']} with {failed[0]['microbatches']} micro-batches: "
                           f"{failed[0].get('why') or 'infeasible'}"), soft_wrap=True)
    sync = strategy.get("sync")
    if sync:
        console.print(Text(f"rule: {sync['chosen']} (ssgd's all-reduce is {sync['ssgd_sync_share']:.1%} of the step); "
                           f"{sync['rule']}"), soft_wrap=True)
    every = strategy.get("every_rank")
    if every:
        console.print(Text(f"every rank: the fastest plan uses {every['fastest_uses']} of the {every['ranks']} ranks "
                           f"torchrun started; planned again with --data-parallel {every['data_parallel']} so that "
                           f"each trains"), soft_wrap=True)


def render_train(console: Console, summary: Mapping[str, Any]) -> None:
    """``plan train``'s closing summary: the run (as ``plan run`` prints it), time to target, the artefacts."""
    run = summary.get("run")
    if run:
        render_run(console, run)
    for name, path in (summary.get("artifacts") or {}).items():
        console.print(Text(f"  {name.replace('_', ' '):<13} {path}"), soft_wrap=True)
