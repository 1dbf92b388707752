"""Turn the round logs of a rebalancing bench into a speed-fit trace for ``tests/test_speed.py``.

``bench/run.py --only rebalance`` writes each run's round log to
``bench/.cache/run/rounds-rb-MODEL-F-RUN-dynamic.jsonl``; every judged round there records what the speed fit took
from it (``held``, docs/rebalancing.md). A trace holds, per run, those rounds in order, and per model the cost model's
seconds for one run of each profile node on the bench's cluster (``node_s``: ``RoundModel.predict_s`` node by node),
so that a test replays the fit as the run did (its final ratio is the run's, exactly: checked on the trace of
2026-11-29) and compares that ratio with the emulated slowdown.

Usage: python scripts/speed_trace.py [CACHE_DIR] -o tests/golden/traces/rebalance-DAY.json --source "..."
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from run import CACHE, CLUSTER  # noqa: E402  (bench/run.py: where it keeps its round logs, the cluster it runs)
from planner.formats.catalog import load_catalog  # noqa: E402
from planner.formats.cluster import load_cluster  # noqa: E402
from planner.formats.plan import load_plan  # noqa: E402
from planner.formats.profile import load_profile  # noqa: E402
from planner.runtime.rebalancing.replan import RoundModel  # noqa: E402

LOG = re.compile(r"rounds-rb-(?P<model>.+)-(?P<slowdown>[0-9.]+)-(?P<run>[0-9]+)-dynamic\.jsonl$")


def node_seconds(cache: Path, model: str) -> list[float]:
    """The cost model's seconds for one run of each profile node on the bench's cluster (its static plan's model)."""
    profile = load_profile(cache / f"{model}.profile.json")
    plan = load_plan(cache / f"{model}.mb8.plan.json")
    cluster = load_cluster(CLUSTER)
    rounds = RoundModel.build(profile, cluster, plan, catalog=load_catalog())
    device = plan.stages[0].device
    return [rounds.predict_s(device, i, i + 1) for i in range(len(profile.nodes))]


def trace(cache: Path, source: str) -> dict:
    runs, node_s = [], {}
    for path in sorted(cache.glob("rounds-rb-*-dynamic.jsonl")):
        match = LOG.search(path.name)
        if match is None:
            continue
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        held = [r["held"] for r in records if "round" in r and r.get("held")]
        if not held:
            raise SystemExit(f"{path}: no round records what the speed fit took (held); re-run the bench with a "
                             f"planner whose round log has the field")
        model = match["model"]
        if model not in node_s:
            node_s[model] = node_seconds(cache, model)
        runs.append({"model": model, "slowdown": float(match["slowdown"]), "run": int(match["run"]), "rounds": held})
    if not runs:
        raise SystemExit(f"no rebalancing round logs (rounds-rb-*-dynamic.jsonl) in {cache}")
    return {"source": source, "node_s": node_s, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache", nargs="?", default=str(CACHE))
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--source", required=True, help="Which bench run, when, and on what: kept in the trace.")
    args = parser.parse_args()
    Path(args.output).write_text(json.dumps(trace(Path(args.cache), args.source)) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
