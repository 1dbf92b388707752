"""Benchmark of ``plan run`` on 2 CPU ranks (gloo, one intra-op thread each): pipelining gain, fidelity
of the simulator's step time, and run-time rebalancing against an emulated slow rank.

1. Pipelining: one 2-stage plan run with 8 micro-batches under 1F1B, and the same stages with one
   micro-batch carrying the whole batch (plain model parallelism). Gain = step time (1) / step time (8).
2. Fidelity: per model, the dp plan on ``cpu-2`` (8 micro-batches, 1F1B); measured step time against
   the plan's ``predicted.step_time_s`` (profile measured with one thread, like the ranks).
3. Rebalancing, per model x ``--factors`` F x ``--runs``: ``--emulate-slowdown 1=F`` under (a) the static dp
   plan, rebalancing off; (b) the same plan with rebalancing on (rounds, convergence, the fitted speed factors,
   throughput after); (c) an oracle plan made knowing the slowdown (``speed_factors {cpu1: F}``), rebalancing off.

Step times are the mean over rounds after the first (the warm-up round) from the run's round log.
The machine is shared: the 1-minute load average is recorded before and after every run.

    python3 bench/run.py                                  # everything; writes docs/bench-run.md and .json
    python3 bench/run.py --only rebalance                 # one experiment; the page keeps the others' results
    python3 bench/run.py --only rebalance --factors 2 --runs 1 --rebalance-models gpt_small --output /tmp/r.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from _paths import REPO  # first: the repository on sys.path, bench/ last (see bench/_paths.py)

from planner.examples import BUNDLED  # noqa: E402
from planner.formats.cluster import load_cluster  # noqa: E402
from planner.formats.plan import Plan, load_plan, save_plan  # noqa: E402
from planner.formats.profile import load_profile, save_profile  # noqa: E402
from planner.partition import partition  # noqa: E402
from planner.app.partition import profile_ref  # noqa: E402

MODELS = {name: BUNDLED[name] for name in ("gpt_small", "resnet_small", "unet_small", "gpt2_small")}
CACHE = REPO / "bench" / ".cache" / "run"
HISTORY = REPO / "bench" / "run-history.jsonl"
"""One line per full run (all three experiments), newest last: the spread between runs on this machine."""
CLUSTER = REPO / "profiles" / "clusters" / "cpu-2.json"
MICROBATCHES = 8
DEFAULT_OUTPUT = str(REPO / "docs" / "bench-run.md")
RESULTS = REPO / "docs" / "bench-run.json"
"""Every experiment's last results (committed beside the page): ``--only`` re-runs one and re-renders all."""


def load1() -> float:
    return os.getloadavg()[0]


_SPIN = "import time\nt = time.perf_counter()\nx = 0\nfor i in range(3_000_000): x += i\nprint(time.perf_counter() - t)"


def parallel_capacity() -> float:
    """How many cores two single-threaded processes really get now: 2 x (time alone) / (time side by side).

    2.0 on an idle 2-core machine; about 1.0 when another job holds a core (or the VM's quota is one
    CPU). A pipeline of 2 CPU ranks cannot beat plain model parallelism by more than this."""
    import subprocess

    def spin(n: int) -> float:
        procs = [subprocess.Popen([sys.executable, "-c", _SPIN], stdout=subprocess.PIPE, text=True) for _ in range(n)]
        return max(float(p.communicate()[0]) for p in procs)

    alone = min(spin(1) for _ in range(2))
    together = min(spin(2) for _ in range(2))
    return 2 * alone / together


PROBES = 3
"""Probes ``probed_cluster`` takes the median of."""


