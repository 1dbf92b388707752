"""The stage table shared by ``plan partition`` and ``plan show``, and the plan summary for ``--json``.

Reads the per-stage figures a plan carries (``compute_s``, ``transfer_s``, ``memory_bytes``,
``capacity_bytes``, ``idle_s``, ``layers``) and the embedded cluster for device types. Builds
rich renderables; the CLI prints them.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from rich.table import Table
from rich.text import Text

from planner.clusters import embedded_cluster
from planner.formats.plan import PERIODIC_SYNCS, V_SCHEDULES, Plan, Stage


def stage_table(plan: Plan, title: str | None = None) -> Table:
    """One row per stage: device and type, layers and op count, compute and transfer per micro-batch, memory,
    and the device's idle time per step (``device_table`` breaks the step down per device)."""
    types = device_types(plan)
    shape = plan.shape()
    hybrid = shape.replicated
    sync = ("; sync: every worker's exchange with the parameter server, per step" if shape.served else
            f"; sync: one averaging of the stage's weights over its replicas ({shape.sync_text()})"
            if hybrid and shape.sync in PERIODIC_SYNCS else
            "; sync: all-reducing the stage's gradients over its replicas, per step" if hybrid else "")
    # Names (devices, layers, paths) go in as Text so brackets in them are never read as rich markup.
    again = plan.recomputed()
    key = "; +AC: the stage recomputes its activations (its backward runs its forward again)" if any(again) else ""
    caption = "compute and transfer per micro-batch, idle per step" + sync + key
    table = Table(title=None if title is None else Text(title), title_justify="left", header_style="bold",
                  caption=caption, caption_justify="left")
    columns = [("#", "right"), ("device", "left"), ("layers / ops", "left"), ("compute", "right"),
               ("transfer", "right"), *([("sync", "right")] if hybrid else []), ("memory / capacity", "right"),
               ("idle", "right")]
    for name, justify in columns:
        short = name in ("#", "compute", "transfer", "sync", "idle")  # never wrapped; the others wrap when narrow
        table.add_column(name, justify=justify, no_wrap=short)  # type: ignore[arg-type]
    for stage, devices, recomputes in zip(plan.stages, plan.replicas(), again):
        x = stage.extra
        device = f"{stage.device} ({types[stage.device]})" if stage.device in types else stage.device
        if len(devices) > 1:
            device += f" x{len(devices)}: " + ", ".join(devices)
        table.add_row(
            str(stage.index), Text(device), Text(layer_span(stage)),
            fmt_time(x.get("compute_s")) + (" +AC" if recomputes else ""), fmt_time(x.get("transfer_s")),
            *([fmt_time(x.get("sync_s"))] if hybrid else []),
            _memory_cell(x.get("memory_bytes"), x.get("capacity_bytes")), fmt_time(x.get("idle_s")),
        )
    return table


DEVICE_PARTS = (("compute", "compute_s"), ("transfer", "copy_s"), ("runtime", "overhead_s"), ("sync", "sync_s"),
                ("optimizer", "update_s"), ("idle", "idle_s"))
"""The per-device columns of ``device_table``: they add up to the step (``predicted.devices``); ``sync`` (replicas
all-reducing gradients) is shown for hybrid plans only."""


def device_table(plan: Plan) -> Table | None:
    """One row per device, over one step: compute, transfer it moves itself (host copies), runtime overhead
    per pass, optimizer step and idle, which add up to the step time (``None`` for plans made before these
    figures were recorded)."""
    devices = plan.predicted.get("devices") or {}
    if not devices or not all("compute_s" in d for d in devices.values()):
        return None
    table = Table(title=Text(f"per device, over one step of {fmt_time(plan.step_time_s)}"), title_justify="left",
                  header_style="bold")
    table.add_column("device")
    hybrid = any(float(d.get("sync_s", 0.0)) > 0 for d in devices.values())
    parts_shown = [(name, key) for name, key in DEVICE_PARTS if key != "sync_s" or hybrid]
    for name, _ in parts_shown:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("sum", justify="right", no_wrap=True)
    for device, parts in devices.items():
        values = [float(parts.get(key, 0.0)) for _, key in parts_shown]
        table.add_row(Text(str(device)), *(fmt_time(v) for v in values), fmt_time(sum(values)))
    return table


