"""Draw ``plan curves``: each run's metric against training time and against step, side by side
(matplotlib, written as PNG and SVG), and the time-to-target table (rich)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

__all__ = ["Series", "plotted_series", "draw", "render_curves"]


@dataclass(frozen=True)
class Series:
    """One run's line: (training seconds, step, value) points, and whether it goes on the training-loss axis."""

    run: Any
    label: str
    points: tuple[tuple[float, int, float], ...]
    secondary: bool


def plotted_series(runs: Sequence[Any]) -> tuple[str, list[Series]]:
    """The metric the main axis shows (the target's, else validation accuracy if any run measured it, else loss)
    and each run's line. A run without that validation metric is drawn by its training loss on a second axis,
    never on the metric's (a loss of 2.2 read as an accuracy is how ``plan curves`` once misled)."""
    targeted = [r.target.metric for r in runs if r.target is not None]
    accuracy = any(e.get("accuracy") is not None for r in runs for e in r.evals)
    metric = targeted[0] if targeted else ("accuracy" if accuracy else "loss")
    evaluated = any(r.evals for r in runs)
    out = []
    for run in runs:
        points = tuple((float(e["wall_s"]), int(e["step"]), float(e[metric])) for e in run.evals
                       if e.get(metric) is not None)
        if points:
            out.append(Series(run, f"{run.name} (validation {metric})", points, False))
        elif run.train:
            out.append(Series(run, f"{run.name} (training loss)", tuple((t, s, loss) for s, t, loss in run.train),
                              metric != "loss" or evaluated))
    return metric, out


def draw(runs: Sequence[Any], output: Path) -> tuple[str, ...]:
    """Write ``output`` with the suffix .png and .svg; return the paths written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, series = plotted_series(runs)
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    twins = (by_time.twinx(), by_step.twinx()) if any(s.secondary for s in series) else None
    for s in series:
        axes = twins if s.secondary and twins else (by_time, by_step)
        style = "--" if s.label.endswith("(training loss)") else "-"
        line, = axes[0].plot([p[0] for p in s.points], [p[2] for p in s.points], style, marker="o", ms=3, label=s.label)
        axes[1].plot([p[1] for p in s.points], [p[2] for p in s.points], style, marker="o", ms=3,
                     color=line.get_color(), label=s.label)
        if s.run.target is not None and s.run.time_to_target_s is not None:
            by_time.axvline(s.run.time_to_target_s, color=line.get_color(), ls=":", lw=1)
    for ax, xlabel in ((by_time, "training time (s, evaluation excluded)"), (by_step, "step")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(f"validation {metric}" if any(r.evals for r in runs) else "training loss")
        ax.grid(alpha=0.3)
    if twins is not None:
        for ax in twins:
            ax.set_ylabel("training loss (dashed)")
    handles = [h for ax in (by_step, *(twins[1:] if twins else ())) for h in ax.get_legend_handles_labels()[0]]
    by_step.legend(handles=handles, fontsize=8)
    targets = {(r.target.metric, r.target.value) for r in runs if r.target is not None and r.target.metric == metric}
    for _, value in targets:
        for ax in (by_time, by_step):
            ax.axhline(value, color="grey", ls="--", lw=1)
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
        console.print(f"wrote {path}", soft_wrap=True)
