"""Per-device timeline picture of a simulated step (a Gantt chart), as PNG and SVG.

One row per device and one per link; forward, backward and send bars per micro-batch, labelled
with the micro-batch number where the bar is wide enough. Drawn with matplotlib's object API on
the Agg canvas (no pyplot state, no display needed), then written atomically.
"""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from planner.formats.jsonio import check_writable, write_bytes_atomic
from planner.report.events import TimedEvent

if TYPE_CHECKING:
    from matplotlib.axes import Axes

COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "send_fwd": "#8C8C8C", "send_bwd": "#B5B5B5"}
LEGEND = {"fwd": "forward", "bwd": "backward", "send_fwd": "send activations", "send_bwd": "send gradients"}


def render_timeline(
    events: Sequence[TimedEvent],
    devices: Sequence[str],
    links: Sequence[str],
    labels: Mapping[str, str],
    title: str,
    formats: Sequence[str] = ("png", "svg"),
) -> dict[str, bytes]:
    """Draw the chart once (device rows, then link rows) and return its bytes per format (``png``, ``svg``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    tracks = [*devices, *links]
    end_s = max((ev.end_s for ev in events), default=0.0)
    scale, unit = _time_unit(end_s)
    fig = Figure(figsize=(12, 1.2 + 0.5 * max(1, len(tracks))), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    row = {name: i for i, name in enumerate(tracks)}
    bars: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    for ev in events:
        start, width = ev.start_s * scale, max(0.0, ev.end_s - ev.start_s) * scale
        bars[(ev.resource, ev.kind)].append((start, width))
        if end_s > 0 and width / (end_s * scale) > 0.012:
            ax.text(start + width / 2, row[ev.resource], str(ev.microbatch), ha="center", va="center",
                    fontsize=7, color="white")
    for (resource, kind), spans in sorted(bars.items()):
        ax.broken_barh(spans, (row[resource] - 0.4, 0.8), facecolors=COLORS.get(kind, "#333333"),
                       edgecolors="white", linewidth=0.5)
    _decorate(ax, tracks, labels, unit, end_s * scale, title)
    if devices and links:
        ax.axhline(len(devices) - 0.5, color="black", linewidth=0.6)
    kinds = {kind for _, kind in bars}
    handles = [Patch(color=COLORS[k], label=LEGEND[k]) for k in COLORS if k in kinds]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8, frameon=False)
    out: dict[str, bytes] = {}
    for fmt in formats:
        buffer = io.BytesIO()
        fig.savefig(buffer, format=fmt, dpi=120, metadata=_metadata(fmt))
        out[fmt] = buffer.getvalue()
    return out


def write_timeline(
    events: Sequence[TimedEvent],
    devices: Sequence[str],
    links: Sequence[str],
    labels: Mapping[str, str],
    title: str,
    paths: Mapping[str, Path],
) -> dict[str, Path]:
    """Write the chart to ``paths`` (format -> path); every path is checked before anything is drawn."""
    for path in paths.values():
        check_writable(path, "timeline")
    images = render_timeline(events, devices, links, labels, title, tuple(paths))
    return {fmt: write_bytes_atomic(path, images[fmt]) for fmt, path in paths.items()}


def _decorate(ax: Axes, tracks: Sequence[str], labels: Mapping[str, str], unit: str, end: float, title: str) -> None:
    ax.set_yticks(range(len(tracks)), [labels.get(t, t.replace("->", " → ")) for t in tracks], fontsize=8)
    ax.set_ylim(len(tracks) - 0.5, -0.5)
    ax.set_xlim(0, end * 1.01 if end > 0 else 1)
    ax.set_xlabel(f"time ({unit})")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", linestyle=":", linewidth=0.5)


def _time_unit(end_s: float) -> tuple[float, str]:
    if end_s >= 1.0:
        return 1.0, "s"
    if end_s >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _metadata(fmt: str) -> dict[str, str | None]:
    # Fixed metadata keeps the files byte-stable from run to run (no creation date, fixed SVG ids).
    if fmt == "svg":
        return {"Date": None}
    if fmt == "png":
        return {"Software": "planner"}
    return {}