def probed_cluster(base: Path = CLUSTER, probes: int = PROBES) -> Path:
    """``base`` with its intra-host link and what the pipeline runtime costs (its ``runtime`` figures) probed now, on
    2 ranks (``plan profile --probe-links``, about 20 s each), the median of ``probes`` probes figure by figure; its
    devices and memory kept. A bench whose predictions meet the machine as it is that hour profiles the model afresh,
    and probes these with it: on a model whose passes take a millisecond, the runtime's cost per pass and its messages
    are most of a step, and they move with the machine's speed as much as the ops' times do, while ``base`` holds the
    figures of the day it was probed. One probe is one launch, and launches of the same 2-rank pipeline differ (the
    bundled cpu-2's five probes of 2026-11-28 spread 215-363 us per pass), hence the median. Written to ``CACHE``;
    the probes' own clusters beside it."""
    import dataclasses
    import statistics
    import subprocess

    from learning import PLAN
    from planner.formats.cluster import save_cluster

    CACHE.mkdir(parents=True, exist_ok=True)
    runs = []
    for i in range(probes):
        probe = CACHE / f"probe{i}.cluster.json"
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python",
                               *PLAN, "profile", "--probe-links", "-o", str(probe)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"plan profile --probe-links failed:\n{done.stderr[-3000:]}")
        runs.append(load_cluster(probe))

    def median(field: str, of: Any = None) -> float:
        return statistics.median(getattr(of(run) if of else run, field) for run in runs)

    cluster, first = load_cluster(base), runs[0]
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    where = f"median of {probes} probes, {stamp}, by bench/run.py probed_cluster"
    merged = dataclasses.replace(
        cluster, name=f"{cluster.name}-probed", pass_overhead_s=median("pass_overhead_s"),
        pass_byte_overhead_s=median("pass_byte_overhead_s"), pass_compute_overhead_s=median("pass_compute_overhead_s"),
        schedule_runtime_pass_overhead_s=median("schedule_runtime_pass_overhead_s"),
        pass_overhead_source=f"{first.pass_overhead_source}; {where}",
        intra_host=dataclasses.replace(first.intra_host, bandwidth_Bps=median("bandwidth_Bps", lambda c: c.intra_host),
                                       latency_s=median("latency_s", lambda c: c.intra_host),
                                       source=f"{first.intra_host.source}; {where}"))
    return save_cluster(merged, CACHE / f"{cluster.name}.probed.cluster.json")


def profile_path(name: str, reprofile: bool, colocate: int = 2) -> Path:
    """Measure (once, cached) the model's profile with one intra-op thread, like each rank runs, and under
    co-location with the other training processes, as the ranks share this host (``--colocate N``)."""
    import torch

    from planner.profile import profile_model

    path = CACHE / f"{name}.profile.json" if colocate == 2 else CACHE / f"{name}.colocate{colocate}.profile.json"
    if reprofile or not path.is_file():
        torch.set_num_threads(1)
        CACHE.mkdir(parents=True, exist_ok=True)  # other benches (hybrid.py) call this first on a clean checkout
        save_profile(profile_model(MODELS[name], repeats=5, warmup=2, threads=1, colocate=colocate), path)
    return path


SHAPES = {  # fidelity: name -> (cluster, data-parallel degree, ranks)
    "pipeline": (CLUSTER, 1, 2),
    "data parallel": (CLUSTER, 2, 2),
    "hybrid 2x2": (REPO / "profiles" / "clusters" / "cpu-4.json", 2, 4),
}


def make_plan(name: str, profile: Path, tag: str, *, microbatches: int = MICROBATCHES,
              speed_factors: dict[str, float] | None = None, shape: str = "pipeline") -> Path:
    """The dp plan of ``shape`` (``SHAPES``; time-balance's where dp leaves a rank idle), ranks fixed in cluster order
    (cpu0 = rank 0, cpu1 = rank 1, ...)."""
    cluster_path, degree, ranks = SHAPES[shape]
    cluster = load_cluster(cluster_path)
    # The shape runs on every rank, but dp may leave devices idle (a 1-stage replica on a 2-device group, when 4
    # ranks share 2 cores); time-balance, which uses every device, then makes the plan (its method says so).
    for method in ("dp", "time-balance"):
        plan = partition(load_profile(profile), cluster, method=method, microbatches=microbatches, schedule="1f1b",
                         optimizer="adam", speed_factors=speed_factors, profile_ref=profile_ref(profile, name),
                         data_parallel=degree)
        if len({d for replicas in plan.replicas() for d in replicas}) == ranks:
            break
    if degree == 1:
        plan = with_extra(plan, device_ranks=list(cluster.device_ids))
    path = CACHE / f"{name}.{tag}.plan.json"
    save_plan(plan, path)
    return path


def with_extra(plan: Plan, microbatches: int | None = None, **extra: Any) -> Plan:
    return Plan(plan.method, plan.schedule, microbatches or plan.microbatches, plan.stages, plan.predicted,
                {**dict(plan.extra), **extra})


def run_job(plan: Path, model: str, steps: int, round_steps: int, options: dict[str, Any],
            microbatch_size: int | None = None, tag: str = "job", ranks: int = 2) -> dict[str, Any]:
    """Launch 2 local ranks (rebalancing and checkpoint hooks built in); return the round records and the load around the run."""
    from planner.runtime.launch.elastic import LaunchOptions, launch
    from planner.runtime.launch.config import RunConfig

    log = CACHE / f"rounds-{tag}.jsonl"
    log.unlink(missing_ok=True)
    config = RunConfig(plan=str(plan), model=model, steps=steps, round_steps=round_steps, timeout_s=600,
                       microbatch_size=microbatch_size, options={**options, "log": str(log)})
    before = load1()
    start = time.perf_counter()
    launch(config, LaunchOptions(nproc_per_node=ranks))
    wall = time.perf_counter() - start
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    return {"rounds": rounds, "load_before": before, "load_after": load1(), "wall_s": wall}