def summary_text(plan: Plan) -> Text:
    """The line under the table: method, schedule, micro-batches, predicted step time and bubble."""
    bubble = plan.predicted.get("bubble_fraction")
    text = Text()
    text.append(f"placer {plan.method}", style="bold")
    shape = plan.shape()
    degree = shape.degree
    text.append(f" · {plan.schedule} · {plan.microbatches} micro-batches · {shape.stages_text()}")
    if shape.replicated:
        text.append(f" x {shape.replicas_text()}", style="bold")
    text.append(" · ")
    text.append(f"step {fmt_time(plan.step_time_s)}", style="bold green")
    if isinstance(bubble, (int, float)):
        text.append(f" · bubble {bubble:.1%}")
    if plan.drain_every is not None:
        text.append(f" · drains every {plan.drain_every} step{'s' if plan.drain_every != 1 else ''} (plan run's rounds)")
    if plan.async_warmup:
        text.append(f" · steps 0-{plan.async_warmup - 1} synchronous (warm-up)")
    solver = plan.extra.get("solver")
    if isinstance(solver, Mapping) and solver.get("status"):
        text.append(f" · solver {solver['status']}")
    refine = plan.extra.get("refine")
    if isinstance(refine, Mapping) and isinstance(refine.get("rounds"), (list, tuple)):
        text.append(f" · refined: {len(refine['rounds'])} round(s), stop {refine.get('stop', '?')}")
    speeds = plan.extra.get("speed_factors")
    if isinstance(speeds, Mapping) and any(abs(float(f) - 1.0) > 1e-9 for f in speeds.values()):
        shown = ", ".join(f"{d} x{float(f):.2f}" for d, f in sorted(speeds.items()) if abs(float(f) - 1.0) > 1e-9)
        text.append(f" · measured speed factors (compute times multiplied): {shown}", style="yellow")
    estimated = plan.extra.get("estimated_types")
    if estimated:
        text.append(f" · estimated times for {', '.join(map(str, estimated))}", style="yellow")
    idle = unused_devices(plan)
    if idle:
        total = len(idle) + len({d for devices in shape.replicas for d in devices})
        why = (f"{degree} replica pipelines of {len(shape.replicas)} device{'s' if len(shape.replicas) != 1 else ''} each"
               if degree > 1 else "the placer found no faster plan using them")
        text.append(f" · not used: {', '.join(idle)} ({len(idle)} of {total} devices; {why})", style="yellow")
    interleaved = plan.extra.get("interleave")
    if isinstance(interleaved, Mapping) and interleaved.get("reason"):
        text.append(f" · {'V' if plan.schedule in V_SCHEDULES else 'interleaved'}: {interleaved['reason']}",
                    style="yellow" if interleaved.get("chunks") == 1 else "")
    return text


def unused_devices(plan: Plan) -> list[str]:
    """Devices of the plan's embedded cluster that hold no stage (in cluster order; none without a cluster)."""
    if not isinstance(plan.extra.get("cluster"), Mapping):
        return []
    used = {d for devices in plan.shape().replicas for d in devices}
    return [d.id for d in embedded_cluster(plan).devices if d.id not in used]


def plan_summary(plan: Plan) -> dict[str, Any]:
    """Machine-readable summary: the settings, the prediction and one compact record per stage."""
    types = device_types(plan)
    stages = []
    for stage in plan.stages:
        layers = _layers(stage)
        stages.append({
            "index": stage.index, "device": stage.device, "type": types.get(stage.device),
            **({"replicas": list(stage.extra["replicas"]), "sync_s": stage.extra.get("sync_s")}
               if stage.extra.get("replicas") else {}),
            "nodes": len(stage.nodes), "layers": list(layers),
            **{k: stage.extra.get(k) for k in ("compute_s", "transfer_s", "memory_bytes", "capacity_bytes", "idle_s")},
        })
    return {
        "method": plan.method, "schedule": plan.schedule, "microbatches": plan.microbatches,
        "step_time_s": plan.step_time_s, "bubble_fraction": plan.predicted.get("bubble_fraction"),
        "peak_memory_bytes": plan.peak_memory_bytes, "stages": stages,
        **({"interleave": dict(plan.extra["interleave"])} if isinstance(plan.extra.get("interleave"), Mapping) else {}),
        **({"data_parallel": dict(plan.extra["data_parallel"])} if isinstance(plan.extra.get("data_parallel"), Mapping) else {}),
        **({"shape": dict(plan.extra["shape"])} if isinstance(plan.extra.get("shape"), Mapping) else {}),
        "devices": {str(d): dict(v) for d, v in (plan.predicted.get("devices") or {}).items()},
    }


