"""Hybrid plans (pipeline x data parallel): our shape search against the shapes people pick, simulated; and data
parallel against a pipeline on 2 CPU ranks, measured.

Simulated, for every bundled model below on every cluster below at 8 and 32 micro-batches (1F1B, Adam, op
granularity for ours), the simulated step time of

- **pipeline**: the best pure pipeline (``dp``, ``--data-parallel 1``);
- **data**: pure data parallelism, every replica the whole model on one device, ``d = min(devices, m)``
  (``--data-parallel d`` with one device per pipeline), or "does not fit";
- **uniform 2-D**: the split people make by hand: equal layers per stage (``uniform`` at ``--granularity layer``)
  with ``d = devices / stages`` replicas, even shares; the best over every such ``d`` (generous to it);
- **ours**: ``--data-parallel auto`` with ``dp``;
- **whole strategy**: ``plan train``'s search at the row's micro-batch count (``--schedule auto``, the zero-bubble
  and asynchronous schedules included, ``--recompute auto``, ``--data-parallel auto``, ``--refine``, its default
  placer and rounds: ``planner.app.train.choose_strategy`` with ``--sync ssgd``, so without its sync-mode rule,
  for a run of ``LONG_RUN`` steps, beyond an asynchronous schedule's synchronous warm-up), beside today's auto;

each with its ratio to the LP lower bound (total work over total capacity: no bubble, no transfers, no sync;
``bench/partition.py``), whether it fits in memory (the fullest device's peak over its capacity), and ours'
planning time. Then a memory-tight case: ``gpt_medium`` on ``dgx-h100-8`` with each device's memory cut to 60%
of what the whole model needs, where pure data parallelism cannot fit.

Measured on 2 CPU ranks (gloo, one thread each), for gpt_small and resnet_small: the plan on ``cpu-2`` with
``--data-parallel 2`` (data parallel) and ``--data-parallel 1`` (a 2-stage pipeline), each run with ``plan run``
(rebalancing off), measured step time against the plan's prediction, planned from a profile taken when the
model's runs begin (bench/run.py's colocated one-thread profile). Hybrid shapes (2 x 2) need 4 ranks; on
these 2 cores they are tested for correctness (tests/test_hybrid_runtime.py), not timed.

    python3 bench/hybrid.py                       # everything; writes docs/bench-hybrid.md
    python3 bench/hybrid.py --skip-measured --models gpt_small --output /tmp/h.md

Profiles: ``bench/.cache/NAME.json`` (shared with bench/suite.py and bench/partition.py; measured with roofline
estimates for every bundled cluster's device types if absent) for the simulated part, and
``bench/.cache/run/NAME.profile.json`` (one thread, co-located; bench/run.py) for the measured part.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from _paths import REPO  # first: the repository on sys.path, bench/ last (see bench/_paths.py)

from planner.app.train import ProfileUse, TrainRequest, choose_strategy  # noqa: E402
from planner.clusters import load_cluster_spec  # noqa: E402
from planner.errors import PlannerError  # noqa: E402
from planner.formats.catalog import load_catalog  # noqa: E402
from planner.formats.cluster import Cluster  # noqa: E402
from planner.formats.plan import ASYNC_SCHEDULES, Plan  # noqa: E402
from planner.formats.profile import Profile  # noqa: E402
from planner.partition import partition  # noqa: E402
from planner.partition.model.problem import build_problem  # noqa: E402
from planner.partition.model.tables import OPTIMIZER_STATES  # noqa: E402

MODELS = ("gpt_tiny", "gpt_small", "gpt_medium", "resnet_small", "unet_small", "gpt2_small", "bert_small")
CLUSTERS = ("dgx-h100-8", "a100-2x8-ib", "mixed-3type-2host", "t4-4-pcie")
MICROBATCHES = (8, 32)
TRAIN = TrainRequest.__dataclass_fields__
"""``plan train``'s defaults (placer, recomputation, rounds): the whole-strategy column searches as it does."""
MIXED = "mixed-3type-2host"
SCHEDULE, OPTIMIZER = "1f1b", "adam"
MEASURED = ("gpt_small", "resnet_small")
MEASURED_STEPS, ROUND_STEPS = 24, 4
OUTPUT = REPO / "docs" / "bench-hybrid.md"

