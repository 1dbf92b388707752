"""Benchmark of the sync modes (docs/sync.md) the way the multi-step delayed update paper judges them: time to a
target at equal final accuracy, against SSGD and Local SGD.

Pure data parallelism on 2 CPU ranks (``plan partition -d 2``, one stage x 2 replicas, 8 micro-batches), on
two emulated links (``--emulate-link``: 1e8 B/s with 5 ms, and 1e9 B/s with 0.5 ms), with modes ``ssgd``,
``local-sgd`` with H = 4 and 16, and ``adaptive``, each with 3 seeds:

- digits: ``digits_cnn`` on scikit-learn's digits, Adam lr 1e-3, target 95% validation accuracy;
- text: ``gpt_bytes`` on the standard library's source bytes, Adam lr 3e-3, target validation loss 3.0.

Reported per data set, link and mode (medians of the seeds): training time to target (evaluation excluded),
final validation metric, bytes sent, the aggregation time training waited for, and for ``adaptive`` the
share of one blocking all-reduce per step that its overlap hid (``1 - exposed per aggregation / ssgd's
measured all-reduce``, both from this run). Curves by ``plan curves``. Writes docs/bench-sync.md,
docs/bench-sync.json and docs/img/sync-*.{png,svg}; the 1-minute load average is recorded around every run.

    python3 bench/sync.py                       # everything (about 15 minutes)
    python3 bench/sync.py --data digits --seeds 1
    python3 bench/sync.py --render               # the page again from docs/bench-sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _paths import REPO  # first: the repository on sys.path
from learning import LAST, final_gap, final_mean, make_plan, median_of_all, metric_text, plan_cli, train

WORK = REPO / "bench" / ".cache" / "sync"
OUTPUT = REPO / "docs" / "bench-sync.md"
RESULTS = REPO / "docs" / "bench-sync.json"
IMAGES = REPO / "docs" / "img"

DATA = {
    "digits": {"model": "planner.examples.digits:digits_cnn", "data": "planner.data.digits:batches", "steps": 300,
               "lr": 0.001, "target": "accuracy=0.95", "eval_every": 10, "metric": "accuracy"},
    "text": {"model": "planner.examples.gpt:gpt_bytes", "data": "planner.data.text:batches", "steps": 100,
             "lr": 0.003, "target": "loss=3.0", "eval_every": 5, "metric": "loss"},
}
LINKS = {"slow": "1e8,0.005", "fast": "1e9,0.0005"}
MODES = {"ssgd": ["--sync", "ssgd"], "local-sgd H=4": ["--sync", "local-sgd", "--sync-period", "4"],
         "local-sgd H=16": ["--sync", "local-sgd", "--sync-period", "16"], "adaptive": ["--sync", "adaptive"],
         "adaptive, elastic 0.02": ["--sync", "adaptive", "--sync-elastic", "0.02"],
         "adaptive, momentum 0.5": ["--sync", "adaptive", "--sync-momentum", "0.5"],
         "adaptive, 256 KiB chunks": ["--sync", "adaptive", "--sync-chunk-bytes", "262144"]}


def train_mode(tag: str, plan: Path, spec: dict[str, Any], link: str, mode: list[str], seed: int) -> dict[str, Any]:
    """One run of ``plan`` in ``mode`` on the emulated ``link`` (``learning.train``: summary, load, command).

    Rounds are the data set's evaluation interval (``eval_every``): evaluations come at round ends, so a run's time to
    target is read that often. digits takes 300 steps and is read every 10; text reaches its target in 30-40 steps and
    is read every 5 (read every 10, two modes one evaluation apart differed by a quarter of their steps to target).
    The per-round bookkeeping (a barrier, the losses, the rebalancer's broadcast) costs each mode the same few link
    latencies."""
    return train(tag, plan, spec, "--seed", str(seed), "--eval-every", str(spec["eval_every"]), "--target",
                 spec["target"], "--emulate-link", link, *mode, work=WORK, round_steps=spec["eval_every"])


def round_end_cost(name: str, plan: Path, spec: dict[str, Any], link: str, pairs: int = 3) -> float:
    """What one round's end costs training on ``link`` (the round-end exchange, the barrier, the rebalancer's
    decision): 40 steps of local-sgd H=16 in rounds of 5 against rounds of 20, the extra wall time over the 6 extra
    rounds, the median of ``pairs`` such pairs. Every mode pays it once a round."""
    costs = []
    for pair in range(pairs):
        walls = {}
        for rounds_of in (5, 20):
            summary = train(f"{name}-roundend-{rounds_of}-p{pair}", plan, {**spec, "steps": 40}, "--seed", str(pair),
                            "--emulate-link", link, *MODES["local-sgd H=16"], work=WORK, round_steps=rounds_of)
            walls[rounds_of] = summary["wall_s"]
        costs.append((walls[5] - walls[20]) / (40 // 5 - 40 // 20))
    return statistics.median(costs)


def _steps_to_target(run: dict[str, Any]) -> float | None:
    """The step of the first evaluation at the run's time to target (None: not reached)."""
    reached = run["time_to_target_s"]
    return next((float(e["step"]) for e in run["eval"] if reached is not None and e["wall_s"] >= reached - 1e-9), None)