def per_step(rounds: list[dict[str, Any]], field: str = "compute_s") -> dict[str, float]:
    """Mean seconds of a round record's per-device ``field`` (``compute_s``: its passes; ``update_s``: its optimizer
    updates, with any wait for a sync inside them) per step of each device over the rounds after the warm-up."""
    later = [r for r in rounds if r["round"] > 0] or rounds
    devices = later[0]["devices"]
    return {d: sum(r["devices"][d][field] / r["steps"] for r in later) / len(later) for d in devices}


def steady_step_s(rounds: list[dict[str, Any]], after: int = 0) -> float:
    """Mean step time over rounds after ``after`` (excluded: the warm-up round at ``after``)."""
    times = [r["step_time_s"] for r in rounds if r["round"] > after] or [r["step_time_s"] for r in rounds]
    return sum(times) / len(times)


def pipelining(args: argparse.Namespace) -> dict[str, Any]:
    prof = profile_path("gpt_small", args.reprofile)
    plan8 = make_plan("gpt_small", prof, "mb8")
    one = load_plan(plan8)  # one micro-batch: F0 F1 B1 B0, plain model parallelism (GPipe; torch's 1F1B needs >= 2)
    one = Plan(one.method, "gpipe", 1, one.stages, one.predicted, dict(one.extra))
    plan1 = CACHE / "gpt_small.mb1.plan.json"
    save_plan(one, plan1)
    mbs = int(load_profile(prof).model.get("microbatch_size", 4))
    off = {"rebalance": False}
    capacity_before = parallel_capacity()
    r8 = run_job(plan8, MODELS["gpt_small"], args.steps, args.round_steps, off, tag="pipe-mb8")
    r1 = run_job(plan1, MODELS["gpt_small"], args.steps, args.round_steps, off, microbatch_size=mbs * MICROBATCHES,
                 tag="pipe-mb1")
    t8, t1 = steady_step_s(r8["rounds"]), steady_step_s(r1["rounds"])
    return {"step_s_8": t8, "step_s_1": t1, "gain": t1 / t8, "rows": mbs * MICROBATCHES,
            "capacity": [capacity_before, parallel_capacity()],
            "compute_per_step_s": {"8": per_step(r8["rounds"]), "1": per_step(r1["rounds"])},
            "load": [r8["load_before"], r8["load_after"], r1["load_before"], r1["load_after"]]}