suite = importlib.import_module("suite")  # bench/suite.py: the cached profiles
placer_bench = importlib.import_module("partition")  # bench/partition.py: the LP lower bound


# --- simulated ---------------------------------------------------------------------------------------

def fit_ratio(plan: Plan) -> float:
    """The fullest device's predicted peak memory over its capacity."""
    capacity = {d["id"]: d["memory_bytes"] for d in plan.extra["cluster"]["devices"]}
    return max(v["peak_memory_bytes"] / capacity[d] for d, v in plan.predicted["devices"].items())


def attempt(profile: Profile, cluster: Cluster, m: int, **kwargs: Any) -> tuple[Plan | None, float]:
    """The plan (``None`` when nothing fits) and the planning wall time."""
    start = time.perf_counter()
    try:
        plan = partition(profile, cluster, microbatches=m, schedule=SCHEDULE, optimizer=OPTIMIZER,
                         catalog=load_catalog(), **kwargs)
    except PlannerError:
        plan = None
    return plan, time.perf_counter() - start


def uniform_2d(profile: Profile, cluster: Cluster, m: int) -> Plan | None:
    """The best hand-made 2-D split: equal layers per stage, d = devices / stages replicas (d >= 2, 2 stages or more)."""
    best = None
    n = len(cluster.devices)
    for d in range(2, n // 2 + 1):
        if n % d or d > m:
            continue
        plan, _ = attempt(profile, cluster, m, method="uniform", granularity="layer", data_parallel=d)
        if plan is not None and len(plan.stages) >= 2 and (best is None or plan.step_time_s < best.step_time_s):
            best = plan
    return best


LONG_RUN = 1000
"""``--steps`` of the whole strategy's search: a run that outlasts an asynchronous schedule's synchronous warm-up, so
its candidates are priced for the rounds it drains at (a run within the warm-up drains every step)."""


def whole_strategy(name: str, profile: Profile, cluster_name: str, m: int) -> tuple[Plan | None, float]:
    """``plan train``'s search (``choose_strategy``, its defaults, ``--sync ssgd``, ``--steps LONG_RUN``) at ``m``
    micro-batches, and its wall time."""
    start = time.perf_counter()
    path = suite.CACHE / f"{name}.json"  # suite.cached_profile wrote it
    try:
        plan = choose_strategy(ProfileUse(path, profile, True, path, 0.0),
                               TrainRequest(model=name, cluster=cluster_name, microbatches=str(m), sync="ssgd",
                                            steps=LONG_RUN)).plan
    except PlannerError:
        plan = None
    return plan, time.perf_counter() - start


def simulated_case(name: str, profile: Profile, cluster_name: str, m: int, cluster: Cluster | None = None) -> dict[str, Any]:
    named = cluster is None  # a bundled cluster: plan train's search can take it by name
    cluster = cluster or load_cluster_spec(cluster_name)
    lower = placer_bench.lower_bound_s(build_problem(profile, cluster, microbatches=m, schedule=SCHEDULE,
                                                     optimizer=OPTIMIZER, catalog=load_catalog()))
    pipeline, _ = attempt(profile, cluster, m, method="dp", data_parallel=1)
    data, _ = attempt(profile, cluster, m, method="dp", data_parallel=min(len(cluster.devices), m))
    if data is not None and len(data.stages) != 1:
        data = None  # more devices than micro-batches: a replica took 2 devices, which is not pure data parallel
    ours, planning_s = attempt(profile, cluster, m, method="dp", data_parallel="auto")
    whole, whole_s = whole_strategy(name, profile, cluster_name, m) if named else (None, 0.0)
    row = {"model": name, "cluster": cluster_name, "m": m, "lower_s": lower, "planning_s": planning_s,
           "whole_planning_s": whole_s if named else None}
    for key, plan in (("pipeline", pipeline), ("data", data), ("uniform2d", uniform_2d(profile, cluster, m)),
                      ("ours", ours), ("whole", whole)):
        row[key] = None if plan is None else {
            "step_s": plan.step_time_s, "fit": fit_ratio(plan), "stages": len(plan.stages),
            "degree": len(plan.replicas()[0]), "shares": list(plan.shares() or [plan.microbatches]),
            "schedule": plan.schedule, "recompute": sum(plan.recomputed())}
    return row


def memory_tight(profile: Profile) -> dict[str, Any]:
    """``dgx-h100-8`` with each GPU's memory cut to 60% of what the whole model needs (weights, gradients, Adam state
    and one micro-batch of activations): pure data parallelism cannot fit."""
    base = load_cluster_spec("dgx-h100-8")
    static = sum(n.param_bytes for n in profile.nodes) * (2 + OPTIMIZER_STATES[OPTIMIZER])
    need = static + sum(n.saved_bytes for n in profile.nodes)
    devices = tuple(replace(d, memory_bytes=int(0.6 * need)) for d in base.devices)
    cluster = replace(base, name="dgx-h100-8 at 60% memory", devices=devices)
    return simulated_case("gpt_medium", profile, cluster.name, 8, cluster)


# --- measured -------------------------------------------------------------------------------------------

def measured_case(name: str) -> dict[str, Any]:
    from planner.app.partition import profile_ref
    from planner.formats.cluster import load_cluster
    from planner.formats.plan import save_plan
    from planner.formats.profile import load_profile

    runbench = importlib.import_module("run")  # bench/run.py: profiles, launching, steady step times
    path = runbench.profile_path(name, True)  # the predictions are judged: profile the machine as it is now
    cluster = load_cluster(runbench.CLUSTER)
    out: dict[str, Any] = {"model": name}
    for label, degree in (("data", 2), ("pipeline", 1)):
        plan = partition(load_profile(path), cluster, method="dp", microbatches=8, schedule=SCHEDULE,
                         optimizer=OPTIMIZER, data_parallel=degree, profile_ref=profile_ref(path, name))
        plan_path = runbench.CACHE / f"{name}.hybrid-{label}.plan.json"
        save_plan(plan, plan_path)
        job = runbench.run_job(plan_path, suite.MODELS[name], MEASURED_STEPS, ROUND_STEPS, {"rebalance": False},
                               tag=f"hybrid-{label}-{name}")
        out[label] = {"predicted_s": plan.step_time_s, "measured_s": runbench.steady_step_s(job["rounds"]),
                      "stages": len(plan.stages), "degree": len(plan.replicas()[0]),
                      "load": (job["load_before"], job["load_after"])}
    return out


# --- report ---------------------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def cell(entry: dict[str, Any] | None, lower: float) -> str:
    if entry is None:
        return "does not fit"
    shape = f"{entry['stages']}x{entry['degree']}"
    if entry["schedule"] != SCHEDULE:  # the whole strategy's: say what it chose
        shape += f", {entry['schedule']}" + (f", {entry['recompute']} recomputing" if entry["recompute"] else "")
    return f"{ms(entry['step_s'])} ({entry['step_s'] / lower:.2f}x LB, {shape}, mem {entry['fit']:.1%})"


def whole_gain(row: dict[str, Any]) -> float:
    """Today's auto over the whole strategy's step (> 1: the whole strategy is faster); nan where either is missing."""
    return row["ours"]["step_s"] / row["whole"]["step_s"] if row["ours"] and row.get("whole") else float("nan")


def best_baseline(row: dict[str, Any]) -> float:
    return min(row[k]["step_s"] for k in ("pipeline", "data", "uniform2d") if row[k] is not None)


def render(rows: list[dict[str, Any]], tight: dict[str, Any] | None, measured: list[dict[str, Any]],
           command: str, elapsed_s: float) -> str:
    lines = ["# Hybrid plans: pipeline x data parallel",
             "",
             "<!-- generated by bench/hybrid.py; do not edit by hand -->",
             "",
             f"Command: `{command}` ({elapsed_s:.0f} s on {platform.machine()}, {os.cpu_count()} cores; 1-minute "
             f"load {os.getloadavg()[0]:.2f} at the end). Simulated: step times in ms from the cost model and "
             f"simulator (profiles measured on this CPU, GPU types estimated by the roofline). Each cell: step time "
             f"(ratio to the LP lower bound, stages x replicas, fullest device's memory). Ours: `plan partition "
             f"--method dp --data-parallel auto` (1F1B). Whole strategy: `plan train`'s search at the row's m "
             f"(`--schedule auto` with the zero-bubble and asynchronous schedules, `--recompute "
             f"{TRAIN['recompute'].default}`, `--data-parallel auto`, `--refine`, `--method {TRAIN['method'].default}`, "
             f"`--steps {LONG_RUN}`, so the asynchronous schedules are priced for rounds of "
             f"{TRAIN['round_steps'].default} steps after their synchronous warm-up); its cell names the "
             f"schedule it chose. *whole vs ours*: ours' step over the whole strategy's. Planning: ours, then the "
             f"whole strategy. Shape search: docs/placers.md#hybrid-shapes.",
             "",
             "| model | cluster | m | pipeline | data | uniform 2-D | ours | ours / best baseline | ours vs pipeline | "
             "whole strategy | whole vs ours | planning |",
             "|---|---|---:|---|---|---|---|---:|---:|---|---:|---:|"]
    for row in rows:
        lower, ours = row["lower_s"], row["ours"]
        ratio = ours["step_s"] / best_baseline(row) if ours else float("nan")
        gain = row["pipeline"]["step_s"] / ours["step_s"] if ours and row["pipeline"] else float("nan")
        whole = row.get("whole")
        planning = f"{row['planning_s']:.1f} s" + (f" / {row['whole_planning_s']:.1f} s"
                                                   if row.get("whole_planning_s") is not None else "")
        lines.append(f"| {row['model']} | {row['cluster']} | {row['m']} | {cell(row['pipeline'], lower)} | "
                     f"{cell(row['data'], lower)} | {cell(row['uniform2d'], lower)} | {cell(ours, lower)} | "
                     f"{ratio:.3f} | {gain:.2f}x | {cell(whole, lower)} | {whole_gain(row):.2f}x | {planning} |")
    lines += ["", "## Done-when checks (computed)", ""]
    key = next((r for r in rows if (r["model"], r["cluster"], r["m"]) == ("gpt_small", "dgx-h100-8", 8)), None)
    if key is not None and key["ours"] and key["pipeline"]:
        speedup = key["pipeline"]["step_s"] / key["ours"]["step_s"]
        bound = key["ours"]["step_s"] / key["lower_s"]
        lines.append(f"- gpt_small on dgx-h100-8 at 8 micro-batches: ours is {speedup:.2f}x faster than the best pure "
                     f"pipeline (target 1.5x) and {bound:.2f}x the LP bound (target within 1.3x): "
                     f"{'met' if speedup >= 1.5 and bound <= 1.3 else 'NOT met'}.")
    slower = [r for r in rows if r["ours"] is None or r["ours"]["step_s"] > best_baseline(r) * (1 + 1e-9)]
    lines.append(f"- ours no slower than the best baseline: {len(rows) - len(slower)} of {len(rows)} cases"
                 + ("." if not slower else "; slower: " + ", ".join(f"{r['model']}/{r['cluster']}/m={r['m']}"
                                                                   for r in slower) + "."))
    searched = [r for r in rows if r.get("whole_planning_s") is not None]
    if searched:
        behind = [r for r in searched if not whole_gain(r) >= 1 - 1e-9]
        lines.append(f"- whole strategy no slower than ours: {len(searched) - len(behind)} of {len(searched)} cases"
                     + ("." if not behind else "; slower: " + ", ".join(
                         f"{r['model']}/{r['cluster']}/m={r['m']} ({whole_gain(r):.3f}x)" for r in behind) + "."))
        mixed = [r for r in searched if r["cluster"] == MIXED]
        ahead = [r for r in mixed if whole_gain(r) >= 1.1]
        stale = [r for r in ahead if r["whole"]["schedule"] in ASYNC_SCHEDULES]
        lines.append(f"- whole strategy at least 10% faster than ours on the {MIXED} rows: {len(ahead)} of "
                     f"{len(mixed)} (target: at least half): {'met' if 2 * len(ahead) >= len(mixed) else 'NOT met'}"
                     f"; {len(ahead) - len(stale)} of them with a synchronous schedule, {len(stale)} with an "
                     f"asynchronous one (stale weights: what they cost in accuracy is on docs/bench-async.md).")
    if tight is not None:
        ours = tight["ours"]
        picked = "nothing" if ours is None else (f"{ours['stages']} stage(s) x {ours['degree']} replica(s), "
                                                 f"{ms(ours['step_s'])} ms, fullest device at {ours['fit']:.0%}")
        lines.append(f"- memory-tight ({tight['cluster']}, gpt_medium, m=8): pure data parallel "
                     f"{'does not fit' if tight['data'] is None else 'fits (unexpected)'}; auto picks {picked}.")
    if measured:
        lines += ["", "## Measured on 2 CPU ranks", "",
                  "gloo on this machine's 2 cores, one thread per rank, 8 micro-batches, 1F1B, Adam, rebalancing off; "
                  f"{MEASURED_STEPS} steps in rounds of {ROUND_STEPS}, step time the mean over the rounds after the first; "
                  "the plans come from a profile taken when each model's runs begin (bench/run.py's colocated "
                  "one-thread profile), so the prediction meets the machine as it is that hour. "
                  "Load: the 1-minute load average before and after each run.",
                  "", "| model | plan | shape | predicted ms | measured ms | measured / predicted | load |",
                  "|---|---|---|---:|---:|---:|---|"]
        for row in measured:
            for label in ("data", "pipeline"):
                e = row[label]
                lines.append(f"| {row['model']} | {label} | {e['stages']}x{e['degree']} | {ms(e['predicted_s'])} | "
                             f"{ms(e['measured_s'])} | {e['measured_s'] / e['predicted_s']:.2f} | "
                             f"{e['load'][0]:.2f} -> {e['load'][1]:.2f} |")
        within = [r for r in measured if abs(r["data"]["measured_s"] / r["data"]["predicted_s"] - 1) <= 0.15]
        lines += ["", f"- data parallel's measured step time within 15% of its prediction: {len(within)} of "
                      f"{len(measured)} models."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--clusters", nargs="*", default=list(CLUSTERS))
    parser.add_argument("--skip-measured", action="store_true")
    parser.add_argument("--output", default=str(OUTPUT))
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for name in args.models:
        profile = suite.cached_profile(name)
        for cluster_name in args.clusters:
            for m in MICROBATCHES:
                rows.append(simulated_case(name, profile, cluster_name, m))
                print(f"{name} {cluster_name} m={m}: done", flush=True)
    tight = memory_tight(suite.cached_profile("gpt_medium")) if "gpt_medium" in args.models else None
    measured = [] if args.skip_measured else [measured_case(name) for name in MEASURED]
    command = "python3 bench/hybrid.py" + ("" if args.models == list(MODELS) and args.clusters == list(CLUSTERS)
                                           and not args.skip_measured else " " + " ".join(
        (["--models", *args.models] if args.models != list(MODELS) else [])
        + (["--clusters", *args.clusters] if args.clusters != list(CLUSTERS) else [])
        + (["--skip-measured"] if args.skip_measured else [])))
    Path(args.output).write_text(render(rows, tight, measured, command, time.perf_counter() - start))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
