"""The live table of ``plan run --live``: one row per round (compute/wait and weight per device).

The runtime's round log (``planner.runtime.rebalancing.roundlog``) feeds it on rank 0.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from rich import box
from rich.console import Console
from rich.live import Live
from rich.table import Table

__all__ = ["round_table", "LiveRounds"]


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


class LiveRounds:
    """A rich ``Live`` table on stderr that redraws after every round and ends with a newline, so that
    whatever is printed next starts on a line of its own."""

    def __init__(self, console: Console | None = None) -> None:
        self._console = console or Console(stderr=True)
        self._live = Live(round_table([]), console=self._console, auto_refresh=False)

    def start(self) -> None:
        self._live.start()

    def update(self, records: Sequence[Mapping[str, Any]]) -> None:
        self._live.update(round_table(records), refresh=True)

    def stop(self) -> None:
        self._live.stop()
        self._console.file.write("\n")
        self._console.file.flush()