def fidelity(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per model, ``--trials`` times: profile afresh, plan, run; the profile is taken right before its run,
    because this shared machine's speed drifts by several percent over minutes."""
    out = []
    cases = [(name, "pipeline") for name in args.models] + [("gpt_small", shape) for shape in args.shapes]
    for name, shape in cases:
        trials = []
        ranks = SHAPES[shape][2]
        for _ in range(args.trials):
            prof = profile_path(name, True, colocate=ranks)
            plan = make_plan(name, prof, "mb8", shape=shape)
            result = run_job(plan, MODELS[name], args.fidelity_steps, args.round_steps, {"rebalance": False},
                             tag=f"fid-{name}-{shape.replace(' ', '_')}", ranks=ranks)
            saved = load_plan(plan)
            measured, predicted = steady_step_s(result["rounds"]), saved.step_time_s
            calibrated, later = calibrated_in_first_round(saved, prof, shape, result["rounds"])
            trials.append({"predicted_s": predicted, "measured_s": measured, "error": measured / predicted - 1,
                           "calibrated_s": calibrated, "measured_after_s": later,
                           "calibrated_error": later / calibrated - 1,
                           "compute_ratio": _compute_ratio(saved, result["rounds"]),
                           "stages": [len(s.nodes) for s in saved.stages], "method": saved.method,
                           "load": [result["load_before"], result["load_after"]]})
        errors = sorted(t["error"] for t in trials)
        middle = sorted(trials, key=lambda t: t["error"])[len(trials) // 2]
        out.append({"model": name, "shape": shape, "ranks": ranks, **middle, "errors": errors,
                    "calibrated_errors": sorted(t["calibrated_error"] for t in trials), "trials": trials})
    return out


def calibrated_in_first_round(plan: Plan, profile: Path, shape: str, rounds: list[dict[str, Any]]) -> tuple[float, float]:
    """The plan's step time re-simulated with each device's compute factor measured in the first steady round
    (round 1: measured compute over the cost model's, ``RoundModel.predicted_compute_s``), and the mean measured
    step of the rounds after it: the calibration ``plan run`` reports, taken from one round and checked on the
    others, so the machine's speed on the day is measured, not guessed."""
    from planner.formats.catalog import load_catalog
    from planner.runtime.rebalancing.replan import RoundModel

    first = next(r for r in rounds if r["round"] == 1)
    model = RoundModel.build(load_profile(profile), load_cluster(SHAPES[shape][0]), plan, catalog=load_catalog())
    predicted = model.predicted_compute_s(plan, int(first["steps"]))
    factors = {d: v["compute_s"] / predicted[d] for d, v in first["devices"].items() if predicted.get(d, 0.0) > 0}
    later = [r["step_time_s"] for r in rounds if r["round"] > 1]
    return model.step_time_s(plan, factors), sum(later) / len(later)


def _compute_ratio(plan: Plan, rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Per device: measured compute per step / the plan's compute per step (forward + backward of its stages
    times the micro-batches; copies and the optimizer step excluded, as the runtime's compute excludes them)."""
    predicted: dict[str, float] = {}
    for st, devices in zip(plan.stages, plan.replicas()):
        for device, share in zip(devices, plan.replica_shares()):
            predicted[device] = predicted.get(device, 0.0) + float(st.extra["compute_s"]) * share
    measured = per_step(rounds)
    return {d: measured[d] / predicted[d] for d in predicted if d in measured and predicted[d] > 0}


def rebalance(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per model x slowdown x run: the static plan, the oracle plan and the rebalanced run under the slowdown."""
    return [rebalance_one(args, name, factor, run) for name in args.rebalance_models for factor in args.factors
            for run in range(args.runs)]


def rebalance_one(args: argparse.Namespace, name: str, factor: float, run: int) -> dict[str, Any]:
    prof = profile_path(name, args.reprofile)
    static = make_plan(name, prof, "mb8")
    oracle = make_plan(name, prof, "oracle", speed_factors={"cpu1": factor})
    slow = f"1={factor}"
    model = MODELS[name]
    tag = f"rb-{name}-{factor}-{run}"
    r_static = run_job(static, model, args.steps, args.round_steps, {"rebalance": False, "emulate_slowdown": slow},
                       tag=f"{tag}-static")
    r_oracle = run_job(oracle, model, args.steps, args.round_steps, {"rebalance": False, "emulate_slowdown": slow},
                       tag=f"{tag}-oracle")
    r_dyn = run_job(static, model, args.rebalance_steps, args.round_steps,
                    {"rebalance": True, "emulate_slowdown": slow, "output": str(CACHE / "rebalanced.plan.json")},
                    tag=f"{tag}-dynamic")
    rounds = r_dyn["rounds"]
    changes = [r["round"] for r in rounds if r["plan_changed"]]
    last_change = changes[-1] if changes else -1
    converged = next((r["round"] for r in rounds if r["converged"]), None)
    t_static, t_oracle = steady_step_s(r_static["rounds"]), steady_step_s(r_oracle["rounds"])
    static_compute = per_step(r_static["rounds"])
    first_change = changes[0] if changes else len(rounds) - 1
    t_before = steady_step_s([r for r in rounds if r["round"] <= max(first_change, 1)])  # the static plan's rounds
    t_after = steady_step_s(rounds, after=last_change + 1) if last_change >= 0 else steady_step_s(rounds)
    final = rounds[-1]
    speeds = {d: v["speed_factor"] for d, v in final["devices"].items()}
    return {
        "model": name, "run": run, "factor": factor, "step_s_static": t_static, "step_s_oracle": t_oracle,
        "step_s_before": t_before, "step_s_after": t_after, "plan_changes": changes,
        "converged_round": converged, "rounds": len(rounds),
        "relative_speed": speeds.get("cpu1", 1.0) / speeds.get("cpu0", 1.0),
        "relative_speed_by_round": [r["devices"]["cpu1"]["speed_factor"] / r["devices"]["cpu0"]["speed_factor"]
                                    for r in rounds],
        "final_max_over_mean_wait": final["max_wait_s"] / final["mean_wait_s"] if final["mean_wait_s"] else 1.0,
        "speedup_vs_static": t_static / t_after, "fraction_of_oracle": t_oracle / t_after,
        "static_compute_ratio": static_compute["cpu1"] / factor / static_compute["cpu0"],
        "stages": {"static": [len(s.nodes) for s in load_plan(static).stages],
                   "oracle": [len(s.nodes) for s in load_plan(oracle).stages],
                   "rebalanced": [s["nodes"] for s in final["stages"]]},
        "round_log": [{k: r[k] for k in ("round", "step_time_s", "imbalance", "plan_changed", "converged", "reason")}
                      for r in rounds],
        "load": [r_static["load_before"], r_static["load_after"], r_oracle["load_before"], r_oracle["load_after"],
                 r_dyn["load_before"], r_dyn["load_after"]],
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = ["# `plan run` benchmark (2 CPU ranks)", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
             f"torch {__import__('torch').__version__}; gloo, one intra-op thread per rank. Shared with other "
             f"jobs: the 1-minute load average before/after each run is listed (2.0 = both cores busy).", "",
             f"Reproduce: `python3 bench/run.py` (everything; `--only NAME` re-runs one experiment and keeps the "
             f"others' last results). Last command: `{results.get('command', 'python3 bench/run.py')}`, finished "
             f"{results.get('finished', '?')}.", ""]
    loads = [v for key, part in results.items() if key in ("pipelining", "fidelity", "rebalance") for v in _loads(part)]
    if loads and max(loads) > 2.5:
        lines += [f"**Busy machine: the load average reached {max(loads):.1f} on {os.cpu_count()} cores during these "
                  f"runs.** Each rank then gets a fraction of a core, two ranks cannot compute at the same time, "
                  f"and timings swing from run to run; such numbers say little about the method (a pipeline "
                  f"cannot gain without idle cores). Re-run on a quiet machine.", ""]
    if "pipelining" in results:
        p = results["pipelining"]
        lines += ["## 1. Pipelining gain (gpt_small, same 2 stages)", "", _section_note(results, "pipelining"), "",
                  "| schedule | micro-batches | rows per micro-batch | step time (s) |", "|---|---:|---:|---:|",
                  f"| 1F1B | 8 | {p['rows'] // MICROBATCHES} | {p['step_s_8']:.3f} |",
                  f"| plain model parallel (GPipe, 1 micro-batch) | 1 | {p['rows']} | {p['step_s_1']:.3f} |", "",
                  f"Gain: **{p['gain']:.2f}x** (target >= 1.5x). Load: {_load(p['load'])}."]
        if "capacity" in p:
            comp8, comp1 = p["compute_per_step_s"]["8"], p["compute_per_step_s"]["1"]
            lines += ["", f"Parallel capacity measured just before and after (two single-threaded processes side by "
                      f"side vs one alone; 2.0 = two free cores): {p['capacity'][0]:.2f}, {p['capacity'][1]:.2f}. "
                      f"Compute per step and rank: 8 micro-batches "
                      f"{', '.join(f'{d} {v:.2f} s' for d, v in comp8.items())}; 1 micro-batch "
                      f"{', '.join(f'{d} {v:.2f} s' for d, v in comp1.items())}. The pipeline's ideal gain here is "
                      f"(m + p - 1) / m against p, i.e. 2 / (9 / 8) = 1.78x with two free cores; it is bounded by the "
                      f"capacity, and by how much more compute eight small micro-batches take than one large one."]
        lines.append("")
    if "fidelity" in results:
        lines += ["## 2. Fidelity: measured vs simulated step time (dp plans, 8 micro-batches, 1F1B)", "",
                  _section_note(results, "fidelity"), "",
                  "Each trial profiles the model afresh, plans, and runs right away. The row shows the median trial; "
                  "*errors* lists every trial's; *compute* is the ranks' measured compute over the plan's (machine "
                  "speed and op-time error, before the schedule and communication add theirs). Shapes: *pipeline* "
                  "is the dp plan on `cpu-2` (2 stages, 2 ranks); *data parallel* is 1 stage x 2 replicas on "
                  "`cpu-2`; *hybrid 2x2* is 2 stages x 2 replicas on `cpu-4`, 4 ranks sharing this machine's 2 "
                  "cores: the profile is co-located with 3 other ranks and the cost model gives each rank its share of "
                  "the 2 cores (the ranks busy beside it) and stretches their work to fit in them "
                  "(`runtime.host_cores`, docs/cost-model.md), so that row checks the "
                  "model of shared cores, not the speed of a 4-device machine.", "",
                  "*Calibrated in round 1*: the plan re-simulated with each rank's compute factor measured in the "
                  "first round after the warm-up (measured compute over the cost model's), against the mean step of "
                  "the rounds after it: what `plan run` reports as its calibrated prediction, taken from one round "
                  "and checked on the others.", "",
                  "| model | shape (ranks) | nodes per stage | predicted (s) | measured (s) | error (median) | "
                  "errors, all trials | calibrated in round 1: errors | compute measured / predicted | "
                  "load before/after |",
                  "|---|---|---|---:|---:|---:|---|---|---|---|"]
        for f in results["fidelity"]:
            errors = ", ".join(f"{e:+.1%}" for e in f.get("errors", [f["error"]]))
            calibrated = ", ".join(f"{e:+.1%}" for e in f.get("calibrated_errors", []))
            ratio = ", ".join(f"{d} {r:.2f}" for d, r in f.get("compute_ratio", {}).items())
            shape = f"{f.get('shape', 'pipeline')} ({f.get('ranks', 2)})"
            if f.get("method", "dp") != "dp":  # dp left a rank idle (make_plan)
                shape += f", {f['method']}'s plan"
            lines.append(f"| {f['model']} | {shape} | {f['stages']} | {f['predicted_s']:.3f} | {f['measured_s']:.3f} | "
                         f"{f['error']:+.1%} | {errors} | {calibrated} | {ratio} | {_load(f['load'])} |")
        lines += ["", "Target: every trial within 10%. " + _within(results["fidelity"], "errors", "Predicted") + " "
                  + _within(results["fidelity"], "calibrated_errors", "Calibrated in round 1"), ""]
    if "rebalance" in results:
        rows = _rebalance_rows(results["rebalance"])
        lines += ["## 3. Rebalancing under an emulated slow rank (`--emulate-slowdown 1=F`)", "",
                  _section_note(results, "rebalance"), "",
                  "Per run: the static dp plan with rebalancing off, an oracle plan made knowing the slowdown "
                  "(`speed_factors {cpu1: F}`) with rebalancing off, and the static plan with rebalancing on. *Speed "
                  "ratio* is the slow rank's fitted speed factor over the other's in the last round (true: F); "
                  "targets: within 10% of F, S6 declared within 6 rounds, >= 90% of the oracle's throughput, and "
                  ">= 1.25x the static plan's at F = 2. The slowed rank waits out its stretch busy on its core, as a "
                  "slower device would hold it (docs/rebalancing.md), so the load average counts it. *Static "
                  "compute ratio*: on the static plan, the slowed rank's compute per step over F, over the other "
                  "rank's: the same at every F when the emulation slows the rank by F and nothing else.", "",
                  "| model | F | run | speed ratio (error) | plan changed in rounds | S6 in round | vs static | "
                  "of oracle | static compute ratio | load (static, oracle, rebalanced) |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|---|"]
        for r in rows:
            lines.append(f"| {r['model']} | {r['factor']:g} | {r['run']} | {r.get('relative_speed', float('nan')):.2f} "
                         f"({r.get('relative_speed', float('nan')) / r['factor'] - 1:+.0%}) | {r['plan_changes']} | "
                         f"{r['converged_round']} | {r['speedup_vs_static']:.2f}x | {r['fraction_of_oracle']:.0%} | "
                         f"{_ratio(r.get('static_compute_ratio'))} | {_load(r['load'])} |")
        lines += ["", rebalance_summary(rows)]
        first = rows[0]
        lines += ["", f"Round log of the first run ({first['model']}, F = {first['factor']:g}):", "",
                  "| round | step time (s) | imbalance | plan | reason |", "|---:|---:|---:|---|---|"]
        for x in first["round_log"]:
            plan = "changed" if x["plan_changed"] else ("converged" if x["converged"] else "kept")
            lines.append(f"| {x['round']} | {x['step_time_s']:.3f} | {x['imbalance']:.1%} | {plan} | {x['reason']} |")
        lines.append("")
    history = _history()
    if history:
        lines += ["## Spread across runs", "",
                  f"Every run of this page's command on this machine, whole or one section (`--only`; "
                  f"`{HISTORY.relative_to(REPO)}`, newest last; a dash: the section did not run). The runs are "
                  f"minutes or days apart on a shared VM whose speed drifts, so each figure moves by a few points "
                  f"between runs. Fidelity: the median trial's error, every trial's in brackets, and how many trials "
                  f"lie within 10% as predicted and as calibrated in round 1 (recorded since 2026-11-28).", "",
                  "| finished | pipelining | fidelity, median of 3 trials (all trials) | fidelity: trials within "
                  "10%, predicted / calibrated | rebalancing at F = 2 (worst run): vs static, of oracle, converged in "
                  "round |",
                  "|---|---:|---|---|---|"]
        for h in history:
            lines.append(f"| {h['finished']} | {_history_cells(h)} |")
        lines.append("")
    lines += ["## Reading the numbers", "",
              "- **Pipelining** needs two cores free for the two ranks. This machine has 2 vCPUs shared with other "
              "jobs; the capacity probe above says how many it really had. With one core's worth of throughput, "
              "1F1B can only tie plain model parallelism, and its eight 4-row micro-batches cost more compute "
              "than one 32-row batch (smaller matrix products, more per-op dispatch, 8x the p2p messages).",
              "- **Fidelity.** The prediction includes what a training step costs beyond the per-op sum: op "
              "times calibrated to a measured training micro-batch, the optimizer step, gloo's host copies (the "
              "ranks' own cores move the bytes, so transfers do not overlap compute on CPU), and the runtime's "
              "probed costs per pass and per byte moved between stages (docs/cost-model.md). What the model "
              "leaves out: the ranks compute more than the fresh profile predicts (the *compute* column above: "
              "cutting the graph into stages, and the machine's drifting speed), jitter in a nearly balanced "
              "pipeline (a late pass on one rank stalls the other, which a deterministic simulation does not "
              "see), and the training loop's work outside the schedule (drawing each step's batch).",
              "- **Rebalancing** compares runs made minutes apart on a shared machine; the oracle and the "
              "rebalanced plan can differ by a few blocks and a few percent either way. The round log shows the "
              "mechanism: one unbalanced round, one re-plan with the measured speed factors, then balanced rounds "
              "until S6 freezes the plan: in round 4 after one re-plan in round 1, as the round after a switch is "
              "judged from its second step (its first builds the new stages) and S6 wants 3 judged rounds without "
              "a change. A run whose first re-plan moved a cut far enough to show more of the ops' error, or whose "
              "one judged step after it came out above the threshold, re-plans once more in that round, and S6 "
              "comes one or two rounds later. The speed ratio is read from the speed probe every rank times at "
              "each round's start and from how the devices' compute changed when a cut moved (docs/rebalancing.md); "
              "a round whose probe ran slow on one core (this host's neighbours) moves it by a few percent, and a "
              "first re-plan made on such a round can come late or move too far (S6 a round or two later). The "
              "probe and the barrier after it cost the rebalanced run its time at each round's start (a few tens "
              "of milliseconds on the slowed rank).", ""]
    return "\n".join(lines) + "\n"


def _within(rows: list[dict[str, Any]], key: str, what: str) -> str:
    """'Predicted: **14 of 15 trials within 10%**; the largest error is 12.3%.' over every trial's ``key``."""
    errors = [e for f in rows for e in f.get(key, [])]
    if not errors:
        return ""
    within = sum(abs(e) <= 0.10 for e in errors)
    return (f"{what}: **{within} of {len(errors)} trials within 10%**; the largest error is "
            f"{max(abs(e) for e in errors):.1%}.")


def rebalance_summary(rows: list[dict[str, Any]]) -> str:
    """One line over every run: the speed ratio's errors, and the worst run at F = 2 against each target."""
    errors = [r["relative_speed"] / r["factor"] - 1 for r in rows if "relative_speed" in r]
    at2 = [r for r in rows if r["factor"] == 2.0] or rows
    rounds = [r["converged_round"] for r in at2 if r["converged_round"] is not None]
    s6 = (f"S6 convergence declared in round {max(rounds)} at the latest" if len(rounds) == len(at2)
          else f"S6 not declared in {len(at2) - len(rounds)} of {len(at2)} runs")
    return (f"Over all {len(rows)} runs the speed ratio is {min(errors):+.0%} to {max(errors):+.0%} off the true "
            f"slowdown ({sum(abs(e) <= 0.10 for e in errors)} of {len(errors)} within 10%). At F = 2, the worst of "
            f"{len(at2)} runs: vs static **{min(r['speedup_vs_static'] for r in at2):.2f}x**, "
            f"**{min(r['fraction_of_oracle'] for r in at2):.0%} of the oracle's** throughput, {s6}.")


def _rebalance_rows(part: Any) -> list[dict[str, Any]]:
    """The rebalancing results as rows (results written before the sweep hold one gpt_small run at F = 2)."""
    return [{"model": "gpt_small", "run": 0, **part}] if isinstance(part, dict) else list(part)


def _section_note(results: dict[str, Any], name: str) -> str:
    """When and how a section was last measured (``--only`` re-runs one section and keeps the others)."""
    meta = results.get("sections", {}).get(name)
    if not meta:
        return f"Measured by `{results.get('command', 'python3 bench/run.py')}`, finished {results.get('finished', '?')}."
    return f"Measured by `{meta['command']}`, finished {meta['finished']}."


def history_entry(results: dict[str, Any], ran: list[str]) -> dict[str, Any]:
    """The line a run of the page's command adds to ``HISTORY``: the sections it ran (``ran``), each summarised."""
    entry: dict[str, Any] = {"finished": results["finished"], "command": results["command"]}
    if "pipelining" in ran:
        entry["pipelining_gain"] = results["pipelining"]["gain"]
    if "fidelity" in ran:
        entry["fidelity"] = {_case(f): {"median": f["error"], "errors": f.get("errors", [f["error"]]),
                                        "calibrated_errors": f.get("calibrated_errors", [])}
                             for f in results["fidelity"]}
    if "rebalance" in ran:
        rows = _rebalance_rows(results["rebalance"])
        at2 = [r for r in rows if r["factor"] == 2.0] or rows
        rounds = [r["converged_round"] for r in at2]
        entry["rebalance"] = {"speedup_vs_static": min(r["speedup_vs_static"] for r in at2),
                              "fraction_of_oracle": min(r["fraction_of_oracle"] for r in at2),
                              "converged_round": None if None in rounds else max(rounds)}
    return entry


def _history_cells(h: dict[str, Any]) -> str:
    """A history line's cells after its date: pipelining, fidelity, fidelity's counts, rebalancing ("-": not run)."""
    gain = f"{h['pipelining_gain']:.2f}x" if "pipelining_gain" in h else "-"
    fid = h.get("fidelity")
    cases = "; ".join(f"{m} {f['median']:+.1%} ({', '.join(f'{e:+.1%}' for e in f['errors'])})"
                      for m, f in fid.items()) if fid else "-"
    counts = "-"
    if fid:
        raw = [e for f in fid.values() for e in f["errors"]]
        cal = [e for f in fid.values() for e in f.get("calibrated_errors", [])]
        counts = f"{sum(abs(e) <= 0.10 for e in raw)} of {len(raw)} / " + (
            f"{sum(abs(e) <= 0.10 for e in cal)} of {len(cal)}" if cal else "-")
    rb = h.get("rebalance")
    rebalance = (f"{rb['speedup_vs_static']:.2f}x, {rb['fraction_of_oracle']:.0%}, {rb['converged_round']}"
                 if rb else "-")
    return f"{gain} | {cases} | {counts} | {rebalance}"


def _case(f: dict[str, Any]) -> str:
    """A fidelity row's name: the model, and its shape unless a plain pipeline."""
    shape = f.get("shape", "pipeline")
    return f["model"] if shape == "pipeline" else f"{f['model']} ({shape})"


def _history() -> list[dict[str, Any]]:
    if not HISTORY.is_file():
        return []
    return [json.loads(line) for line in HISTORY.read_text().splitlines() if line.strip()]


def _loads(part: Any) -> list[float]:
    if isinstance(part, list):
        return [v for item in part for v in _loads(item)]
    return list(part.get("load", [])) if isinstance(part, dict) else []


def _ratio(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def _load(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("pipelining", "fidelity", "rebalance"), action="append")
    parser.add_argument("--models", nargs="+", default=["gpt_small", "resnet_small", "unet_small"], choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--fidelity-steps", type=int, default=10,
                        help="Fidelity: steps per run (rounds of --round-steps: warm-up, calibration, then measured).")
    parser.add_argument("--rebalance-steps", type=int, default=16)
    parser.add_argument("--round-steps", type=int, default=2)
    parser.add_argument("--factors", type=float, nargs="+", default=[1.5, 2.0, 3.0],
                        help="Rebalancing: the emulated slowdowns of rank 1.")
    parser.add_argument("--rebalance-models", nargs="+", default=["gpt_small", "resnet_small", "unet_small"],
                        choices=sorted(MODELS))
    parser.add_argument("--runs", type=int, default=3, help="Rebalancing: runs per model and slowdown.")
    parser.add_argument("--reprofile", action="store_true", help="Profile again (fidelity always does, per trial).")
    parser.add_argument("--trials", type=int, default=3, help="Fidelity: profile-plan-run trials per model.")
    parser.add_argument("--shapes", nargs="*", default=["data parallel", "hybrid 2x2"], choices=sorted(set(SHAPES) - {"pipeline"}),
                        help="Fidelity: replicated shapes of gpt_small measured beside every model's pipeline.")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
    parser.add_argument("--render-only", action="store_true", help="Re-render the last results (no runs).")
    args = parser.parse_args()
    CACHE.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        Path(args.output).write_text(render(json.loads(RESULTS.read_text()), args), encoding="utf-8")
        return
    todo = args.only or ["pipelining", "fidelity", "rebalance"]
    results: dict[str, Any] = {}
    if args.only and RESULTS.is_file():  # keep the other experiments' last results: the page is re-rendered whole
        results = json.loads(RESULTS.read_text())
    command = " ".join(["python3 bench/run.py", *sys.argv[1:]])
    results["command"] = command
    for name in todo:
        results[name] = {"pipelining": pipelining, "fidelity": fidelity, "rebalance": rebalance}[name](args)
        results.setdefault("sections", {})[name] = {"command": command,
                                                    "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        print(json.dumps({name: results[name]}, indent=1), flush=True)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.output == DEFAULT_OUTPUT:  # a run of the page's command, whole or in part: keep its summary
        with HISTORY.open("a", encoding="utf-8") as f:
            f.write(json.dumps(history_entry(results, todo)) + "\n")
    Path(args.output).write_text(render(results, args), encoding="utf-8")
    if args.output == DEFAULT_OUTPUT:
        RESULTS.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
