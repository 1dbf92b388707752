"""The report of ``plan profile``: totals per device type, measured vs whole model, top ops, coverage gaps.

``profile_summary`` returns plain data (also the ``--json`` output); ``render_summary`` prints it
with rich. This is the one module of ``planner.profile`` that prints.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from planner.formats.profile import Profile
from planner.partition.model.times import calibration_factors
from planner.roofline import FREE_CLASSES


def profile_summary(profile: Profile, top: int = 10) -> dict[str, Any]:
    """Totals, whole-model check, the ``top`` ops by local time and the FLOP coverage, as plain data."""
    local = str(profile.extra.get("device_type", ""))
    totals = {}
    for dev in profile.device_types:
        sources = sorted({n.time_s[dev].source for n in profile.nodes})
        totals[dev] = {"fwd_s": sum(n.time_s[dev].fwd for n in profile.nodes),
                       "bwd_s": sum(n.time_s[dev].bwd for n in profile.nodes), "source": "/".join(sources)}
    working = [n for n in profile.nodes if n.extra.get("op_class") not in FREE_CLASSES]
    ranked = sorted((n for n in profile.nodes if local in n.time_s),
                    key=lambda n: -(n.time_s[local].fwd + n.time_s[local].bwd))[:top]
    whole = dict(profile.extra.get("whole_model", {}))

    calibration = calibration_factors(profile).get(local)
    if calibration is not None:
        whole["calibration"] = calibration  # the factor the cost model applies (None: out of range, not applied)
    if whole.get("fwd_s") and whole.get("bwd_s"):
        whole["ratio_fwd"] = whole["sum_ops_fwd_s"] / whole["fwd_s"]
        whole["ratio_bwd"] = whole["sum_ops_bwd_s"] / whole["bwd_s"]
        whole["ratio_total"] = (whole["sum_ops_fwd_s"] + whole["sum_ops_bwd_s"]) / (whole["fwd_s"] + whole["bwd_s"])
    return {
        "model": dict(profile.model),
        "device_type": local,
        "tracer": profile.extra.get("tracer"),
        "nodes": len(profile.nodes),
        "working_ops": len(working),
        "param_bytes": sum(n.param_bytes for n in profile.nodes),
        "saved_bytes": sum(n.saved_bytes for n in profile.nodes),
        "flops": sum(n.flops for n in profile.nodes),
        "bwd_flops": sum(n.bwd_flops for n in profile.nodes),
        "totals": totals,
        "whole_model": whole,
        "top_ops": [{"name": n.name, "op": n.op, "module_path": n.module_path, "fwd_s": n.time_s[local].fwd,
                     "bwd_s": n.time_s[local].bwd, "flops": n.flops, "output_bytes": n.output_bytes} for n in ranked],
        "flops_counted_ops": sum(1 for n in working if n.flops > 0),
        "uncounted_flops": [{"op": u["op"], "count": u["count"]} for u in profile.extra.get("uncounted_flops", [])],
        "tied_parameters": [g["params"] for g in profile.extra.get("tied_parameters", [])],
        "measure_failures": list(profile.extra.get("measure_failures", [])),
        "warnings": output_warnings(profile),
    }


def output_warnings(profile: Profile) -> list[str]:
    """Why ``plan run`` would refuse the profiled model (its forward returns more than one tensor), with the fix."""
    kind = str(profile.model.get("output_kind", "one tensor"))
    if kind == "one tensor" or profile.model.get("output") is not None:
        return []
    return [f"the model returns {kind}; plan run trains on one tensor: profile it again with --model-output "
            f"KEY|INDEX to name the output to train on, or wrap the model so forward returns one tensor"]


def render_summary(summary: dict[str, Any], console: Console) -> None:
    """Print the summary of :func:`profile_summary` as rich tables."""
    model = summary["model"]
    console.print(f"[bold]{model.get('name')}[/] from {model.get('source')}: {summary['nodes']} nodes "
                  f"({summary['working_ops']} doing work), captured by {summary['tracer']}, "
                  f"micro-batch {model.get('microbatch_size')}, {_bytes(summary['param_bytes'])} of parameters, "
                  f"{_bytes(summary['saved_bytes'])} saved for backward, {summary['flops'] / 1e9:.2f} GFLOP forward")
    totals = Table(title="Per micro-batch, summed over ops")
    for col in ("device type", "forward", "backward", "source"):
        totals.add_column(col, justify="right" if col in ("forward", "backward") else "left")
    for dev, t in summary["totals"].items():
        totals.add_row(dev, _ms(t["fwd_s"]), _ms(t["bwd_s"]), t["source"])
    console.print(totals)
    whole = summary["whole_model"]
    if "ratio_fwd" in whole:
        console.print(f"whole model on {summary['device_type']}: forward {_ms(whole['fwd_s'])}, backward "
                      f"{_ms(whole['bwd_s'])}; sum of ops / whole = {whole['ratio_fwd']:.2f} (fwd), "
                      f"{whole['ratio_bwd']:.2f} (bwd), {whole['ratio_total']:.2f} (total)")
    if whole.get("train_s"):
        console.print(f"one training micro-batch: {_ms(whole['train_s'])}; the cost model scales the measured op "
                      f"times by {whole['calibration']:.3f} to match it" if "calibration" in whole else
                      f"one training micro-batch: {_ms(whole['train_s'])}; outside the calibration range, the cost "
                      f"model uses the measured op times as they are")
    for name, seconds in sorted((whole.get("update_s") or {}).items()):
        console.print(f"optimizer step ({name}) over all parameters: {_ms(seconds)}")
    top = Table(title=f"Top {len(summary['top_ops'])} ops by {summary['device_type']} time")
    for col in ("node", "op", "module", "fwd", "bwd", "GFLOP", "output"):
        top.add_column(col, justify="right" if col in ("fwd", "bwd", "GFLOP", "output") else "left")
    for op in summary["top_ops"]:
        top.add_row(op["name"], op["op"], op["module_path"], _ms(op["fwd_s"]), _ms(op["bwd_s"]),
                    f"{op['flops'] / 1e9:.3f}", _bytes(op["output_bytes"]))
    console.print(top)
    gaps = ", ".join(f"{u['op']} x{u['count']}" for u in summary["uncounted_flops"]) or "none"
    console.print(f"FLOPs counted for {summary['flops_counted_ops']} of {summary['working_ops']} working ops; "
                  f"uncounted (estimated from bytes moved): {gaps}")
    if summary["tied_parameters"]:
        console.print("shared parameters: " + "; ".join(" = ".join(g) for g in summary["tied_parameters"]))
    for warning in summary.get("warnings", ()):
        console.print(Text(f"warning: {warning}", style="yellow"), soft_wrap=True)
    for failure in summary["measure_failures"]:
        console.print(f"[yellow]not timed[/]: {failure['node']}: {failure['error']}")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
