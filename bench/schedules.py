"""Benchmark of the pipeline schedules, zero-bubble ones included (docs/zero-bubble.md).

1. Measured, 2 CPU ranks (gloo, one intra-op thread each), per model x micro-batch count: the dp plan under
   ``zb-h2`` (stages cut for a zero-bubble schedule, one per rank), run under 1F1B, ``zb-h1`` (torch's ZB1P
   order), ``zb-planned`` (the planner's order from the stages' F, I and W times) and ``zb-h2`` (the paper's
   ZB-H2 pattern, 2p - 1 micro-batches in flight); 1F1B's own dp plan where its stages differ; and the dp plans
   of interleaved 1F1B, ``zbv`` (ZB-V) and ``dualpipev`` (DualPipeV), several stages per rank where that
   simulates faster (round-robin, in a V).
   Each row: the measured step time (mean over the rounds after the first, rebalancing off, runs of
   ``MEASURED_STEPS``; the median of ``--repeats`` runs, the schedules taking turns in a rotated order), the
   plan's predicted step, and the speed-up over 1F1B on the same stages and over 1F1B's own plan, all from the same
   run of this script; the machine's load beside it.
2. Simulated, no runs: the bundled models on ``dgx-h100-8`` and the mixed clusters (one stage per device; ``zbv``
   and ``dualpipev`` two in a V when that simulates faster), at
   ``m = p`` and ``m = 4p``: step time, bubble (idle share of the step) and peak memory per schedule, each
   schedule's own dp plan.
3. The memory-bound case, simulated: a Llama of TinyLlama-1.1B's shape (22 layers, synthesised by ``bench/synth.py``
   from a measured 2-layer slice, ``planner.examples.hf:llama_1b_slice``), which no 16 GB device holds with Adam, on
   ``t4-2x4-eth`` (two hosts of four T4s) at m = 8: ``plan partition -d auto --schedule auto`` and the candidate of
   every schedule it weighed, each step against the work bound (all compute spread evenly over the devices, no
   bubble, no transfers: no plan is faster).
4. Recomputation where needed, simulated: the same model on the same cluster with less memory per device, planned
   with ``--recompute off``, ``on`` (every stage) and ``auto`` (only the stages that need it).

    python3 bench/schedules.py                        # everything; writes docs/bench-schedules.md and .json
    python3 bench/schedules.py --only simulated       # the simulated tables only (minutes)
    python3 bench/schedules.py --only memory-bound    # the memory-bound case (~11 min; the slice's profile is cached)
    python3 bench/schedules.py --only recompute       # recomputation where needed (seconds)
    python3 bench/schedules.py --models gpt_small --microbatches 4 --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Mapping

from _paths import REPO, slug  # first: the repository on sys.path, bench/ last (see bench/_paths.py)

from run import (CACHE, PROBES, calibrated_in_first_round, parallel_capacity, probed_cluster,  # noqa: E402
                 profile_path, run_job, steady_step_s, with_extra)

from planner.app.partition import profile_ref  # noqa: E402
from planner.clusters import load_cluster_spec  # noqa: E402
from planner.examples import BUNDLED  # noqa: E402
from planner.formats.catalog import load_catalog  # noqa: E402
from planner.formats.cluster import Cluster, load_cluster  # noqa: E402
from planner.formats.plan import ASYNC_SCHEDULES, ZERO_BUBBLE_SCHEDULES, Plan, save_plan  # noqa: E402
from planner.formats.profile import Profile, load_profile  # noqa: E402
from planner.partition import partition  # noqa: E402
from planner.partition.model.convert import build_plan, partition_of  # noqa: E402
from planner.partition.model.problem import build_problem  # noqa: E402

MEASURED_MODELS = {"gpt_small": BUNDLED["gpt_small"], "digits": "planner.examples.digits:digits_mlp"}
MEASURED_STEPS = {"gpt_small": (8, 2), "digits": (40, 10)}
"""Per measured model, steps per run and per round when ``--steps`` and ``--round-steps`` are not given. A digits step
takes milliseconds: 8 steps in rounds of 2 measured 6 of them, about 40 ms, within what the machine's jitter moves
(the step of one round of 2 ranged from 6.4 to 13 ms in one run, 2026-11-29)."""
SAME_STAGES = ("1f1b", "zb-h1", "zb-planned", "zb-h2")
"""Schedules run on the same stages, one per rank (the speed-up column compares them): the dp plan under
``STAGES_OF``."""
STAGES_OF = "zb-h2"
"""Whose dp plan gives the same stages: the zero-bubble pattern whose plans keep one stage per rank (``zb-planned``'s
own plan may be a V), so the rows ask what the schedule buys on stages cut for it. 1F1B's own plan runs beside them
(``OWN_1F1B``): what a user who keeps 1F1B gets."""
OWN_1F1B = "1f1b (own plan)"
CLUSTER = REPO / "profiles" / "clusters" / "cpu-2.json"
SIM_MODELS = ("gpt_small", "gpt_medium", "resnet_small", "unet_small", "llama_small")
SIM_CLUSTERS = ("dgx-h100-8", "mixed-a100-v100-pcie", "mixed-3type-2host")
SIM_SCHEDULES = ("1f1b", "zb-h1", "zb-planned", "zb-h2", "zbv", "dualpipev")
OWN_STAGES = ("interleaved-1f1b", "zbv", "dualpipev")
"""Measured schedules that run their own dp plan (several stages per rank), not the 1F1B plan's stages."""
DEFAULT_OUTPUT = REPO / "docs" / "bench-schedules.md"
MEMORY_BOUND = {"spec": "planner.examples.hf:llama_1b_slice", "layers": 22, "cluster": "t4-2x4-eth", "microbatches": 8}
"""The memory-bound case of issue 28: the model, its depth, the cluster and m."""


