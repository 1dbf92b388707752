"""Per-device timeline picture of a simulated step (a Gantt chart), as PNG and SVG.

One row per device and one per pair of linked devices ``a ↔ b`` (transfers ``a -> b`` in the
upper half of the row, ``b -> a`` in the lower half, ``a`` being earlier in the pipeline);
forward, backward and send bars per micro-batch, labelled with the micro-batch number where the
bar is wide enough. Drawn with matplotlib's object API on the Agg canvas (no pyplot state, no
display needed), then written atomically.
"""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from planner.formats.jsonio import check_writable, write_bytes_atomic
from planner.report.events import COMPUTE_KINDS, TimedEvent

if TYPE_CHECKING:
    from matplotlib.axes import Axes

COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "bwd_input": "#DD8452", "bwd_weight": "#C44E52", "update": "#55A868",
          "send_fwd": "#8C8C8C", "send_bwd": "#B5B5B5", "sync": "#8172B3"}
LEGEND = {"fwd": "forward", "bwd": "backward", "bwd_input": "backward, input gradient (I)",
          "bwd_weight": "backward, weight gradient (W)", "update": "optimizer step", "sync": "all-reduce over replicas",
          "send_fwd": "send activations",
          "send_bwd": "send gradients"}


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

    lanes, row_labels = _lanes(devices, links, labels)
    end_s = max((ev.end_s for ev in events), default=0.0)
    scale, unit = _time_unit(end_s)
    fig = Figure(figsize=(12, 1.2 + 0.5 * max(1, len(row_labels))), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars: dict[tuple[str, str], list[tuple[float, float]]] = defaultdict(list)
    stages_on: dict[str, set[int]] = defaultdict(set)
    for ev in events:
        stages_on[ev.resource].add(ev.stage)
    for ev in events:
        start, width = ev.start_s * scale, max(0.0, ev.end_s - ev.start_s) * scale
        bars[(ev.resource, ev.kind)].append((start, width))
        if end_s > 0 and width / (end_s * scale) > 0.012:
            y, height = lanes[ev.resource]
            # a device holding several stages (interleaved) labels its bars stage:micro-batch
            label = f"{ev.stage}:{ev.microbatch}" if len(stages_on[ev.resource]) > 1 and ev.kind in COMPUTE_KINDS \
                else "opt" if ev.kind == "update" else f"sync s{ev.stage}" if ev.kind == "sync" else str(ev.microbatch)
            ax.text(start + width / 2, y + height / 2, label, ha="center", va="center",
                    fontsize=7 if height > 0.5 else 6, color="white")
    for (resource, kind), spans in sorted(bars.items()):
        ax.broken_barh(spans, lanes[resource], facecolors=COLORS.get(kind, "#333333"), edgecolors="white",
                       linewidth=0.25)
    _decorate(ax, row_labels, unit, end_s * scale, title)
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


def _lanes(devices: Sequence[str], links: Sequence[str], labels: Mapping[str, str],
           ) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """Each resource's (bottom, height) in data units, and the row labels.

    A device fills its row. Both directions of a link share one row ``a ↔ b`` (``a`` earlier in the
    pipeline): ``a->b`` in the upper half, ``b->a`` in the lower half (colours tell activations from
    gradients), so a 16-stage pipeline needs 15 link rows, not 30.
    """
    lanes = {d: (i - 0.4, 0.8) for i, d in enumerate(devices)}
    row_labels = [labels.get(d, d) for d in devices]
    rows: dict[frozenset[str], int] = {}
    for link in links:
        src, _, dst = link.partition("->")
        key = frozenset((src, dst))
        if key not in rows:
            rows[key] = len(row_labels)
            row_labels.append(f"{src} ↔ {dst}")
        row = rows[key]
        upper = row_labels[row].startswith(f"{src} ↔")
        lanes[link] = (row - 0.4, 0.38) if upper else (row + 0.02, 0.38)
    return lanes, row_labels


def _decorate(ax: Axes, row_labels: Sequence[str], unit: str, end: float, title: str) -> None:
    ax.set_yticks(range(len(row_labels)), row_labels, fontsize=8)
    ax.set_ylim(len(row_labels) - 0.5, -0.5)
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
