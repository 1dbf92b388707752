"""What the lent GPU measured, against what the planner predicts: writes docs/bench-gpu.md.

The numbers come from a device run of ``scripts/gpu_check.sh`` (one H200), kept in the repository: the example
models' profiles under ``profiles/h200/`` and, per model trained with ``plan train`` on one GPU over nccl, its
profile, plan, summary and round log under ``bench/gpu-runs/<run>/``. This script re-plans each trained model
from its own profile with this checkout's cost model (a replay: no GPU is needed) and sets the prediction beside
the measured step, so a change to the cost model shows here as a changed ratio.

    python3 bench/gpu.py                       # writes docs/bench-gpu.md
    python3 bench/gpu.py --output /tmp/gpu.md
    python3 bench/gpu.py --check               # exit 1 when docs/bench-gpu.md is stale (a test runs this)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Mapping

from _paths import REPO  # first: the repository on sys.path, bench/ last (see bench/_paths.py)

from planner.formats.catalog import DeviceSpec, load_catalog  # noqa: E402
from planner.formats.cluster import Cluster, load_cluster  # noqa: E402
from planner.formats.profile import Profile, load_profile  # noqa: E402
from planner.partition import partition  # noqa: E402
from planner.partition.model.times import calibration_factors  # noqa: E402
from planner.partition.search.settings import rescaled, time_growth  # noqa: E402
from planner.roofline import estimate_node_time  # noqa: E402

RUNS = REPO / "bench" / "gpu-runs"
PROFILES = REPO / "profiles" / "h200"
PAGE = REPO / "docs" / "bench-gpu.md"


def replay(profile: Profile, plan: dict, cluster: Cluster, catalog: Mapping[str, DeviceSpec]) -> float:
    """The step time this checkout's planner predicts for ``plan``'s settings, from ``profile``."""
    source = rescaled(profile, int(plan["microbatch_size"]), catalog) if plan.get("microbatch_size") else profile
    again = partition(source, cluster, method=plan["method"], microbatches=plan["microbatches"],
                      schedule=plan["schedule"], optimizer=plan.get("optimizer", "adam"))
    return again.step_time_s


def in_proportion(profile: Profile) -> Profile:
    """``profile`` without its doubled micro-batch: times rescale in proportion to the rows, as before it."""
    whole = {k: v for k, v in profile.extra["whole_model"].items() if k != "rows_scaling"}
    return dataclasses.replace(profile, extra={**profile.extra, "whole_model": whole})


def trained_rows(run: Path, catalog: Mapping[str, DeviceSpec]) -> list[dict]:
    cluster = load_cluster(run / "cluster-1.json")
    rows = []
    for model in sorted(p for p in run.iterdir() if p.is_dir()):
        plan = json.loads((model / "plan.json").read_text())
        summary = json.loads((model / "summary.json").read_text())["run"]
        profile = load_profile(model / "profile.json")
        measured = summary["step_time_s"]
        rows.append({
            "model": model.name, "rows": plan["microbatch_size"], "m": plan["microbatches"], "measured": measured,
            "proportion": replay(in_proportion(profile), plan, cluster, catalog),
            "now": replay(profile, plan, cluster, catalog),
            "at_run": plan["predicted"]["step_time_s"],
            "calibrated": (summary.get("calibration") or {}).get("calibrated_step_time_s"),
            "growth": time_growth(profile, plan["microbatch_size"] / profile.model["microbatch_size"], catalog),
            "wait": wait_share(model / "rounds.jsonl"),
        })
    return rows


def wait_share(rounds: Path) -> float:
    """The share of the rounds after the first that the one rank logged as wait, less its optimizer step (which the
    log counts in the wait): with nothing to wait for, the device's time that the host clock missed."""
    later = [json.loads(line) for line in rounds.read_text().splitlines()[1:] if line.strip()]
    ranks = [next(iter(r["devices"].values())) for r in later]
    return sum(d["wait_s"] - d["update_s"] for d in ranks) / sum(r["wall_s"] for r in later)


def profile_rows(catalog: Mapping[str, DeviceSpec]) -> list[dict]:
    rows = []
    for path in sorted(PROFILES.glob("*.json")):
        profile = load_profile(path)
        whole = profile.extra["whole_model"]
        scaling = whole.get("rows_scaling") or {}
        roofline = sum(t.fwd + t.bwd for t in (estimate_node_time(n, "h200", catalog) for n in profile.nodes))
        rows.append({
            "model": path.stem, "rows": profile.model["microbatch_size"], "ops": len(profile.nodes),
            "train": whole["train_s"], "twice": (scaling.get("train_s") or [None, None])[1],
            "fixed": scaling.get("fixed_fraction"),
            "sum_ops": whole["sum_ops_fwd_s"] + whole["sum_ops_bwd_s"],
            "calibration": calibration_factors(profile).get("h200"), "roofline": roofline,
        })
    return rows


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


def vs(predicted: float | None, measured: float) -> str:
    return "-" if predicted is None else f"{ms(predicted)} ({predicted / measured - 1:+.0%})"