def same_stages(plan: Plan, profile: Profile, cluster: Cluster, catalog: Mapping[str, Any], schedule: str) -> Plan:
    """``plan``'s stages under ``schedule``: the problem built for that schedule, the plan's partition, its prediction
    and (zero-bubble) its ``schedule_order``, as ``plan partition`` writes them."""
    problem = build_problem(profile, cluster, microbatches=plan.microbatches, schedule=schedule,
                            optimizer=str(plan.extra.get("optimizer", "adam")), catalog=catalog)
    made = build_plan(problem, partition_of(problem, plan), method=f"{plan.method} ({plan.schedule}'s stages)",
                      profile_ref=plan.extra.get("profile"))
    return with_extra(made, device_ranks=list(plan.extra.get("device_ranks") or cluster.device_ids))


def measured(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    catalog = load_catalog()
    for name in args.models:
        spec = MEASURED_MODELS[name]
        prof = profile_path_for(name, spec, True)  # the predictions are judged: profile the machine as it is now
        cluster = load_cluster(probed_cluster(CLUSTER))  # and probe what the runtime costs per pass and message now
        profile, ref = load_profile(prof), profile_ref(prof, spec)
        for m in args.microbatches:
            def dp_plan(schedule: str, method: str = "dp") -> Plan:
                made = partition(profile, cluster, method=method, microbatches=m, schedule=schedule,
                                 optimizer="adam", profile_ref=ref, catalog=catalog)
                return with_extra(made, device_ranks=list(cluster.device_ids))

            own = dp_plan("1f1b")
            base = next((p for p in (dp_plan(STAGES_OF), own) if one_per_rank(p)), None)
            if base is None:
                print(f"{name} m={m}: dp keeps one device; the same-stages rows use time-balance's 2 stages",
                      file=sys.stderr)
                base = dp_plan("1f1b", method="time-balance")
            plans = {s: (base if s == base.schedule else same_stages(base, profile, cluster, catalog, s))
                     for s in SAME_STAGES}
            if one_per_rank(own) and [st.nodes for st in own.stages] != [st.nodes for st in base.stages]:
                plans[OWN_1F1B] = own
            not_measured: dict[str, str] = {}  # schedule -> why it has no row (the page says so)
            for schedule in OWN_STAGES:
                try:
                    made = dp_plan(schedule)
                except Exception as exc:  # noqa: BLE001 - a shape the schedule refuses is reported, not fatal
                    not_measured[schedule] = f"no plan: {exc}"
                    print(f"{schedule} on {name} m={m}: {exc}", file=sys.stderr)
                    continue
                if {st.device for st in made.stages} != set(cluster.device_ids):  # not a 2-rank run: no row
                    used = ", ".join(sorted({st.device for st in made.stages}))
                    not_measured[schedule] = f"its dp plan uses {used} only, so it is no 2-rank run"
                    print(f"{schedule} on {name} m={m}: {not_measured[schedule]}; not measured", file=sys.stderr)
                    continue
                plans[schedule] = made
            results: dict[str, Any] = {}
            capacity = parallel_capacity()
            paths = {}
            for schedule, plan in plans.items():
                paths[schedule] = CACHE / f"sched-{name}-m{m}-{slug(schedule)}.plan.json"
                save_plan(plan, paths[schedule])
                results[schedule] = {"samples": [], "calibrated_errors": [], "waits": [], "computes": [],
                                     "predicted_s": plan.step_time_s,
                                     "stages": [len(s.nodes) for s in plan.stages],
                                     "bubble": float(plan.predicted.get("bubble_fraction", 0.0)), "load": []}
            names = list(plans)
            steps, round_steps = (args.steps or MEASURED_STEPS[name][0], args.round_steps or MEASURED_STEPS[name][1])
            for rep in range(args.repeats):  # the schedules take turns, in a rotated order each time
                for schedule in names[rep % len(names):] + names[:rep % len(names)]:
                    job = run_job(paths[schedule], spec, steps, round_steps, {"rebalance": False},
                                  tag=f"sched-{name}-{m}-{slug(schedule)}")
                    results[schedule]["samples"].append(steady_step_s(job["rounds"]))
                    wait, compute = per_rank_step(job["rounds"])
                    results[schedule]["waits"].append(wait)
                    results[schedule]["computes"].append(compute)
                    calibrated, later = calibrated_in_first_round(plans[schedule], prof, "pipeline", job["rounds"])
                    results[schedule]["calibrated_errors"].append(later / calibrated - 1)
                    results[schedule]["load"] += [job["load_before"], job["load_after"]]
                    print(f"{name} m={m} {schedule}: {results[schedule]['samples'][-1]:.4f} s measured, "
                          f"{plans[schedule].step_time_s:.4f} s predicted", file=sys.stderr)
            for r in results.values():
                r["measured_s"] = statistics.median(r["samples"])
                r["calibrated_error"] = statistics.median(r["calibrated_errors"])
                r["wait_s"] = statistics.median(r["waits"])
                r["compute_s"] = statistics.median(r["computes"])
            base_s = results["1f1b"]["measured_s"]
            own_s = results.get(OWN_1F1B, results["1f1b"])["measured_s"]
            for r in results.values():
                r["speedup"] = base_s / r["measured_s"]
                r["speedup_own"] = own_s / r["measured_s"]
                r["error"] = r["measured_s"] / r["predicted_s"] - 1
            rows.append({"model": name, "microbatches": m, "schedules": results, "fresh_profile": True,
                         "pass_overhead_s": cluster.pass_overhead_s, "steps": steps, "round_steps": round_steps,
                         "schedule_runtime_pass_overhead_s": cluster.schedule_runtime_pass_overhead_s, "probes": PROBES,
                         "capacity": [capacity, parallel_capacity()], "not_measured": not_measured})
    return rows


def one_per_rank(plan: Plan) -> bool:
    """Two stages, one on each rank: what the same-stages rows need (the schedules need two stages to differ)."""
    return len(plan.stages) == len({st.device for st in plan.stages}) == 2


def bubble_bound(one_f_one_b: dict[str, Any], m: int) -> float:
    """The speed-up over 1F1B's measured step that filling its whole bubble would give: ``S / (S - (p - 1) C / m)``
    with ``S`` its measured step, ``C`` its compute per rank-step and ``p`` its stages (one per rank)."""
    step, compute, p = one_f_one_b["measured_s"], one_f_one_b["compute_s"], len(one_f_one_b["stages"])
    return step / (step - (p - 1) * compute / m)


def per_rank_step(rounds: list[dict[str, Any]]) -> tuple[float, float]:
    """Seconds per step a rank spent waiting (blocked on receives: the bubble and transfers) and computing, the mean
    over ranks and over the rounds after the first: the bubble shows in the wait, machine noise in the compute."""
    later = [r for r in rounds if r["round"] > 0] or rounds
    waits = [d["wait_s"] / r["steps"] for r in later for d in r["devices"].values()]
    computes = [d["compute_s"] / r["steps"] for r in later for d in r["devices"].values()]
    return sum(waits) / len(waits), sum(computes) / len(computes)


def profile_path_for(name: str, spec: str, reprofile: bool) -> Path:
    """The colocated one-thread profile ``bench/run.py`` measures for its models, for any factory spec."""
    import run

    run.MODELS.setdefault(name, spec)
    return profile_path(name, reprofile)


def simulated() -> list[dict[str, Any]]:
    """Each schedule's own dp plan per bundled model x cluster at m = p and m = 4p (pure pipelines)."""
    from planner.profile import profile_model

    catalog = load_catalog()
    rows = []
    for name in SIM_MODELS:
        path = CACHE / f"sim-{name}.profile.json"
        if not path.is_file():
            from planner.formats.profile import save_profile

            save_profile(profile_model(BUNDLED[name], repeats=2, warmup=1), path)
        profile = load_profile(path)
        for cluster_name in SIM_CLUSTERS:
            cluster = load_cluster_spec(cluster_name)
            p = len(cluster.devices)
            for m in (p, 4 * p):
                row: dict[str, Any] = {"model": name, "cluster": cluster_name, "devices": p, "microbatches": m,
                                       "zb_h1_closed_form": zb_h1_closed_form(profile, cluster, catalog)}
                for schedule in SIM_SCHEDULES:
                    try:
                        plan = partition(profile, cluster, method="dp", microbatches=m, schedule=schedule,
                                         optimizer="adam", catalog=catalog)
                    except Exception as exc:  # noqa: BLE001 - recorded in the table
                        row[schedule] = {"error": str(exc).splitlines()[0][:80]}
                        continue
                    devices = plan.predicted.get("devices", {})
                    row[schedule] = {"step_s": plan.step_time_s, "stages": len(plan.stages),
                                     "bubble": float(plan.predicted.get("bubble_fraction", 0.0)),
                                     "idle_s": max(float(d.get("idle_s", 0.0)) for d in devices.values()),
                                     "peak_bytes": max(int(d.get("peak_memory_bytes", 0)) for d in devices.values())}
                rows.append(row)
    return rows


def zb_h1_closed_form(profile: Any, cluster: Any, catalog: Any) -> float:
    """The paper's ZB-H1 idle time over 1F1B's on equal stages, ``(F + I - W) / (F + I + W)`` (docs/zero-bubble.md),
    with the whole model's forward, input-gradient and weight-gradient seconds on the cluster's first device: a
    third only where the three are equal."""
    from planner.partition.model.problem import build_problem

    tables = build_problem(profile, cluster, microbatches=len(cluster.devices), schedule="zb-h1", optimizer="adam",
                           catalog=catalog).tables
    device = cluster.devices[0].id
    f, b, w = (tables.fwd_prefix[device][-1], tables.bwd_prefix[device][-1], tables.weight_prefix[device][-1])
    return (f + b - 2 * w) / (f + b)


def deep_profile(reprofile: bool) -> Path:
    """The memory-bound case's model (``MEMORY_BOUND``): its measured 2-layer slice (cached) synthesised to full depth."""
    from synth import synthesize

    from planner.formats.profile import save_profile

    case = MEMORY_BOUND
    slice_path = CACHE / "llama_1b_slice.profile.json"
    if reprofile or not slice_path.is_file():
        from planner.profile import profile_model

        save_profile(profile_model(case["spec"], repeats=3, warmup=1, estimate=("t4",), estimate_precision="fp32"),
                     slice_path)
    deep = CACHE / f"llama_1b_{case['layers']}L.profile.json"
    save_profile(synthesize(load_profile(slice_path), case["layers"]), deep)
    return deep


RECOMPUTE_MEMORY_GIB = (4.0, 3.5, 3.4, 3.25)
"""Per-device memory of the recomputation section: from room for a plan without recomputation down to where only
recomputation fits (the model's weights, gradients and Adam state over 8 devices take about 2 GiB each)."""


def recompute_section(reprofile: bool) -> dict[str, Any]:
    """Recomputation where needed: the memory-bound model on ``MEMORY_BOUND``'s cluster with less memory per device,
    planned (dp, layer cuts, one pipeline, m = 8) with ``--recompute off``, ``on`` (every stage) and ``auto`` (only the
    stages that need it, when nothing fits without)."""
    from dataclasses import replace

    from planner.app.partition import partition_file
    from planner.errors import InfeasibleError
    from planner.formats.cluster import save_cluster

    case, deep = MEMORY_BOUND, deep_profile(reprofile)
    base = load_cluster_spec(case["cluster"])
    rows = []
    for gib in RECOMPUTE_MEMORY_GIB:
        devices = tuple(replace(d, memory_bytes=int(gib * 2**30)) for d in base.devices)
        path = save_cluster(replace(base, name=f"{base.name}-{gib}g", devices=devices),
                            CACHE / f"recompute-{gib}g.cluster.json")
        for schedule in ("gpipe", "1f1b"):
            row: dict[str, Any] = {"memory_gib": gib, "schedule": schedule}
            for mode in ("off", "on", "auto"):
                try:
                    plan = partition_file(deep, str(path), None, method="dp", microbatches=case["microbatches"],
                                          schedule=schedule, data_parallel=1, granularity="layer", recompute=mode)
                except InfeasibleError:
                    row[mode] = None
                    continue
                row[mode] = {"step_s": plan.step_time_s, "stages": len(plan.stages),
                             "recomputing": sum(plan.recomputed()), "peak_bytes": plan.peak_memory_bytes}
            rows.append(row)
    return {"rows": rows}


def memory_bound(reprofile: bool) -> dict[str, Any]:
    """The memory-bound case (``MEMORY_BOUND``): ``plan partition --schedule auto -d auto``, and every schedule's
    candidate it weighed (``choices``): shape, step, fullest device and step over the work bound."""
    from planner.app.partition import partition_file

    case = MEMORY_BOUND
    deep = deep_profile(reprofile)
    profile = load_profile(deep)
    params = sum(n.param_bytes for n in profile.nodes)  # bytes, fp32: 4 a parameter; with gradients and Adam, 16
    cluster = load_cluster_spec(case["cluster"])
    memory = min(d.memory_bytes for d in cluster.devices)
    began = time.perf_counter()
    plan = partition_file(deep, case["cluster"], CACHE / "memory-bound-auto.plan.json", method="dp",
                          microbatches=case["microbatches"], schedule="auto", data_parallel="auto")
    planning_s = time.perf_counter() - began
    devices = plan.predicted.get("devices", {})
    bound_s = sum(float(d.get("busy_s", 0.0)) for d in devices.values()) / len(devices)  # identical devices
    rows = [{"schedule": c["schedule"], "stages": c["stages"], "degree": c["degree"], "step_s": c["step_time_s"],
             "bound_s": bound_s, "peak_bytes": c["peak_memory_bytes"], "recompute": c.get("recompute", False),
             "chosen": c["schedule"] == plan.schedule}
            for c in plan.extra["choices"]["candidates"]]
    return {"params": params // 4, "static_bytes": params * 4, "device_memory_bytes": memory, "rows": rows,
            "planning_s": planning_s, "devices": len(devices),
            "zb_h1_closed_form": zb_h1_closed_form(profile, cluster, load_catalog())}


def render(results: dict[str, Any]) -> str:
    lines = ["# Schedules benchmark: 1F1B, interleaved 1F1B and the zero-bubble schedules", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch "
             f"{__import__('torch').__version__}. Each section names the command that made it and when it finished. "
             f"Generated by bench/schedules.py; do not edit by hand.", ""]
    if results.get("measured"):
        lines += ["## 1. Measured on 2 CPU ranks (gloo, one intra-op thread each)", "", _made_rows(results["measured"]), "",
                  f"Same stages for 1F1B, zb-h1, zb-planned and zb-h2: the dp plan under {STAGES_OF}, one stage per "
                  "rank, cut for a zero-bubble schedule (where that plan keeps one device, 1F1B's dp plan, or the "
                  "time-balance baseline's 2 stages where that does too: see *nodes per stage*). "
                  f"*{OWN_1F1B}*: 1F1B's own dp plan, where its stages differ, what a user who keeps 1F1B gets. "
                  "Interleaved 1F1B, zbv and dualpipev run their own dp plans, several stages per rank where that "
                  "simulates faster (round-robin, in a V). "
                  "Plans come from the model's colocated one-thread profile (bench/run.py's), which the script takes "
                  "afresh when a model's rows begin, so the predictions meet the machine as it is that hour, with "
                  "`cpu-2`'s loopback link and runtime figures probed then (`plan profile --probe-links`, bench/run.py "
                  "`probed_cluster`; the line above says which rows were planned from an older, cached profile or "
                  "on the bundled figures). "
                  "*measured*: the median of the runs listed under *runs* (each the "
                  "mean step over its rounds after the first; the schedules took turns). "
                  "*speed-up*: 1F1B's measured step over the row's, same run of the script: 1F1B on the same stages, "
                  "and 1F1B on its own plan. *calibrated*: the plan "
                  "re-simulated with each rank's compute factor measured in the run's first round after the warm-up, "
                  "against the mean step of the rounds after it (what `plan run` reports; median over the runs). "
                  "*wait / compute*: per rank and step, the time blocked on receives (the bubble and transfers) and "
                  "computing (median over the runs): the schedule shows in the wait; other jobs on the machine show in "
                  "the compute. "
                  "*error*: measured over predicted. Load: the 1-minute load average before/after the row's run "
                  "(2.0 = both cores busy). Capacity: how many cores two single-threaded processes got side by side "
                  "just before and after the model's runs (2.0 = two free cores).", "",
                  "| model | m | schedule | nodes per stage | predicted (s) | measured (s) | runs (s) | error | "
                  "calibrated error | speed-up vs 1F1B, same stages | vs 1F1B's own plan | "
                  "wait / compute per rank-step (s) | load (min-max) |",
                  "|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
        for row in results["measured"]:
            for schedule, r in row["schedules"].items():
                runs = ", ".join(f"{x:.4f}" for x in r.get("samples", [r["measured_s"]]))
                lines.append(f"| {row['model']} | {row['microbatches']} | {schedule} | {r['stages']} | "
                             f"{r['predicted_s']:.4f} | {r['measured_s']:.4f} | {runs} | {r['error']:+.1%} | "
                             f"{r.get('calibrated_error', float('nan')):+.1%} | "
                             f"{r['speedup']:.2f}x | " + (f"{r['speedup_own']:.2f}x" if "speedup_own" in r else "")
                             + f" | {r.get('wait_s', float('nan')):.4f} / {r.get('compute_s', float('nan')):.4f} | "
                             f"{min(r['load']):.2f}-{max(r['load']):.2f} |")
        caps = "; ".join(f"{row['model']} m={row['microbatches']}: {row['capacity'][0]:.2f}, {row['capacity'][1]:.2f}"
                         for row in results["measured"])
        lines += ["", f"Capacity: {caps}.", ""]
        missing = [f"{row['model']} m={row['microbatches']} {schedule}: "
                   + row.get("not_measured", {}).get(schedule, "the row predates the record of why")
                   for row in results["measured"] for schedule in OWN_STAGES if schedule not in row["schedules"]]
        if missing:
            lines += [f"Not measured: {'; '.join(missing)}.", ""]
        fours = [row for row in results["measured"] if row["microbatches"] == 4]
        if fours:
            lines += ["Best zero-bubble speed-up at 4 micro-batches (target >= 1.10x torch's 1F1B on the same stages, "
                      "the bubble bound being 1.25x, predicted within 10%): " + "; ".join(
                          _best_line(row) for row in fours) + ". The most a schedule gains by filling 1F1B's "
                      "bubble, from 1F1B's measured step S and compute C per rank-step: S / (S - (p - 1) C / m), each "
                      "rank idle for (p - 1) of its m micro-batches' passes; the rest of the step (messages, the "
                      "runtime's own work per pass) no schedule removes, and the zero-bubble ones add passes (I and W "
                      "apart).", ""]
    if results.get("simulated"):
        lines += ["## 2. Simulated (no runs): each schedule's own dp plan, one stage per device (zbv, dualpipev: two in "
                  "a V where that is faster)", "",
                  _made(results, "simulated"), "", "Step time, bubble (idle share of the step, averaged over devices), the most idle time of one "
                  "device, and the fullest device's peak memory. Profiles measured on this CPU; the clusters' GPU "
                  "times are the roofline's estimates (docs/profiling.md).", "",
                  "| model | cluster | m | schedule | stages | step (ms) | bubble | most idle (ms) | peak memory (MiB) "
                  "| vs 1F1B |", "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for row in results["simulated"]:
            base = row.get("1f1b", {}).get("step_s")
            for schedule in SIM_SCHEDULES:
                r = row.get(schedule, {})
                if "error" in r or not r:
                    lines.append(f"| {row['model']} | {row['cluster']} | {row['microbatches']} | {schedule} | "
                                 f"| | | | | {r.get('error', 'not run')} |")
                    continue
                gain = f"{base / r['step_s']:.2f}x" if base else ""
                lines.append(f"| {row['model']} | {row['cluster']} | {row['microbatches']} | {schedule} | "
                             f"{r['stages']} | {r['step_s'] * 1e3:.3f} | {r['bubble']:.1%} | {r['idle_s'] * 1e3:.3f} | "
                             f"{r['peak_bytes'] / 2**20:.1f} | {gain} |")
        lines.append("")
        lines += _sim_summary(results["simulated"])
    if results.get("memory_bound"):
        case, mb = MEMORY_BOUND, results["memory_bound"]
        lines += ["## 3. The memory-bound case (simulated)", "", _made(results, "memory-bound"), "",
                  f"A Llama of TinyLlama-1.1B's shape, {case['layers']} layers synthesised from the measured 2-layer "
                  f"slice `{case['spec']}` (bench/synth.py; T4 times from the roofline): {mb['params'] / 1e9:.2f}B "
                  f"parameters, {mb['static_bytes'] / 2**30:.1f} GiB of weights, gradients and Adam state against "
                  f"{mb['device_memory_bytes'] / 2**30:.0f} GiB per device, so no device holds it alone. Cluster "
                  f"`{case['cluster']}`, m = {case['microbatches']}: `plan partition --method dp -d auto --schedule "
                  f"auto`, whose candidates (each schedule's fastest shape that fits) are the rows; it chose the one "
                  f"marked, in {mb['planning_s']:.0f} s. *Work bound*: the plan's compute spread evenly over the "
                  f"{mb['devices']} devices with no bubble and no transfers, which no plan beats. The asynchronous schedules have no "
                  f"flush between steps and train on stale weights (docs/async.md); name a flushing schedule to keep "
                  f"synchronous training.", "",
                  "| schedule | stages x replicas | step (s) | work bound (s) | step / bound | fullest device (GiB) "
                  "| chosen |", "|---|---|---:|---:|---:|---:|---|"]
        for r in mb["rows"]:
            again = int(r["recompute"])  # recomputing stages (true: every stage, in results of earlier versions)
            note = "" if not again else " (recompute)" if again is True or again >= r["stages"] else \
                f" (recompute in {again})"
            lines.append(f"| {r['schedule']} | {r['stages']} x {r['degree']}{note} "
                         f"| {r['step_s']:.3f} | {r['bound_s']:.3f} | {r['step_s'] / r['bound_s']:.2f}x | "
                         f"{r['peak_bytes'] / 2**30:.2f} | {'yes' if r['chosen'] else ''} |")
        flushing = [r for r in mb["rows"] if r["schedule"] not in ASYNC_SCHEDULES]
        best = min(flushing, key=lambda r: r["step_s"])
        one = next((r for r in mb["rows"] if r["schedule"] == "1f1b"), None)
        if one:
            lines += ["", f"1F1B: {one['step_s'] / one['bound_s']:.2f}x the work bound; the fastest flushing "
                      f"schedule, {best['schedule']}: {best['step_s'] / best['bound_s']:.2f}x (target: at most 1.5x)."]
        if "zb_h1_closed_form" in mb:
            lines += ["", f"zb-h1's closed form on equal stages for this model, (F + I - W) / (F + I + W) with its F, I "
                      f"and W on these devices: {mb['zb_h1_closed_form']:.2f} of 1F1B's idle time (the paper's third "
                      f"needs W >= (F + I) / 2; its normalisations, rotary embedding, SwiGLU products and residual "
                      f"adds have no W, as in section 2)."]
        lines.append("")
    if results.get("recompute"):
        lines += ["## 4. Recomputation where needed (simulated)", "", _made(results, "recompute"), "",
                  f"The model of section 3 on `{MEMORY_BOUND['cluster']}` with less memory per device: `plan partition "
                  f"--method dp -d 1 --granularity layer -n {MEMORY_BOUND['microbatches']} --recompute off|on|auto`. "
                  f"*on* recomputes in every stage; *auto* only in the stages whose devices cannot hold their saved "
                  f"activations, when nothing fits without it or when that beats the plan without "
                  f"(docs/cost-model.md, \"Recomputation\"). "
                  f"Each cell: predicted step (s), stages recomputing of all, fullest device (GiB).", "",
                  "| memory per device (GiB) | schedule | off | on (every stage) | auto | off / auto | on / auto |",
                  "|---:|---|---|---|---|---:|---:|"]

        def cell(c: dict[str, Any] | None) -> str:
            return "does not fit" if c is None else \
                f"{c['step_s']:.3f} ({c['recomputing']}/{c['stages']}, {c['peak_bytes'] / 2**30:.2f})"

        def ratio(c: dict[str, Any] | None, auto: dict[str, Any] | None) -> str:
            return f"{c['step_s'] / auto['step_s']:.2f}x" if c and auto else "-"

        for r in results["recompute"]["rows"]:
            lines.append(f"| {r['memory_gib']} | {r['schedule']} | {cell(r['off'])} | {cell(r['on'])} | "
                         f"{cell(r['auto'])} | {ratio(r['off'], r['auto'])} | {ratio(r['on'], r['auto'])} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _best_line(row: dict[str, Any]) -> str:
    """One model's best zero-bubble speed-ups at 4 micro-batches: over 1F1B on the same stages (a row of
    ``SAME_STAGES``), and over 1F1B's own plan (any zero-bubble row; rows measured before 1F1B's own plan ran
    beside them had the two the same)."""
    rows = row["schedules"]
    same = max(((r["speedup"], s) for s, r in rows.items() if s in SAME_STAGES and s != "1f1b"), default=None)
    own = max(((r.get("speedup_own", r["speedup"]), s) for s, r in rows.items() if s in ZERO_BUBBLE_SCHEDULES),
              default=None)
    parts = [f"{row['model']}: "]
    if same:
        parts.append(f"{same[0]:.2f}x on the same stages ({same[1]}, measured {rows[same[1]]['error']:+.1%} against "
                     f"its prediction)")
    if own:
        parts.append(f", {own[0]:.2f}x over 1F1B's own plan ({own[1]}, {rows[own[1]]['error']:+.1%})")
    bound = bubble_bound(rows["1f1b"], row["microbatches"])
    return "".join(parts) + f"; removing 1F1B's whole bubble would give at most {bound:.2f}x"


def _made(results: dict[str, Any], section: str) -> str:
    """Which command made a section and when."""
    made = results["sections"][section]
    return f"Reproduce: `{made['command']}`, finished {made['finished']}."


def _made_rows(rows: list[dict[str, Any]]) -> str:
    """Which command made which measured rows, and when."""
    groups: dict[tuple[str, str, bool], list[str]] = {}
    for row in rows:
        made = row["made"]
        probed = " and the bundled cpu-2's runtime figures"
        if "pass_overhead_s" in row:
            probes = f"the median of {row['probes']} probes, " if row.get("probes", 1) > 1 else ""
            probed = f" and the runtime probed with it ({probes}{row['pass_overhead_s'] * 1e6:.0f} us per pass"
            if row.get("schedule_runtime_pass_overhead_s"):
                probed += f", {row['schedule_runtime_pass_overhead_s'] * 1e6:.0f} us under torch's schedule runtime"
            probed += ")"
        if "steps" in row:
            probed += f"; runs of {row['steps']} steps in rounds of {row['round_steps']}"
        groups.setdefault((made["command"], made["finished"], bool(row.get("fresh_profile")), probed), []).append(
            f"{row['model']} m={row['microbatches']}")
    source = {True: "planned from a profile taken when the model's rows began",
              False: "planned from the profile bench/run.py had cached then"}
    return " ".join(f"{', '.join(names)}: `{cmd}`, finished {when}, {source[fresh]}{probed}."
                    for (cmd, when, fresh, probed), names in groups.items())


def _sim_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The criteria of docs/zero-bubble.md, read off the simulated rows: the planner's own order against torch's best
    fixed pattern (the fastest of zb-h1, zbv and dualpipev) on every row, and the most idle device at m = p."""
    def fixed_s(row: dict[str, Any]) -> float:
        return min(row[s]["step_s"] for s in ("zb-h1", "zbv", "dualpipev") if "step_s" in row.get(s, {}))

    rated = [r for r in rows if "step_s" in r.get("zb-planned", {}) and "step_s" in r.get("zb-h1", {})]
    slower = [(r["model"], r["cluster"], r["microbatches"]) for r in rated
              if r["zb-planned"]["step_s"] > fixed_s(r) * (1 + 1e-9)]
    faster = [r for r in rated if r["zb-planned"]["step_s"] < fixed_s(r) * (1 - 1e-9)]
    faster_mixed = [r for r in faster if r["cluster"].startswith("mixed")]
    mixed = [r for r in rows if r["cluster"].startswith("mixed")]
    at_p = [r for r in rows if r["cluster"] == "dgx-h100-8" and r["microbatches"] == r["devices"]
            and r.get("1f1b", {}).get("idle_s")]
    ratios = {s: [r[s]["idle_s"] / r["1f1b"]["idle_s"] for r in at_p if "idle_s" in r.get(s, {})]
              for s in ("zb-h1", "zb-h2", "zbv", "dualpipev")}
    out = [f"zb-planned against torch's best fixed order on the same problem (the fastest of zb-h1, zbv and dualpipev): "
           f"slower on "
           f"{', '.join(map(str, slower)) or 'no row'}; faster on {len(faster)} of {len(rated)} rows, "
           f"{len(faster_mixed)} of {len(mixed)} on the mixed clusters."]
    if ratios["zb-h1"]:
        out.append(f"dgx-h100-8 at m = p, the most idle device over 1F1B's (each schedule's own plan): zb-h1 "
                   f"{', '.join(f'{x:.2f}' for x in ratios['zb-h1'])}; zb-h2 "
                   f"{', '.join(f'{x:.2f}' for x in ratios['zb-h2'])}; zbv "
                   f"{', '.join(f'{x:.2f}' for x in ratios['zbv'])}; dualpipev "
                   f"{', '.join(f'{x:.2f}' for x in ratios['dualpipev'])}. The paper's 1/3 for zb-h1 holds when F, I and "
                   f"W take equal time; no flushing order with one stage per device goes below F / (F + B) "
                   f"(docs/zero-bubble.md).")
        closed = [(r["model"], r["zb_h1_closed_form"]) for r in at_p if "zb_h1_closed_form" in r]
        if closed:
            out.append(f"The paper's closed form for zb-h1 on equal stages, (F + I - W) / (F + I + W) with each model's "
                       f"F, I and W on H100 (the roofline's estimates): "
                       f"{', '.join(f'{model} {x:.2f}' for model, x in closed)}. These models' weight gradients take "
                       f"less time than their forwards and input gradients (attention, normalisation, activations "
                       f"and pooling have no W), so no zb-h1 order reaches a third of 1F1B's idle time on them; the "
                       f"simulator meets the closed form on equal stages with F = I = W "
                       f"(tests/test_zero_bubble.py). The ratios above are higher still: each schedule's own plan "
                       f"has uneven stages and transfers.")
    return out + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("measured", "simulated", "memory-bound", "recompute"), action="append")
    parser.add_argument("--models", nargs="+", default=list(MEASURED_MODELS), choices=sorted(MEASURED_MODELS))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--steps", type=int, help="Measured: steps per run (default: MEASURED_STEPS, per model).")
    parser.add_argument("--repeats", type=int, default=3, help="Measured: runs per schedule, taking turns.")
    parser.add_argument("--round-steps", type=int, help="Measured: steps per round (default: MEASURED_STEPS).")
    parser.add_argument("--reprofile", action="store_true")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT))
    args = parser.parse_args()
    only = set(args.only or ("measured", "simulated", "memory-bound", "recompute"))
    CACHE.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.output).with_suffix(".json")
    results: dict[str, Any] = json.loads(json_path.read_text()) if json_path.is_file() else {}
    made = {"command": "python3 bench/schedules.py " + " ".join(sys.argv[1:]), "finished": "?"}
    if "simulated" in only:
        results["simulated"] = simulated()
    if "memory-bound" in only:
        results["memory_bound"] = memory_bound(args.reprofile)
    if "recompute" in only:
        results["recompute"] = recompute_section(args.reprofile)
    if "measured" in only:  # rows of models and counts not run now are kept, each with the command that made it
        new = measured(args)
        for row in new:
            row["made"] = made
        fresh = {(r["model"], r["microbatches"]) for r in new}
        results["measured"] = sorted([r for r in results.get("measured", []) if (r["model"], r["microbatches"]) not in
                                      fresh] + new, key=lambda r: (list(MEASURED_MODELS).index(r["model"]),
                                                                   r["microbatches"]))
    made["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())  # also in the new measured rows
    for section in only - {"measured"}:  # measured rows each carry their own
        results.setdefault("sections", {})[section] = made
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    Path(args.output).write_text(render(results))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