def row(runs: list[dict[str, Any]], metric: str, blocking_s: float | None) -> dict[str, Any]:
    """Medians over the seeds of one data set, link and mode."""
    final = [r["eval"][-1][metric] for r in runs]
    exposed = [r["sync"]["exposed_s"] / max(r["sync"]["aggregations"], 1) for r in runs]
    hidden = None
    if blocking_s and runs[0]["sync"]["mode"] == "adaptive":
        hidden = 1.0 - statistics.median(exposed) / blocking_s
    return {"time_to_target_s": median_of_all([r["time_to_target_s"] for r in runs]),
            "reached": sum(r["time_to_target_s"] is not None for r in runs), "seeds": len(runs),
            "final": statistics.median(final), "final_mean": statistics.median(final_mean(r, metric) for r in runs),
            "bytes_sent": statistics.median(r["bytes_sent"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "exposed_per_step_s": statistics.median(r["sync"]["exposed_s"] / r["steps"] for r in runs),
            "exposed_per_aggregation_s": statistics.median(exposed), "hidden_fraction": hidden,
            "periods": runs[0]["sync"].get("periods", [])[:12], "delays": runs[0]["sync"].get("delays", [])[:12],
            "steps_to_target": median_of_all([_steps_to_target(r) for r in runs]),
            "compute_per_step_s": statistics.median(
                (sum(x["wall_s"] for x in r["rounds"]) - r["sync"]["exposed_s"]) / r["steps"] for r in runs),
            "load": [min(r["load"][0] for r in runs), max(r["load"][1] for r in runs)],
            "command": runs[0]["command"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="*", default=list(DATA), choices=list(DATA))
    parser.add_argument("--links", nargs="*", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--render", action="store_true", help="re-render the page from docs/bench-sync.json only")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    IMAGES.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.render:
        OUTPUT.write_text(render(results))
        return
    began = time.time()
    for name in args.data:
        spec = DATA[name]
        plan = make_plan(name, {**spec, "microbatches": 8}, "-d", "2", work=WORK)
        for link_name in args.links:
            link = LINKS[link_name]
            runs = {mode: [] for mode in MODES}
            for seed in range(args.seeds):
                for mode, flags in MODES.items():  # modes interleaved, so load drift hits them alike
                    tag = f"{name}-{link_name}-{mode.replace(' ', '').replace('=', '')}-s{seed}"
                    print(f"{tag} ...", file=sys.stderr, flush=True)
                    runs[mode].append(train_mode(tag, plan, spec, link, flags, seed))
            print(f"{name}-{link_name} round-end cost ...", file=sys.stderr, flush=True)
            round_end_s = round_end_cost(name, plan, spec, link)
            ssgd = runs["ssgd"]
            blocking = statistics.median(r["sync"]["aggregation_s"] / max(r["sync"]["aggregations"], 1) for r in ssgd)
            results[f"{name}/{link_name}"] = {
                "data": name, "link": link, "metric": spec["metric"], "target": spec["target"],
                "blocking_all_reduce_s": blocking, "round_end_s": round_end_s, "date": time.strftime("%Y-%m-%d"),
                "eval_every": spec["eval_every"],
                "modes": {mode: row(rs, spec["metric"], blocking) for mode, rs in runs.items()}}
            _curves(name, link_name, {mode: rs[0] for mode, rs in runs.items()})
    results["_machine"] = {"cores": os.cpu_count(), "python": platform.python_version(),
                           "minutes": round((time.time() - began) / 60, 1)}
    RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    OUTPUT.write_text(render(results))
    print(f"wrote {OUTPUT.relative_to(REPO)}", file=sys.stderr)


def _curves(name: str, link_name: str, first_seed: dict[str, dict[str, Any]]) -> None:
    """``plan curves`` over the first seed's run of every mode."""
    logs = []
    for mode in first_seed:
        tag = f"{name}-{link_name}-{mode.replace(' ', '').replace('=', '')}-s0"
        logs.append(str(WORK / f"{tag}.json"))
    plan_cli("curves", *logs, "-o", str(IMAGES / f"sync-{name}-{link_name}.png"), work=WORK)


def _better_fixed(modes: dict[str, Any]) -> str:
    """The fixed-interval mode that reached the target sooner (``local-sgd H=4`` when neither did)."""
    fixed = [m for m in ("local-sgd H=4", "local-sgd H=16") if m in modes and modes[m]["time_to_target_s"]]
    return min(fixed, key=lambda m: modes[m]["time_to_target_s"]) if fixed else "local-sgd H=4"


def _equal_steps_ceiling(row: dict[str, Any]) -> float | None:
    """How much sooner than ``row``'s mode any mode could reach the target in as many steps: its time to target over
    that time less the aggregation time it waited for per step (measured) x its steps to target."""
    reached, steps = row.get("time_to_target_s"), row.get("steps_to_target")
    if not reached or not steps:
        return None
    return reached / (reached - row["exposed_per_step_s"] * steps)


def _round_end(entry: dict[str, Any]) -> str:
    """The section's measured round-end cost, where it was measured (``round_end_cost``)."""
    if "round_end_s" not in entry:
        return " Round-end cost not measured (the run predates it)."
    return (f" A round's end costs training {entry['round_end_s'] * 1e3:.1f} ms on this link, in every mode (40 steps "
            f"of local-sgd H=16 in rounds of 5 against rounds of 20, the median of 3 pairs).")


def _fmt_s(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.2f}"


def render(results: dict[str, Any]) -> str:
    lines = ["# Sync modes: time to target on 2 CPU ranks", "",
             "<!-- generated by bench/sync.py; do not edit by hand -->", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; 2 gloo ranks of "
             "pure data parallelism (1 stage x 2 replicas, 8 micro-batches), one intra-op thread each. Links emulated "
             "with `--emulate-link` (loopback is faster than any real link). Load: the 1-minute load average before "
             "the first and after the last run of each row (2.0 = both cores busy). Medians of the seeds. "
             "Reproduce: `python3 bench/sync.py` (modes and seeds interleaved).", "",
             "Columns: *to target*: training seconds (evaluation excluded) to the first evaluation that reaches the "
             "target (evaluations come at round ends, every *N* steps as each section says); *vs ssgd*: ssgd's time "
             "over the mode's; *final*: the last evaluation's "
             f"metric; *mean of last {LAST}*: the mean of the last {LAST} evaluations (one evaluation of digits' 288 "
             "held-out samples moves by 1-2 points between neighbours of the same run); *waited per step*: "
             "aggregation time training waited for, per step; *hidden*: for adaptive, "
             "1 - its waited time per aggregation / ssgd's measured blocking all-reduce; *periods*: the first "
             "intervals of seed 0, and after *landed after* the steps each of those aggregations travelled under "
             "before it landed (fewer than the delay then in force: an evaluation landed it early).", ""]
    for key in sorted(k for k in results if not k.startswith("_")):
        entry = results[key]
        modes = entry["modes"]
        base = modes["ssgd"]["time_to_target_s"]
        lines += [f"## {entry['data']}, link {entry['link']} (B/s, s): target {entry['target']}", "",
                  f"Measured {entry['date']}, evaluated every {entry.get('eval_every', 10)} steps. ssgd's blocking "
                  f"all-reduce: {entry['blocking_all_reduce_s'] * 1e3:.1f} ms.{_round_end(entry)}", "",
                  "| mode | to target (s) | vs ssgd | reached | final " + entry["metric"] + f" | mean of last {LAST} | "
                  "bytes sent | waited per step | hidden | periods | load |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for mode in [m for m in MODES if m in modes]:
            r = modes[mode]
            ratio = f"{base / r['time_to_target_s']:.2f}x" if base and r["time_to_target_s"] else "-"
            final, smoothed = (metric_text(entry["metric"], r.get(k)) for k in ("final", "final_mean"))
            hidden = f"{r['hidden_fraction']:.0%}" if r["hidden_fraction"] is not None else "-"
            periods = ", ".join(str(p) for p in r["periods"]) if mode == "adaptive" else "-"
            if mode == "adaptive" and r.get("delays"):
                periods += "; landed after " + ", ".join(str(d) for d in r["delays"])
            lines.append(f"| {mode} | {_fmt_s(r['time_to_target_s'])} | {ratio} | {r['reached']}/{r['seeds']} | "
                         f"{final} | {smoothed} | {r['bytes_sent'] / 1e6:.1f} MB | "
                         f"{r['exposed_per_step_s'] * 1e3:.2f} ms | {hidden} | {periods} | "
                         f"{r['load'][0]:.2f} / {r['load'][1]:.2f} |")
        best_fixed = min((modes[m]["time_to_target_s"] for m in ("local-sgd H=4", "local-sgd H=16")
                          if modes[m]["time_to_target_s"]), default=None)
        adaptive = modes["adaptive"]["time_to_target_s"]
        if adaptive and best_fixed:
            lines += ["", f"adaptive against the better fixed interval: {best_fixed / adaptive:.2f}x."]
        ours, theirs = modes["adaptive"].get("final_mean"), modes["ssgd"].get("final_mean")
        if ours is not None and theirs is not None:
            target = "within 0.5 points" if entry["metric"] == "accuracy" else "within 2%"
            lines += ["", f"adaptive's final {entry['metric']} (mean of the last {LAST} evaluations) against ssgd's: "
                          f"{final_gap(entry['metric'], ours, theirs)} (target: {target})."]
        fixed = _better_fixed(modes)
        for name, what in (("ssgd", "ssgd"), (fixed, f"the better fixed interval ({fixed})")):
            ceiling = _equal_steps_ceiling(modes.get(name) or {})
            if ceiling:
                lines += ["", f"At the {modes[name]['steps_to_target']:.0f} steps {what} needed, a mode that "
                              f"waited for none of its aggregations would reach the target at most {ceiling:.2f}x "
                              f"sooner than it (its time to target less its measured wait per step x those steps); "
                              f"more needs fewer steps."]
        steps = [m["steps_to_target"] for m in modes.values() if m.get("steps_to_target")]
        if steps and best_fixed:
            compute = min(m["compute_per_step_s"] for m in modes.values())
            bound = min(steps) * compute
            lines += ["", f"No interval rule can beat the fewest steps any mode needed ({min(steps):.0f}) at the least "
                          f"compute per step any mode measured ({compute * 1e3:.1f} ms, no waiting): {bound:.2f} s, "
                          f"so at most {best_fixed / bound:.2f}x sooner than the better fixed interval."]
        lines += ["", f"Command (seed 0): `{modes['adaptive']['command']}`", "",
                  f"![{key}](img/sync-{entry['data']}-{key.split('/')[1]}.png)", ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
