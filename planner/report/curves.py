"""Draw ``plan curves``: each run's metric against training time and against step, side by side
(matplotlib, written as PNG and SVG), and the time-to-target table (rich)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

__all__ = ["draw", "render_curves"]


def draw(runs: Sequence[Any], output: Path) -> tuple[str, ...]:
    """Write ``output`` with the suffix .png and .svg; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targeted = [r.target.metric for r in runs if r.target is not None]
    accuracy = any(e.get("accuracy") is not None for r in runs for e in r.evals)
    metric = targeted[0] if targeted else ("accuracy" if accuracy else "loss")  # the target's metric first
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for run in runs:
        if run.evals:
            points = [(float(e["wall_s"]), int(e["step"]), e.get(metric)) for e in run.evals if e.get(metric) is not None]
            label = f"{run.name} (validation {metric})"
        else:
            points = [(t, s, loss) for s, t, loss in run.train]
            label = f"{run.name} (training loss)"
        if not points:
            continue
        line, = by_time.plot([p[0] for p in points], [p[2] for p in points], marker="o", ms=3, label=label)
        by_step.plot([p[1] for p in points], [p[2] for p in points], marker="o", ms=3, color=line.get_color(),
                     label=label)
        if run.target is not None and run.time_to_target_s is not None:
            by_time.axvline(run.time_to_target_s, color=line.get_color(), ls=":", lw=1)
    for ax, xlabel in ((by_time, "training time (s, evaluation excluded)"), (by_step, "step")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"validation {metric}" if any(r.evals for r in runs) else "training loss")
        ax.grid(alpha=0.3)
    targets = {(r.target.metric, r.target.value) for r in runs if r.target is not None and r.target.metric == metric}
    for _, value in targets:
        for ax in (by_time, by_step):
            ax.axhline(value, color="grey", ls="--", lw=1)
    by_step.legend(fontsize=8)
    written = []
    for suffix in (".png", ".svg"):
        path = output.with_suffix(suffix)
        fig.savefig(path, dpi=120)
        written.append(str(path))
    plt.close(fig)
    return tuple(written)


def render_curves(console: Console, table: Sequence[dict[str, Any]], outputs: Sequence[str]) -> None:
    """The time-to-target table, then the files written."""
    grid = Table(title="time to target", title_justify="left", header_style="bold")
    for name in ("run", "steps", "training time", "final loss", "final accuracy", "target", "time to target"):
        grid.add_column(name, justify="left" if name in ("run", "target") else "right")
    for row in table:
        target = row["target"]
        grid.add_row(row["run"], str(row["steps"]), f"{row['train_s']:.2f} s",
                     "-" if row["final_loss"] is None else f"{row['final_loss']:.4f}",
                     "-" if row["final_accuracy"] is None else f"{row['final_accuracy']:.2%}",
                     f"{target['metric']} {target['value']:g}" if target else "-",
                     "-" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.2f} s")
    console.print(grid)
    for path in outputs:
        console.print(f"wrote {path}")