def device_types(plan: Plan) -> dict[str, str]:
    """Device id -> type, from the cluster embedded in the plan (empty when none is embedded)."""
    cluster = plan.extra.get("cluster")
    if not isinstance(cluster, Mapping):
        return {}
    return {str(d["id"]): str(d.get("type", "?")) for d in cluster.get("devices", ()) if isinstance(d, Mapping) and "id" in d}


def layer_span(stage: Stage) -> str:
    """The stage's layers, compact, and its op count: ``h.0-3, wte (5 layers, 212 ops)``."""
    layers = _layers(stage)
    ops = f"{len(stage.nodes)} ops"
    if not layers:
        return ops if not stage.nodes else f"{stage.nodes[0]} .. {stage.nodes[-1]} ({ops})"
    if len(layers) == 1:
        return f"{layers[0]} ({ops})"
    return f"{compact_layers(layers)} ({len(layers)} layers, {ops})"


def compact_layers(layers: Sequence[str], limit: int = 4) -> str:
    """Entries of one repeated module as index ranges, others by name: ``h.0-3,5, ln_f, wte``.

    Plans list a stage's layers as a set (sorted by name), so this says which layers a stage holds
    without claiming an order; more than ``limit`` groups end in ``(+N)``.
    """
    groups: dict[str, list[int]] = {}
    names: list[str] = []
    for layer in layers:
        match = _INDEXED.match(layer)
        if match:
            groups.setdefault(match.group(1), []).append(int(match.group(2)))
        else:
            names.append(layer)
    parts = [f"{prefix}{_ranges(sorted(set(indices)))}" for prefix, indices in sorted(groups.items())]
    parts += sorted(set(names))
    shown = ", ".join(parts[:limit])
    return shown if len(parts) <= limit else f"{shown} (+{len(parts) - limit})"


_INDEXED = re.compile(r"^(.*\.)(\d+)$")


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _layers(stage: Stage) -> Sequence[str]:
    layers = stage.extra.get("layers")
    if not isinstance(layers, (list, tuple)):
        return ()
    return [str(x) if str(x) else "(root)" for x in layers]


def fmt_time(seconds: Any) -> str:
    """Seconds in the unit that keeps 3 significant digits: ``1.23 s``, ``45.6 ms``, ``789 µs``; below a picosecond
    (a difference of floats that should cancel, such as a device's idle time when it is the busiest) ``0 s``."""
    if not isinstance(seconds, (int, float)):
        return "-"
    value = float(seconds)
    if abs(value) < 1e-12:
        return "0 s"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return "0 s" if value == 0 else f"{value * 1e9:.3g} ns"


def fmt_bytes(nbytes: Any) -> str:
    """Bytes in binary units: ``1.50 GiB``."""
    if not isinstance(nbytes, (int, float)):
        return "-"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.3g} {unit}"
        value /= 1024
    return f"{value:.3g} TiB"


def _memory_cell(memory: Any, capacity: Any) -> Text:
    if not isinstance(memory, (int, float)):
        return Text("-")
    if not isinstance(capacity, (int, float)) or capacity <= 0:
        return Text(fmt_bytes(memory))
    share = memory / capacity
    style = "red bold" if share > 1 else "yellow" if share > 0.9 else ""
    return Text(f"{fmt_bytes(memory)} / {fmt_bytes(capacity)} ({share:.0%})", style=style)
