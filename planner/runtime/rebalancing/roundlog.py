"""One JSON line per round (a file and, with ``--json``, stdout) and the live table on rank 0 (``report.rounds``).

A record holds the round's steps, step time, balance, each device's compute, wait, weight and speed
factor, and whether the plan changed (with what moved). Only rank 0 writes; the file is opened in
append mode so that a job restarted by torchrun continues the same log.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from planner.errors import PlannerError
from planner.report.rounds import LiveRounds
from planner.partition.search.rebalance import RebalanceState, RoundStats

__all__ = ["round_record", "RoundLog"]


def round_record(stats: RoundStats, state: RebalanceState, *, imbalance: float, balanced: bool, plan_changed: bool,
                 reason: str, loss: float | None = None, moved_tensors: int = 0, moved_bytes: int = 0,
                 stages: Sequence[Mapping[str, Any]] = (), held: Sequence[Any] | None = None) -> dict[str, Any]:
    """The JSON-ready record of one round (after its decision and re-plan); ``held``: what the speed fit took from
    the round (``Held.to_list`` per device), None when it took nothing."""
    devices = {}
    for d in stats.devices:
        devices[d.device] = {"compute_s": d.compute_s, "wait_s": d.wait_s, "recv_s": d.recv_s,
                             "post_s": d.post_s, "update_s": d.update_s, "emulated_s": d.emulated_s,
                             "compute_cpu_s": d.compute_cpu_s, "probe_s": d.probe_s,
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
        "cost_corrections": [list(c) for c in state.corrections],
        "held": list(held) if held is not None else None,
    }


class RoundLog:
    """Rank 0's sink for round records: JSONL file, optional JSON on stdout, optional live table."""

    def __init__(self, path: str | Path | None = None, *, json_stdout: bool = False, live: bool = False) -> None:
        self.records: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if path is not None:
            try:
                self._file = open(Path(path), "a", encoding="utf-8")
            except OSError as exc:
                raise PlannerError(f"cannot open round log {str(path)!r} for appending ({exc}); choose another --log path") from None
        self._json = json_stdout
        self._live = LiveRounds() if live else None

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
            self._live.update([r for r in self.records if "round" in r])

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self._file is not None:
            self._file.close()
            self._file = None
