"""docs/methods.md's status table says what the code implements (issue 22, point 5).

The bug this catches: a page that lists a method as "not implemented yet" after it landed (replicated stages
did for a release), or as implemented before it has. Each row is tied to what the code exposes for it: a
placer in the registry, a schedule the runtime runs, a sync mode the data-parallel layer has.
"""

from __future__ import annotations

from pathlib import Path

from planner.formats.plan import SCHEDULES
from planner.partition.placers.registry import BUILTIN
from planner.runtime.data_parallel import SYNC_MODES

ROOT = Path(__file__).resolve().parent.parent

IMPLEMENTED_WHEN = {
    "cost model, greedy placement, rebalancing loop": "greedy" in BUILTIN,
    "exact placement (DP, ILP), topology-aware mapping": {"dp", "ilp"} <= set(BUILTIN),
    "GPipe, 1F1B, interleaved 1F1B schedules": {"gpipe", "1f1b", "interleaved-1f1b"} <= set(SCHEDULES),
    "the peers' baselines": {"uniform", "params", "time-balance"} <= set(BUILTIN),
    "replicated stages (pipeline x data parallel)": "ssgd" in SYNC_MODES,
    "adaptive local SGD (multi-step delayed updates)": "adaptive" in SYNC_MODES,
    "DASP parameter server": "dasp" in SYNC_MODES,
    "asynchronous pipeline across iterations": "async-1f1b" in SCHEDULES,
    "zero-bubble schedules (ZB-H1, ZB-H2, a planned order)": {"zb-h1", "zb-h2", "zb-planned"} <= set(SCHEDULES),
    "V-shaped zero-bubble schedule ZB-V": "zbv" in SCHEDULES,
    "DualPipeV": "dualpipev" in SCHEDULES,
}


def _status_rows() -> dict[str, str]:
    rows = {}
    for line in (ROOT / "docs" / "methods.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("method", "---"):
            rows[cells[0]] = cells[1]
    return rows


def test_every_method_row_matches_the_code() -> None:
    rows = _status_rows()
    assert set(rows) == set(IMPLEMENTED_WHEN), "docs/methods.md rows changed: tie each new row to the code here"
    for method, implemented in IMPLEMENTED_WHEN.items():
        says = rows[method].startswith("implemented")
        assert says == implemented, (f"docs/methods.md says {method!r} is {rows[method]!r}, but the code "
                                     f"{'has' if implemented else 'does not have'} it")
