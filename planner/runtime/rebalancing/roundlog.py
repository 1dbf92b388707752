"""One JSON line per round (a file and, with ``--json``, stdout) and a live rich table on rank 0.

A record holds the round's steps, step time, balance, each device's compute, wait, weight and speed
factor, and whether the plan changed (with what moved). Only rank 0 writes; the file is opened in
append mode so that a job restarted by torchrun continues the same log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

from planner.errors import PlannerError
from planner.partition.search.rebalance import RebalanceState, RoundStats

__all__ = ["round_record", "RoundLog", "round_table"]


def round_record(stats: RoundStats, state: RebalanceState, *, imbalance: float, balanced: bool, plan_changed: bool,
                 reason: str, loss: float | None = None, moved_tensors: int = 0, moved_bytes: int = 0,
                 stages: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """The JSON-ready record of one round (after its decision and re-plan)."""
    devices = {}
    for d in stats.devices:
        devices[d.device] = {"compute_s": d.compute_s, "wait_s": d.wait_s, "recv_s": d.recv_s,
                             "post_s": d.post_s, "update_s": d.update_s,
                             "weight": state.weights.get(d.device, 1.0),
                             "speed_factor": state.speed_factors.get(d.device, 1.0)}
    waits = [d.wait_s for d in stats.devices]
    mean_wait = sum(waits) / len(waits) if waits else 0.0
    return {
        "round": stats.round, "first_step": stats.first_step, "steps": stats.steps,
        "step_time_s": stats.step_time_s, "wall_s": stats.wall_s,
        "max_wait_s": max(waits, default=0.0), "mean_wait_s": mean_wait,
        "imbalance": imbalance, "balanced": balanced,
        "plan_changed": plan_changed, "moved_tensors": moved_tensors, "moved_bytes": moved_bytes,
        "stable_rounds": state.stable_rounds, "converged": state.converged, "reason": reason,
        "loss": loss, "devices": devices, "stages": [dict(s) for s in stages],
    }


def round_table(records: Sequence[Mapping[str, Any]], last: int = 12) -> Table:
    """The rich table shown live: one row per round (the latest ``last``), one column pair per device."""
    table = Table(title="plan run rounds (c/w: compute/wait s; w: weight)", box=box.SIMPLE_HEAD, pad_edge=False)
    for column in ("round", "steps", "s/step", "imbal"):
        table.add_column(column, justify="right", no_wrap=True)
    devices = list(records[-1]["devices"]) if records else []
    for device in devices:
        table.add_column(f"{device} c/w", justify="right", no_wrap=True)
        table.add_column("w", justify="right", no_wrap=True)
    table.add_column("plan", justify="left", no_wrap=True)
    for rec in records[-last:]:
        row = [str(rec["round"]), f"{rec['first_step']}+{rec['steps']}", f"{rec['step_time_s']:.3f}",
               f"{rec['imbalance']:.1%}"]
        for device in devices:
            d = rec["devices"].get(device, {})
            row += [f"{d.get('compute_s', 0):.2f}/{d.get('wait_s', 0):.2f}", f"{d.get('weight', 1):.2f}"]
        row.append("changed" if rec["plan_changed"] else ("done" if rec["converged"] else "kept"))
        table.add_row(*row)
    return table


class RoundLog:
    """Rank 0's sink for round records: JSONL file, optional JSON on stdout, optional live table."""

    def __init__(self, path: str | Path | None = None, *, json_stdout: bool = False, live: bool = False,
                 console: Console | None = None) -> None:
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if path is not None:
            try:
                self._file = open(Path(path), "a", encoding="utf-8")
            except OSError as exc:
                raise PlannerError(f"cannot open round log {str(path)!r} for appending ({exc}); choose another --log path") from None
        self._json = json_stdout
        self._live = Live(round_table([]), console=console or Console(stderr=True), auto_refresh=False) if live else None

    def __enter__(self) -> "RoundLog":
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, record: Mapping[str, Any]) -> None:
        line = json.dumps(record, sort_keys=False)
        self.records.append(dict(record))
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        if self._json:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        if self._live is not None:
            self._live.update(round_table(self.records), refresh=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._file is not None:
            self._file.close()
            self._file = None
