"""``plan curves``: read run logs (``plan run --log``) or run summaries (``plan run --json``), and return each
run's training-loss and evaluation curves against step and training time, with its time to target.

A *run log* is JSON lines: round records (``round``, ``first_step``, ``steps``, ``wall_s``, ``loss``) and
evaluation records (``{"eval": {"step", "wall_s", "loss", "accuracy"}}``). A *summary* is one JSON object
with ``losses``, ``rounds`` and ``eval``. Training time excludes evaluation in both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from planner.errors import InputFileError, UsageError
from planner.formats.jsonio import check_writable
from planner.runtime.options import Target, parse_target

__all__ = ["RunCurves", "CurvesResult", "load_run", "curves_command", "time_to_target"]


@dataclass(frozen=True)
class RunCurves:
    name: str
    train: tuple[tuple[int, float, float], ...]
    """(step, training seconds, loss) at the end of each round (or step, from a summary)."""
    evals: tuple[dict[str, Any], ...]
    target: Target | None = None
    time_to_target_s: float | None = None
    final: dict[str, Any] = field(default_factory=dict)
    """The last evaluation (or the last training loss when there was none)."""


@dataclass(frozen=True)
class CurvesResult:
    runs: tuple[RunCurves, ...]
    outputs: tuple[str, ...]

    def table(self) -> list[dict[str, Any]]:
        return [{"run": r.name, "steps": r.train[-1][0] if r.train else 0,
                 "train_s": r.train[-1][1] if r.train else 0.0,
                 "final_loss": r.final.get("loss"), "final_accuracy": r.final.get("accuracy"),
                 "target": r.target.to_dict() if r.target else None, "time_to_target_s": r.time_to_target_s}
                for r in self.runs]


def time_to_target(evals: Sequence[dict[str, Any]], target: Target | None) -> float | None:
    """Training seconds to the first evaluation that reaches ``target`` (``None``: none did, or no target)."""
    if target is None:
        return None
    return next((float(e["wall_s"]) for e in evals if target.reached(float(e["loss"]), e.get("accuracy"))), None)


def load_run(path: str | Path, target: Target | None = None) -> RunCurves:
    """One run from a run log or a summary; ``InputFileError`` when the file is neither."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputFileError(f"cannot read run log {str(path)!r} ({exc.strerror or exc}); pass the file written "
                             f"by plan run --log or the output of plan run --json") from None
    records = _records(text)
    if records is None or not records:
        raise InputFileError(f"{str(path)!r} is not a run log or run summary (expected JSON lines with round or "
                             f"eval records, or one JSON object with losses and rounds); pass the file written by "
                             f"plan run --log FILE or the output of plan run --json")
    if len(records) == 1 and "losses" in records[0]:
        return _from_summary(path, records[0], target)
    rounds = [r for r in records if "round" in r and "steps" in r and "wall_s" in r]
    evals = [dict(r["eval"]) for r in records if isinstance(r.get("eval"), dict)]
    if not rounds and not evals:
        raise InputFileError(f"{str(path)!r} holds JSON but no round or eval records; pass the file written by "
                             f"plan run --log FILE or the output of plan run --json")
    train, clock = [], 0.0
    for r in rounds:
        clock += float(r["wall_s"])
        if r.get("loss") is not None:
            train.append((int(r["first_step"]) + int(r["steps"]), clock, float(r["loss"])))
    return _curves(path.stem, train, evals, target)


def _records(text: str) -> list[dict[str, Any]] | None:
    try:
        whole = json.loads(text)
        return [whole] if isinstance(whole, dict) else None
    except json.JSONDecodeError:
        pass
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return None
        if not isinstance(record, dict):
            return None
        out.append(record)
    return out


def _from_summary(path: Path, summary: dict[str, Any], target: Target | None) -> RunCurves:
    losses = [float(x) for x in summary.get("losses", [])]
    first = int(summary.get("first_step") or 0)
    train, clock, step = [], 0.0, 0
    for r in summary.get("rounds", []):
        per_step = float(r["wall_s"]) / max(int(r["steps"]), 1)
        for _ in range(int(r["steps"])):
            clock += per_step
            index = first + step
            if index < len(losses):
                train.append((index + 1, clock, losses[index]))
            step += 1
    own = Target(str(summary["target"]["metric"]), float(summary["target"]["value"])) \
        if isinstance(summary.get("target"), dict) else None
    target = target or own
    curves = _curves(path.stem, train, [dict(e) for e in summary.get("eval") or []], target)
    if own is not None and target == own and summary.get("time_to_target_s") is not None:
        # the run's own figure for its own target (it may have checked the target between evaluations)
        curves = replace(curves, time_to_target_s=float(summary["time_to_target_s"]))
    return curves


def _curves(name: str, train: list[tuple[int, float, float]], evals: list[dict[str, Any]],
            target: Target | None) -> RunCurves:
    final = dict(evals[-1]) if evals else ({"loss": train[-1][2], "accuracy": None} if train else {})
    return RunCurves(name, tuple(train), tuple(evals), target, time_to_target(evals, target), final)


def curves_command(paths: Sequence[str | Path], output: str | Path | None, target: str | None) -> CurvesResult:
    """Load every run, check the target against what they measured, draw to ``output`` (PNG and SVG)."""
    if not paths:
        raise UsageError("pass at least one run log (plan run --log FILE) or summary (plan run --json)")
    wanted = parse_target(target)
    out = Path(output) if output else None
    if out is not None:
        if out.suffix.lower() not in (".png", ".svg"):
            raise UsageError(f"-o must name a .png or .svg file (both are written), found {str(out)!r}")
        check_writable(out, "curves")
    runs = tuple(load_run(p, wanted) for p in paths)
    if wanted is not None and wanted.metric == "accuracy" and not any(
            e.get("accuracy") is not None for r in runs for e in r.evals):
        raise UsageError(f"--target {target}: these runs measured no accuracy (their task has none, or they ran "
                         f"without --eval-every); use loss=VALUE")
    written: tuple[str, ...] = ()
    if out is not None:
        from planner.report.curves import draw

        written = draw(runs, out)
    return CurvesResult(runs, written)