def render(run: Path) -> str:
    log = (run / "log.txt").read_text()
    gpu = next((line for line in log.splitlines() if line.startswith("GPU 0:")), "GPU: unknown")
    versions = next((line for line in log.splitlines() if line.startswith("torch ")), "")
    catalog = load_catalog()
    trained = trained_rows(run, catalog)
    profiles = profile_rows(catalog)
    low = min(r["roofline"] / r["train"] for r in profiles)
    high = max(r["roofline"] / r["train"] for r in profiles)
    twice = [(r["model"], r["calibration"], calibration_factors(load_profile(path)).get("h200"))
             for r in profiles if (path := run / r["model"] / "profile.json").exists()]
    again = "; ".join(f"{m} {a:.2f} and {b:.2f}" for m, a, b in twice if a and b) + (
        " (the calibration factor here, then in the profile `plan train` took minutes later on the same machine)")
    lines = [
        "# The lent GPU: measured steps against the planner's predictions",
        "",
        "<!-- generated by bench/gpu.py; do not edit by hand -->",
        "",
        f"Measured by `bash scripts/gpu_check.sh` on a lent machine ({re.sub(r'^GPU 0: | [(]UUID.*', '', gpu)}; "
        f"{versions}; 16 host cores, lent to this session alone; load not recorded) on {run.name.split('-', 1)[1]}; "
        "replayed here by `python3 bench/gpu.py` with this checkout's cost model (no GPU needed). The run's files are "
        "under "
        f"`bench/gpu-runs/{run.name}/`, the example models' profiles under `profiles/h200/`.",
        "",
        "## `plan train` on one GPU (nccl, world size 1, 40 steps)",
        "",
        "Each model was profiled and planned by `plan train MODEL --cluster cluster-1.json --steps 40 "
        "--no-rebalance` (one H200; *rows x m*: the micro-batch size and count the strategy search chose). "
        "*Measured*: the "
        "mean step of the rounds after the first. *In proportion*: the plan's step re-predicted with times "
        "rescaled in proportion to the rows, as before the profile timed a micro-batch of twice the rows. *Now*: "
        "re-predicted by this checkout (`partition.search.settings.time_growth`: the fixed share measured by "
        "doubling the rows, or the roofline's work if that is more). *At the run*: what the plan said when it "
        "ran (a rule since replaced: a fixed share capped at 0.95, no GPU calibration range). *Calibrated*: the "
        "run's own prediction calibrated on its measured compute (docs/run.md). *Wait*: the share of the step the "
        "one rank logged as waiting, less its optimizer step, with nothing to wait for: the device's time that the "
        "host clock missed in the "
        "passes, which also made the calibration read the compute short (the run's clock now waits for the "
        "device, `runtime.timing.device_clock`; not yet run on a GPU).",
        "",
        "| model | rows x m | measured | in proportion | now | growth | at the run | calibrated | wait |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in trained:
        lines.append(f"| {r['model']} | {r['rows']} x {r['m']} | {ms(r['measured'])} | "
                     f"{vs(r['proportion'], r['measured'])} | {vs(r['now'], r['measured'])} | {r['growth']:.2f}x | "
                     f"{vs(r['at_run'], r['measured'])} | {vs(r['calibrated'], r['measured'])} | {r['wait']:.0%} |")
    lines += [
        "",
        "*growth*: how many times the profiled micro-batch's time the planner charges at the plan's rows. These",
        "models are small for an H200: a micro-batch costs what the host takes to issue its kernels, whatever its",
        "rows, so a rescale in proportion to the rows multiplies a time that does not grow.",
        "",
        "## The profiles (`profiles/h200/`)",
        "",
        "*train*: one training micro-batch of the profiled rows; *2x rows*: the same with twice the rows; *fixed*: "
        "the share of *train* that did not grow (`whole_model.rows_scaling`). *sum of ops / train*: the ops timed "
        "alone with CUDA events, each paying its launch and a synchronisation, over the whole micro-batch, whose "
        "host issues kernels while earlier ones run; its inverse is the calibration factor (applied between 0.2 "
        "and 2 for GPU profiles, docs/cost-model.md). Timings this small move from one profile to the next: "
        f"{again}. *roofline / train*: the catalog's estimate of the same graph on an H200, summed over the ops, "
        "over the measured micro-batch: what `--estimate h200` from a CPU profile would have planned with. It "
        f"has no host in it, so it puts these small models at {low:.0%}-{high:.0%} of what they take.",
        "",
        "| model | rows | ops | train | 2x rows | fixed | sum of ops / train | calibration | roofline / train |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in profiles:
        fixed = "-" if r["fixed"] is None else f"{r['fixed']:.2f}"
        calibration = "not applied" if r["calibration"] is None else f"{r['calibration']:.2f}"
        lines.append(f"| {r['model']} | {r['rows']} | {r['ops']} | {ms(r['train'])} | {ms(r['twice'])} | {fixed} | "
                     f"{r['sum_ops'] / r['train']:.2f} | {calibration} | {r['roofline'] / r['train']:.2f} |")
    said = re.split(r"(?=rank \d: )", "\n".join(line for line in log.splitlines()
                                                  if line.startswith(("error:", "rank 0:", "rank 1:"))))
    guard = [line.strip() for line in said if line.strip()]
    lines += [
        "",
        "## Two ranks on one GPU",
        "",
        "NCCL refuses two ranks on one device, so `plan run` refuses such a plan before any rank starts. From the",
        "same device run (a 1-stage, 2-replica plan on a cluster of two devices on the one GPU, then two bare",
        "NCCL ranks on `cuda:0`):",
        "",
        "```",
        *guard,
        "```",
        "",
        "Multi-rank nccl paths (pipelines, replicas, the parameter server and the asynchronous engine across",
        "GPUs) need a machine with two GPUs or more; the lent machine had one.",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default=None, help="folder under bench/gpu-runs (default: the newest)")
    parser.add_argument("--output", default=str(PAGE))
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from a fresh replay")
    args = parser.parse_args()
    run = RUNS / args.run if args.run else sorted(p for p in RUNS.iterdir() if p.is_dir())[-1]
    text = render(run)
    if args.check:
        if Path(args.output).read_text() != text:
            print(f"error: {args.output} is not what this checkout's cost model predicts for the GPU runs; run "
                  f"python3 bench/gpu.py and commit the page", file=sys.stderr)
            return 1
        print(f"bench/gpu.py: {args.output} is current")
        return 0
    Path(args.output).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
