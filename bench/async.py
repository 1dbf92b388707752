"""Benchmark of the asynchronous pipeline (docs/async.md) the way its paper judges it: throughput against model
parallelism and a flushing pipeline, and time to a target at equal final accuracy.

2 CPU ranks, a 2-stage pipeline (``plan partition -d 1``, each schedule planned by the default placer):

- throughput: ``gpt_small`` (synthetic tokens) and ``digits_cnn`` (scikit-learn's digits) at 4 and 8
  micro-batches; plain model parallelism (1f1b's two stages with one micro-batch of all the step's rows, GPipe
  order, run with ``--microbatch-size``), torch's ``Schedule1F1B`` (flushes every step), ``async-1f1b`` and ``2bw``, each with
  and without the correction. Samples per second from the steady step time, against the plan's prediction (planned
  on ``cpu-2`` with its loopback link and the runtime's cost per pass probed when the section starts:
  ``run.probed_cluster``);
- convergence: ``digits_cnn`` (Adam lr 1e-3, target 95% validation accuracy, 300 steps) and ``gpt_bytes`` on
  the standard library's bytes (Adam lr 3e-3, target validation loss 3.0, 400 steps: the runs' final loss is taken
  where the seeds have left the plateau at the target, not on it) at 4 micro-batches,
  1f1b against the asynchronous schedules with and without the correction and async-1f1b after a synchronous
  warm-up of 50 steps (``--async-warmup 50``, the default) and of 20, 9 seeds (``--seeds``), schedules interleaved;
  and a control, the same engine synchronous throughout (a warm-up longer than the run), which splits a lead over
  1F1B into what the engine's cost per pass gives and what the asynchrony gives.
- time to target over more seeds: 1f1b, the control and the two warm-ups only, 16 seeds (``--sooner-seeds``), each
  run stopping at the target (``--stop-at-target``), so many seeds cost what a few full runs do: a lead of a few
  percent shows against the spread between identical runs, which a handful of seeds does not narrow enough.
- the rule alone: the engine's update rule in one process (``train_async_reference``, which the distributed run
  equals: ``tests/test_async.py``; on the text runs here, every seed's final loss to the last digit shown) on
  ``gpt_bytes`` for longer and at a lower learning rate, every variant, 6 seeds (``--rule-seeds``): the final loss,
  and the step at which the target is first reached. No timing, so these carry no noise from the machine: what
  separates two variants of one seed is their rule.

Writes docs/bench-async.md, docs/bench-async.json and docs/img/async-*.png (``plan curves``); the 1-minute load
average is recorded around every run.

    python3 bench/async.py                           # everything (about 3 hours)
    python3 bench/async.py --only throughput         # 3 runs of each schedule (about 25 minutes; --repeats,
                                                     # --models, --microbatches)
    python3 bench/async.py --only convergence --data text   # text's convergence, 9 seeds of 400 steps (about an hour)
    python3 bench/async.py --only sooner             # time to target over 16 seeds, both data sets (about 30 min)
    python3 bench/async.py --only rule               # the rule alone, offline, on both cores (about 30 minutes)
    python3 bench/async.py --render                  # the page again from docs/bench-async.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _paths import REPO  # first: the repository on sys.path
from learning import median_of_all, plan_cli, train
from run import CLUSTER, per_step, probed_cluster  # bench/run.py: per-device seconds per step; cpu-2, probed now
from planner.formats.plan import ASYNC_SCHEDULES, DEFAULT_ASYNC_WARMUP, load_plan
from planner.report.replay import simulate_plan
from planner.runtime.options import Target, parse_target

WORK = REPO / "bench" / ".cache" / "async"
OUTPUT = REPO / "docs" / "bench-async.md"
RESULTS = REPO / "docs" / "bench-async.json"
IMAGES = REPO / "docs" / "img"

SPEED = {
    "gpt_small": {"model": "planner.examples.gpt:gpt_small", "data": None, "steps": 30, "lr": 0.001, "rows": 4},
    "digits_cnn": {"model": "planner.examples.digits:digits_cnn", "data": "planner.data.digits:batches", "steps": 100,
                   "lr": 0.001, "rows": 16},
}
LEARN = {
    "digits": {"model": "planner.examples.digits:digits_cnn", "data": "planner.data.digits:batches", "steps": 300,
               "lr": 0.001, "target": "accuracy=0.95", "metric": "accuracy", "eval_every": 10},
    "text": {"model": "planner.examples.gpt:gpt_bytes", "data": "planner.data.text:batches", "steps": 400,
             "lr": 0.003, "target": "loss=3.0", "metric": "loss", "eval_every": 10},
}
WARMUP = DEFAULT_ASYNC_WARMUP
"""The synchronous warm-up of the variants that have one: ``plan partition``'s default."""
SHORT_WARMUP = 20
"""A shorter warm-up, timed beside the default: on text most seeds reach the target within the default's
synchronous steps, so a shorter one overlaps more of the steps before it; the rule alone after 20 reaches the target
at 1F1B's evaluation (the rule section's *target at step*, docs/async.md "Measured")."""
SYNCHRONOUS = "async-1f1b, synchronous throughout"
"""The control of the convergence runs: the engine that runs async-1f1b, with a warm-up longer than the run, so every
step drains as 1F1B's does and no gradient is late. Against torch's 1F1B it shows what the engine's own cost per pass
does to the time to target; against the warm-up rows, what the asynchrony does (docs/async.md, "Measured")."""
ALL_STEPS = 1_000_000
"""A synchronous warm-up no run here reaches the end of."""
VARIANTS = {  # name -> (schedule, correction, plain model parallelism, synchronous warm-up steps)
    "model parallel": ("1f1b", "predict", True, 0),
    "1f1b": ("1f1b", "predict", False, 0),
    "async-1f1b": ("async-1f1b", "predict", False, 0),
    "async-1f1b, no correction": ("async-1f1b", "none", False, 0),
    "2bw": ("2bw", "predict", False, 0),
    "2bw, no correction": ("2bw", "none", False, 0),
    "async-1f1b, warm-up 50": ("async-1f1b", "predict", False, WARMUP),
    "async-1f1b, warm-up 20": ("async-1f1b", "predict", False, SHORT_WARMUP),
    SYNCHRONOUS: ("async-1f1b", "predict", False, ALL_STEPS),
    "async-1f1b, receives ahead": ("async-1f1b", "predict", False, 0),
}
"""The timed runs' variants. The asynchronous ones but the last run with no synchronous warm-up (``--async-warmup
0``): the rule from the first step; the *warm-up N* ones run their first N steps synchronously (docs/async.md, "The
synchronous warm-up")."""
RUN_FLAGS = {"async-1f1b, receives ahead": ["--async-receives", "ahead"]}
"""Variants that differ in how ``plan run`` runs the same plan, not in the plan: timed only (they train alike)."""
SPEED_VARIANTS = [v for v, (_, _, _, warmup) in VARIANTS.items() if not warmup]
"""The throughput runs' variants: the asynchronous steady state (a warm-up would only add 1F1B's steps)."""
LEARN_VARIANTS = [v for v in VARIANTS if v != "model parallel" and v not in RUN_FLAGS]
WARM_VARIANTS = {"async-1f1b, no correction, warm-up 50": ("async-1f1b", "none", False, WARMUP),
                 "async-1f1b, warm-up 10": ("async-1f1b", "predict", False, 10)}
"""Variants of the rule alone only."""
SOONER_VARIANTS = ["1f1b", SYNCHRONOUS, "async-1f1b, warm-up 50", "async-1f1b, warm-up 20"]
"""The variants timed to the target over more seeds (``sooner``): 1F1B, the control and the two warm-ups."""
ROUND_STEPS = 10
"""Steps per round, in the throughput and the convergence runs alike: the asynchronous schedules drain the pipeline
once per round, and the convergence runs evaluate at round ends, every 10 steps."""
MICROBATCHES = (4, 8)
PER_STEP = ("compute_s", "update_s", "recv_s")
"""Each rank's seconds per step the throughput rows keep from the round logs: its passes, its optimizer updates, and
its waits on receives (bench/run.py ``per_step``)."""
JITTERED = "1f1b, start jittered"
"""The offline sections' control: synchronous training from initial weights each moved by one part in a million,
how far a seed's final loss goes when nothing but rounding-sized noise changes."""
RULE_VARIANTS = [*(v for v in LEARN_VARIANTS if v != SYNCHRONOUS), *WARM_VARIANTS, JITTERED]
RULE_SETTINGS = ((400, 0.003), (200, 0.0015))
"""(steps, Adam's learning rate) of the offline sections: the text convergence runs' setting (400 steps at 3e-3; until
2026-11-29 they ran 200, and this section ran twice their steps), and 200 steps at half their rate."""


def _tag(*parts: Any) -> str:
    return "-".join(str(p).replace(" ", "").replace(",", "") for p in parts)


def make_plan(profile: Path, name: str, microbatches: int, variant: str, fresh: bool = False,
              cluster: str = "cpu-2") -> Path:
    """The variant's plan (made again from ``profile`` when ``fresh``, else kept if made before); plain model
    parallelism is 1f1b's two stages as they are (make that plan first) with one micro-batch under GPipe (forward
    through both stages, then backward; the placer, asked for one micro-batch, keeps small models on one
    device, and torch's 1F1B needs a micro-batch per stage). ``cluster``: the bundled name or a cluster file."""
    schedule, correction, plain, warmup = VARIANTS[variant]
    out = WORK / f"{_tag(name, microbatches, variant)}-plan.json"
    if plain:
        flushing = json.loads(make_plan(profile, name, microbatches, "1f1b", cluster=cluster).read_text())
        out.write_text(json.dumps({**flushing, "schedule": "gpipe", "microbatches": 1}))  # 1F1B needs m >= p
    elif fresh or not out.exists():
        drains = (["--round-steps", str(ROUND_STEPS), "--async-warmup", str(warmup)] if schedule in ASYNC_SCHEDULES
                  else [])
        plan_cli("partition", str(profile), "--cluster", cluster, "-d", "1", "-n", str(microbatches),
                 "-s", schedule, "--async-correction", correction, *drains, "-o", str(out), "--json", work=WORK)
    return out


def profile_of(name: str, model: str, fresh: bool = False) -> Path:
    """The model's profile (cached unless ``fresh``), timed as each rank runs: one intra-op thread, beside the other
    rank's process (``--colocate 2``)."""
    out = WORK / f"{name}-profile.json"
    if fresh or not out.exists():
        plan_cli("profile", model, "--threads", "1", "--colocate", "2", "-o", str(out), "--json", work=WORK)
    return out


def throughput(results: dict[str, Any], repeats: int, models: list[str],
               microbatches: tuple[int, ...] = MICROBATCHES) -> None:
    for name, spec in SPEED.items():
        if name not in models:
            continue
        profile = profile_of(name, spec["model"], fresh=True)  # the predictions are judged: time the machine as it is
        cluster = probed_cluster()  # and what the runtime costs per pass and message on it now
        probed = json.loads(cluster.read_text())["runtime"]
        for m in microbatches:
            first = sorted(SPEED_VARIANTS, key=lambda v: VARIANTS[v][2])  # plain model parallelism reuses 1f1b's new plan
            plans = {variant: make_plan(profile, name, m, variant, fresh=not VARIANTS[variant][2], cluster=str(cluster))
                     for variant in first}
            runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in SPEED_VARIANTS}
            for repeat in range(repeats):
                for variant in SPEED_VARIANTS:  # the variants take turns, so drift in the machine's speed hits them alike
                    plain = VARIANTS[variant][2]
                    extra = (["--microbatch-size", str(spec["rows"] * m)] if plain else []) + RUN_FLAGS.get(variant, [])
                    tag = _tag("speed", name, m, variant, f"r{repeat}")
                    print(f"{tag} ...", file=sys.stderr, flush=True)
                    done = train(tag, plans[variant], spec, *extra, work=WORK, round_steps=ROUND_STEPS)
                    rounds = [json.loads(line) for line in (WORK / f"{tag}.jsonl").read_text().splitlines()]
                    runs[variant].append({**done, **{f: per_step(rounds, f) for f in PER_STEP}})
            rows = {}
            samples = spec["rows"] * m
            for variant, done in runs.items():
                run = sorted(done, key=lambda r: r["step_time_s"])[(len(done) - 1) // 2]  # the median (lower of two)
                predicted = json.loads(plans[variant].read_text())["predicted"]["step_time_s"]
                rows[variant] = {"step_time_s": run["step_time_s"], "samples_per_s": samples / run["step_time_s"],
                                 "runs_s": [r["step_time_s"] for r in done],
                                 **{f: {d: statistics.median(r[f][d] for r in done) for d in done[0][f]}
                                    for f in PER_STEP},
                                 "predicted_samples_per_s": None if VARIANTS[variant][2] else samples / predicted,
                                 "load": [min(r["load"][0] for r in done), max(r["load"][1] for r in done)],
                                 "command": run["command"], "async": run.get("async"),
                                 "predicted_steady_step_s": _steady_step_s(plans[variant])}
            results[f"throughput/{name}/{m}"] = {"model": name, "microbatches": m, "rows": rows,
                                                 "round_steps": ROUND_STEPS, "date": time.strftime("%Y-%m-%d"),
                                                 "pass_overhead_s": probed["pass_overhead_s"]}


def _steady_step_s(plan_path: Path) -> float | None:
    """An asynchronous plan's step simulated with no drain at all (the steady state), beside its prediction for the
    run's rounds, each of which drains once; None for a flushing schedule."""
    plan = load_plan(plan_path)
    if plan.schedule not in ASYNC_SCHEDULES:
        return None
    record = {k: v for k, v in (plan.extra.get("async") or {}).items() if k != "drain_every"}
    return simulate_plan(dataclasses.replace(plan, extra={**plan.extra, "async": record})).step_time_s


def _learn_runs(name: str, seeds: int, variants: list[str], prefix: str, *extra: str,
                reuse: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Each of ``variants``' timed runs on ``LEARN[name]`` for ``seeds`` seeds, seeds and variants interleaved (so load
    drift hits them alike), with ``extra`` options, by variant; ``reuse``: the runs' summaries kept in the work
    directory (``learning.train`` writes one per run) instead of running them again, where they exist."""
    spec = LEARN[name]
    profile = profile_of(name, spec["model"])
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for seed in range(seeds):
        for variant in variants:
            tag = _tag(prefix, name, variant, f"s{seed}")
            kept = WORK / f"{tag}.json"
            if reuse and kept.exists():
                runs[variant].append(json.loads(kept.read_text()))
                continue
            print(f"{tag} ...", file=sys.stderr, flush=True)
            runs[variant].append(train(tag, make_plan(profile, name, 4, variant), spec, "--seed", str(seed),
                                       "--eval-every", str(spec["eval_every"]), "--target", spec["target"], *extra,
                                       work=WORK, round_steps=ROUND_STEPS))
    return runs


def convergence(results: dict[str, Any], seeds: int, data: list[str], reuse: bool = False) -> None:
    """Every variant's timed runs on each of ``data`` (``_learn_runs``; ``reuse``: aggregate the kept runs)."""
    for name, spec in LEARN.items():
        if name not in data:
            continue
        runs = _learn_runs(name, seeds, LEARN_VARIANTS, "learn", reuse=reuse)
        metric, target = spec["metric"], parse_target(spec["target"])
        results[f"convergence/{name}"] = {
            "data": name, "target": spec["target"], "metric": metric, "date": time.strftime("%Y-%m-%d"),
            "steps": spec["steps"], "lr": spec["lr"],
            "variants": {v: {"time_to_target_s": median_of_all([r["time_to_target_s"] for r in rs]),
                             "reached": sum(r["time_to_target_s"] is not None for r in rs), "seeds": len(rs),
                             "per_seed": {"time_to_target_s": [r["time_to_target_s"] for r in rs],
                                          "final": [r["eval"][-1][metric] for r in rs],
                                          "target_step": [_target_step(r, target) for r in rs]},
                             "final": statistics.median(r["eval"][-1][metric] for r in rs),
                             "step_time_s": statistics.median(r["step_time_s"] for r in rs),
                             "wall_s": statistics.median(r["wall_s"] for r in rs),
                             "load": [min(r["load"][0] for r in rs), max(r["load"][1] for r in rs)],
                             "command": rs[0]["command"]} for v, rs in runs.items()}}
        logs = [str(WORK / f"{_tag('learn', name, v, 's0')}.json") for v in LEARN_VARIANTS]
        plan_cli("curves", *logs, "-o", str(IMAGES / f"async-{name}.png"), work=WORK)


def sooner(results: dict[str, Any], seeds: int, data: list[str], reuse: bool = False) -> None:
    """``SOONER_VARIANTS``' time to target on each of ``data`` over ``seeds`` seeds (``_learn_runs``), every run
    stopping at the target (a seed that misses it runs its steps): the convergence runs' plans and setting, without
    their final metric."""
    for name, spec in LEARN.items():
        if name not in data:
            continue
        runs = _learn_runs(name, seeds, SOONER_VARIANTS, "sooner", "--stop-at-target", reuse=reuse)
        target = parse_target(spec["target"])
        results[f"sooner/{name}"] = {
            "data": name, "target": spec["target"], "date": time.strftime("%Y-%m-%d"), "steps": spec["steps"],
            "lr": spec["lr"], "seeds": seeds,
            "variants": {v: {"per_seed": {"time_to_target_s": [r["time_to_target_s"] for r in rs],
                                          "target_step": [_target_step(r, target) for r in rs]},
                             "load": [min(r["load"][0] for r in rs), max(r["load"][1] for r in rs)],
                             "command": rs[0]["command"]} for v, rs in runs.items()}}


def _target_step(run: dict[str, Any], target: Target) -> int | None:
    """The step of a run's first evaluation that reaches ``target`` (where ``plan run`` stops its time to target)."""
    return next((e["step"] for e in run["eval"] if target.reached(e["loss"], e.get("accuracy"))), None)


def _rule_final(job: tuple[str, int, int, float]) -> tuple[float, int | None]:
    """One seed of one variant under the rule alone: ``train_async_reference`` on text's plan (for ``1f1b`` with one
    micro-batch in flight, which is synchronous training), then the validation loss ``plan run`` reports at its
    last evaluation (the same 4 held-out batches), and the step of the first round's end (every ``ROUND_STEPS``, where
    the timed runs evaluate) whose validation loss reaches the text target (None: not within the steps). Model, data
    and loss are ``LEARN["text"]``'s, as ``plan run`` loads them."""
    import dataclasses

    import torch

    from planner.data.factory import data_spec, load_data_factory, loss_fn
    from planner.formats.plan import load_plan
    from planner.profile.capture import capture
    from planner.profile.loader import load_factory
    from planner.runtime.pipeline.asynchronous import train_async_reference
    from planner.runtime.pipeline.stages import stage_graphs

    variant, seed, steps, lr = job
    spec = LEARN["text"]
    schedule, correction, _, warmup = {**VARIANTS, **WARM_VARIANTS}["1f1b" if variant == JITTERED else variant]
    torch.set_num_threads(1)  # two jobs share the two cores
    plan = load_plan(WORK / f"{_tag('text', 4, 'async-1f1b')}-plan.json")  # the stages; the schedule is the variant's
    plan = dataclasses.replace(plan, schedule="async-1f1b" if schedule == "1f1b" else schedule)
    torch.manual_seed(seed)  # as plan run --seed builds the model
    model, example = load_factory(spec["model"])
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    if variant == JITTERED:
        noise = torch.Generator().manual_seed(1000 + seed)
        start = {k: v * (1 + 1e-6 * torch.randn(v.shape, generator=noise)) for k, v in start.items()}
    with torch.no_grad():
        criterion = loss_fn(data_spec(example, model(*example)))
    graphs = stage_graphs(capture(model, example, "auto"), model, plan)
    rows = plan.microbatches * example[0].shape[0]
    batches = load_data_factory(spec["data"])

    def batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x, y = batches(seed, step, rows)
        return (x,), y

    def validation_loss(weights: dict[str, torch.Tensor]) -> float:
        with torch.no_grad():
            return statistics.mean(float(criterion(torch.func.functional_call(model, weights, (x,)), y))
                                   for x, y in (batches(seed, i, rows, "val") for i in range(4)))

    target = parse_target(spec["target"])  # as plan run reads --target (text's metric is the loss)
    reached: list[int] = []

    def observe(done: int, weights: dict[str, torch.Tensor]) -> None:
        if not reached and done < steps and target.reached(validation_loss(weights), None):
            reached.append(done)

    _, params = train_async_reference(graphs, model, start, criterion, "adam", lr, plan.schedule, plan.microbatches,
                                      batch, steps, ROUND_STEPS, correction, 1 if schedule == "1f1b" else None,
                                      warmup=warmup, observe=observe)
    final = validation_loss({c: w for stage in params[0] for c, w in stage.items()})
    return final, (reached[0] if reached else (steps if target.reached(final, None) else None))


def rule(results: dict[str, Any], seeds: int, variants: list[str]) -> None:
    """``variants``' final text loss under the rule alone, per seed, for each of ``RULE_SETTINGS``, and the check
    (seed 0 of every variant's convergence runs kept in the work directory, offline); two jobs at a time (nothing is
    timed). The other variants' finals are kept from ``results`` where they were run with as many seeds."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    spec = LEARN["text"]
    make_plan(profile_of("text", spec["model"]), "text", 4, "async-1f1b")
    jobs = [(v, seed, steps, lr) for steps, lr in RULE_SETTINGS for seed in range(seeds) for v in variants]
    runs = {v: WORK / f"{_tag('learn', 'text', v, 's0')}.json" for v in LEARN_VARIANTS}  # the check: every kept run
    runs = {v: json.loads(path.read_text())["eval"][-1]["loss"] for v, path in runs.items() if path.exists()}
    checks = [(v, 0, spec["steps"], spec["lr"]) for v in runs]
    print(f"rule: {len(jobs) + len(checks)} offline runs ...", file=sys.stderr, flush=True)
    with ProcessPoolExecutor(2, mp_context=get_context("fork")) as pool:
        outcomes = dict(zip(jobs + checks, pool.map(_rule_final, jobs + checks)))
    finals = {job: final for job, (final, _) in outcomes.items()}
    today = time.strftime("%Y-%m-%d")
    for steps, lr in RULE_SETTINGS:
        key = f"rule/text/{steps}/{lr}"
        before = results.get(key) if (results.get(key) or {}).get("seeds") == seeds else None
        by = {v: [finals[(v, seed, steps, lr)] for seed in range(seeds)] for v in variants}
        kept = {v: f for v, f in (before or {}).get("finals", {}).items() if v not in by and v in RULE_VARIANTS}
        reached = {v: r for v, r in (before or {}).get("reached", {}).items() if v in kept}
        reached.update({v: [outcomes[(v, seed, steps, lr)][1] for seed in range(seeds)] for v in variants})
        dates = {**_rule_dates(before), **{v: today for v in by}}
        results[key] = {"steps": steps, "lr": lr, "seeds": seeds, "finals": {**kept, **by}, "reached": reached,
                        "dates": {v: dates[v] for v in {**kept, **by}}}
    check = results.get("rule_check/text") or {}
    if (check.get("steps"), check.get("lr")) != (spec["steps"], spec["lr"]):  # the runs' setting changed: start over
        check = {"steps": spec["steps"], "lr": spec["lr"], "pairs": {}}
    check["pairs"] = {**check["pairs"], **{v: [finals[job], runs[v]] for v, job in zip(runs, checks)}}
    results["rule_check/text"] = check


def _probed(entry: dict[str, Any]) -> str:
    """A throughput section's runtime figure, where it planned on ``probed_cluster``'s (an older section did not)."""
    if "pass_overhead_s" not in entry:
        return ""
    bundled = json.loads(CLUSTER.read_text())["runtime"]["pass_overhead_s"]
    return (f" Planned with the runtime probed when the section started: {entry['pass_overhead_s'] * 1e6:.0f} us per "
            f"pass (the bundled cpu-2's: {bundled * 1e6:.0f} us).")


def _setting(entry: dict[str, Any]) -> str:
    """A convergence section's run length and learning rate, for its first line (an older section has neither)."""
    return f", {entry['steps']} steps at lr {entry['lr']:g}" if "steps" in entry else ""


def _rule_dates(entry: dict[str, Any] | None) -> dict[str, str]:
    """When each variant of a rule-alone section was run (an older entry has one date for all)."""
    if not entry:
        return {}
    return dict(entry.get("dates") or {v: entry["date"] for v in entry["finals"]})


def _render_rule(results: dict[str, Any]) -> list[str]:
    keys = sorted((k for k in results if k.startswith("rule/")), key=lambda k: (-results[k]["steps"], -results[k]["lr"]))
    if not keys:
        return []
    lines = ["## The rule alone: text, offline", "",
             "Each variant's update rule in one process (`train_async_reference`; the distributed engine equals it, "
             "`tests/test_async.py`, and 1f1b is the same rule with one micro-batch in flight: synchronous training), "
             "on the convergence runs' stages, data and seeds, for longer or at a lower learning rate. Nothing is "
             "timed, so a variant's final loss on a seed is exact: what separates two variants on a seed is their "
             "rule. *paired*: the median over seeds of the variant's final loss over 1f1b's on the same seed; "
             "*above*: the seeds on which it ends above 1f1b; *target at step*: each seed's first round end (every "
             f"{ROUND_STEPS} steps, where the timed runs evaluate) whose validation loss reaches the target "
             f"({LEARN['text']['target']}; \"-\": not within the steps; blank: the row predates the column); *run*: the "
             "day the row was computed. The rows *warm-up N* run their first N steps synchronously (`--async-warmup N`; "
             f"{WARMUP} is `plan partition`'s default; [async.md](async.md), \"The synchronous warm-up\"), the other "
             "asynchronous rows none, as the timed runs above. The last row is the control: 1f1b from initial weights "
             "each moved by one part in a million, so how far a seed's final loss goes when only rounding-sized noise "
             "changes (the plateau amplifies any difference): a paired difference within its spread says nothing.", ""]
    for key in keys:
        entry = results[key]
        finals = entry["finals"]
        base = finals["1f1b"]
        dates = _rule_dates(entry)
        lines += [f"### {entry['steps']} steps at lr {entry['lr']:g}, {entry['seeds']} seeds", "",
                  "| schedule | final loss (median) | vs 1f1b | paired | above | every seed | target at step | run |",
                  "|---|---|---|---|---|---|---|---|"]
        reached = entry.get("reached", {})
        for variant in (v for v in RULE_VARIANTS if v in finals):
            mine = finals[variant]
            paired = statistics.median(a / b - 1 for a, b in zip(mine, base))
            at = ", ".join("-" if r is None else str(r) for r in reached[variant]) if variant in reached else ""
            lines.append(f"| {variant} | {statistics.median(mine):.3f} | "
                         f"{statistics.median(mine) / statistics.median(base) - 1:+.1%} | {paired:+.1%} | "
                         f"{sum(a > b for a, b in zip(mine, base))}/{len(mine)} | "
                         f"{', '.join(f'{f:.3f}' for f in mine)} | {at} | {dates[variant]} |")
        lines.append("")
    check = results.get("rule_check/text")
    if check and check["pairs"]:
        worst = max(abs(off - run) for off, run in check["pairs"].values())
        lines += [f"The check: seed 0 of the convergence runs ({check['steps']} steps at lr {check['lr']:g}) offline "
                  f"against the distributed runs' last evaluation, {len(check['pairs'])} variants: the final losses "
                  f"differ by {worst:.1e} at most.", ""]
    return lines + ["Command: `python3 bench/async.py --only rule` (`--rule-seeds`; `--rule-variants` runs some rows "
                    "again and keeps the others).", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["throughput", "convergence", "sooner", "rule"])
    parser.add_argument("--seeds", type=int, default=9,
                        help="convergence runs per schedule (one schedule's final text loss spreads over more than 10%% "
                             "from seed to seed, and the target loss sits at the end of a plateau the seeds leave "
                             "anywhere between step 20 and 200: 5 seeds left the comparison a coin toss)")
    parser.add_argument("--data", nargs="+", default=list(LEARN), choices=list(LEARN),
                        help="convergence: which data sets (the others' sections are kept)")
    parser.add_argument("--reuse-runs", action="store_true",
                        help="convergence and sooner: aggregate the runs kept in bench/.cache/async instead of running "
                             "them again")
    parser.add_argument("--models", nargs="+", default=list(SPEED), choices=list(SPEED),
                        help="throughput: which models (the others' sections are kept)")
    parser.add_argument("--repeats", type=int, default=3, help="throughput runs per schedule (the median is shown)")
    parser.add_argument("--microbatches", nargs="+", type=int, default=list(MICROBATCHES), choices=MICROBATCHES,
                        help="throughput: which micro-batch counts (the others' sections are kept)")
    parser.add_argument("--sooner-seeds", type=int, default=16,
                        help="time to target over more seeds: runs per schedule (each stops at the target)")
    parser.add_argument("--rule-seeds", type=int, default=6, help="seeds of each offline section (the rule alone)")
    parser.add_argument("--rule-variants", nargs="+", default=RULE_VARIANTS, choices=RULE_VARIANTS, metavar="VARIANT",
                        help="the rule alone: which variants to run (the others' rows are kept)")
    parser.add_argument("--render", action="store_true", help="re-render the page from docs/bench-async.json only")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    IMAGES.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.render:
        began = time.time()
        if args.only in (None, "throughput"):
            throughput(results, args.repeats, args.models, tuple(args.microbatches))
        if args.only in (None, "convergence"):
            convergence(results, args.seeds, args.data, args.reuse_runs)
        if args.only in (None, "sooner"):
            sooner(results, args.sooner_seeds, args.data, args.reuse_runs)
        if args.only in (None, "rule"):
            rule(results, args.rule_seeds, args.rule_variants)
        results["_machine"] = {"cores": os.cpu_count(), "python": platform.python_version(),
                               "minutes": round((time.time() - began) / 60, 1)}
        RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    OUTPUT.write_text(render(results))
    print(f"wrote {OUTPUT.relative_to(REPO)}", file=sys.stderr)


def _paired(row: dict[str, Any], base: dict[str, Any], metric: str) -> tuple[str, str]:
    """A convergence row against 1f1b's seed by seed: the median of 1f1b's time to target over the row's (seeds on
    which both reached it) and of the final metric's difference; "-" without per-seed figures."""
    mine, theirs = row.get("per_seed"), base.get("per_seed")
    if not mine or not theirs:
        return "-", "-"
    time_text = _ratios(theirs["time_to_target_s"], mine["time_to_target_s"])
    if metric == "accuracy":
        final = statistics.median((a - b) * 100 for a, b in zip(mine["final"], theirs["final"]))
        return time_text, f"{final:+.2f} pp"
    return time_text, f"{statistics.median(a / b - 1 for a, b in zip(mine['final'], theirs['final'])):+.1%}"


def _control(variants: dict[str, Any], metric: str) -> list[str]:
    """Where a lead over 1f1b comes from: the engine synchronous throughout (``SYNCHRONOUS``) against torch's 1F1B
    (the engine's cost per pass alone), and each asynchronous row with a warm-up against it (the asynchrony alone)."""
    control = variants.get(SYNCHRONOUS)
    if control is None or not control.get("per_seed"):
        return []
    parts = []
    for variant in (v for v in LEARN_VARIANTS if v in variants and VARIANTS[v][3] and v != SYNCHRONOUS):
        row = variants[variant]
        _, paired_final = _paired(row, control, metric)
        after, within = _against_control(row["per_seed"]["time_to_target_s"], control, VARIANTS[variant][3])
        within.sort()
        text = (f"*{variant}* paired {statistics.median(after):.2f}x over {_seeds(len(after))}" if after else
                f"*{variant}* no seed")
        if "target_step" in control["per_seed"]:  # absent from sections measured before it was kept
            text += " whose target lies past its warm-up"
        if within:
            span = f"{within[0]:.2f}x" + (f" to {within[-1]:.2f}x" if len(within) > 1 else "")
            text += (f"; on {_seeds(len(within))} the control reaches it within the warm-up, where the row runs the "
                     f"control's own steps: {span}, the spread between identical runs")
        parts.append(f"{text} (final {paired_final})")
    base_time, base_final = _paired(control, variants["1f1b"], metric)
    return [f"Where the lead comes from: *{SYNCHRONOUS}* (the engine that runs async-1f1b with a warm-up longer "
            f"than the run, so every step drains and no gradient is late) against torch's 1F1B, the engine's own cost "
            f"per pass: paired {base_time}, final {base_final}. Against that control, the asynchrony alone (the "
            f"control's time over the row's, seed by seed; final metric against the control's): "
            + "; ".join(parts) + ".", ""]


def _step_lead(variants: dict[str, Any]) -> list[str]:
    """What the rows' step times alone give: each asynchronous row reaching the target at 1f1b's step on every seed,
    its drained warm-up steps at the control's step time and the rest at its own (``step_time_s``, the steady step
    after the warm-up), against 1f1b's steps and against the control's; medians over the seeds on which 1f1b reached
    the target."""
    base, control = variants["1f1b"], variants.get(SYNCHRONOUS)
    steps = [s for s in (base.get("per_seed") or {}).get("target_step", []) if s is not None]
    if not steps or control is None:
        return []
    parts = []
    for variant in (v for v in LEARN_VARIANTS if v in variants and v not in ("1f1b", SYNCHRONOUS)):
        warmup, row = VARIANTS[variant][3], variants[variant]
        spent = [min(warmup, t) * control["step_time_s"] + max(0, t - warmup) * row["step_time_s"] for t in steps]
        leads = [statistics.median(t * other["step_time_s"] / s for t, s in zip(steps, spent))
                 for other in (base, control)]
        parts.append(f"*{variant}* {leads[0]:.2f}x ({leads[1]:.2f}x)")
    return [f"What the step times alone give: a row that reached the target at 1f1b's step on each seed "
            f"({', '.join(map(str, steps))}), its warm-up's drained steps at the control's step time and the rest at "
            "its own, would lead 1f1b by (median over those seeds; in brackets, the control, which is the asynchrony's "
            "part) " + ", ".join(parts) + ". A row that leads by more in the table reached the target in fewer steps "
            "than 1f1b on some seeds; one that leads by less needed more steps, or ran in a slower hour than 1f1b.", ""]


def _render_sooner(results: dict[str, Any]) -> list[str]:
    """The sections of ``sooner``: per variant, how many seeds reached the target, the median time to it, the ratio
    of medians and the paired one against 1f1b, the paired one against the control split by where the control reached
    the target (past the row's warm-up or within it), and the step at which the seeds reached it against 1f1b's."""
    lines: list[str] = []
    for key in sorted(k for k in results if k.startswith("sooner/")):
        entry = results[key]
        variants = entry["variants"]
        base, control = variants["1f1b"], variants[SYNCHRONOUS]
        lines += [f"## Time to target over more seeds: {entry['data']}, target {entry['target']}", "",
                  f"Measured {entry['date']}, {entry['seeds']} seeds, the convergence runs' plans and setting (lr "
                  f"{entry['lr']}, evaluation every 10 steps at round ends), schedules and seeds interleaved, each run "
                  "stopping at the target (`--stop-at-target`; no final metric: the convergence section above has it). "
                  "*to target*: the median; *vs 1f1b*: 1f1b's median over the row's; *paired*: the median over the "
                  "seeds on which both reached the target of 1f1b's time over the row's; *vs control*: the same "
                  "against the control, over the seeds whose target the control reaches past the row's warm-up, then "
                  "over those within it (where both run the same drained steps: the spread between identical runs); "
                  "*same step*: the seeds that reached the target at 1f1b's evaluation. No step time: runs that stop "
                  "at the target mostly end within the warm-up (the convergence section above has the steady steps).",
                  "", "| schedule | reached | to target (s) | vs 1f1b | paired | vs control: past warm-up / within | "
                  "same step | load |",
                  "|---|---|---|---|---|---|---|---|"]
        for variant in (v for v in SOONER_VARIANTS if v in variants):
            row = variants[variant]
            times, steps = row["per_seed"]["time_to_target_s"], row["per_seed"]["target_step"]
            known = [t for t in times if t is not None]
            median = median_of_all(times)
            ratio = f"{median_of_all(base['per_seed']['time_to_target_s']) / median:.2f}x" if median else "-"
            paired = _ratios(base["per_seed"]["time_to_target_s"], times)
            warmup = VARIANTS[variant][3]
            split = ([_ratio_text(r) for r in _against_control(times, control, warmup)]
                     if warmup and variant != SYNCHRONOUS else ["-", "-"])
            same = sum(a == b and a is not None for a, b in zip(steps, base["per_seed"]["target_step"]))
            lines.append(f"| {variant} | {len(known)}/{len(times)} | {f'{median:.2f}' if median else '-'} | {ratio} | "
                         f"{paired} | {split[0]} / {split[1]} | {same}/{len(times)} | "
                         f"{row['load'][0]:.2f} / {row['load'][1]:.2f} |")
        lines += ["", f"Command (1f1b, seed 0): `{base['command']}`", ""]
    return lines


def _ratios(theirs: list[float | None], mine: list[float | None]) -> str:
    """The median over the seeds both reached the target on of ``theirs`` over ``mine``, with the count; "-" if none."""
    return _ratio_text([b / a for a, b in zip(mine, theirs) if a and b])


def _ratio_text(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}x ({len(ratios)})" if ratios else "-"


def _against_control(times: list[float | None], control: dict[str, Any],
                     warmup: int) -> tuple[list[float], list[float]]:
    """The control's time to target over a row's (``times``, per seed) on each seed both reached it on, split by the
    step at which the control reached it: past the row's warm-up (and every seed of a section that kept no target
    steps), and within it, where both ran the same drained steps, so the ratio is the spread between identical runs."""
    theirs = control["per_seed"]["time_to_target_s"]
    steps = control["per_seed"].get("target_step") or [None] * len(theirs)
    after: list[float] = []
    within: list[float] = []
    for mine, other, step in zip(times, theirs, steps):
        if mine and other:
            (within if step is not None and step <= warmup else after).append(other / mine)
    return after, within


def _seeds(count: int) -> str:
    return f"{count} seed{'s' if count != 1 else ''}"


def _compute_bound(rows: dict[str, Any]) -> list[str]:
    """What no order of async-1f1b's passes can beat against plain model parallelism: MP's measured step over the
    busiest rank's compute per step under async-1f1b (every pass runs on its rank, one at a time), and over its compute
    and optimizer updates (tighter, but an update may hold a wait for a sync), beside the measured ratio; and the same
    against 1f1b's measured step."""
    plain, ours = rows["model parallel"], rows["async-1f1b"]
    if "compute_s" not in plain or "compute_s" not in ours:
        return []
    compute = ours["compute_s"]
    bound = plain["step_time_s"] / max(compute.values())
    tighter = plain["step_time_s"] / max(c + ours["update_s"][d] for d, c in compute.items())
    cost = sum(compute.values()) / sum(plain["compute_s"].values())
    flushing = rows["1f1b"]
    return [f"Compute bound against MP: {bound:.2f}x (MP's step over async-1f1b's busiest rank's compute per step, which "
            f"no order of its passes shortens; {tighter:.2f}x with its optimizer updates), measured "
            f"{ours['samples_per_s'] / plain['samples_per_s']:.2f}x. Split into these micro-batches, the step's rows take "
            f"the ranks {cost:.2f}x the compute they take as one batch. The same bound against 1f1b's measured step: "
            f"{flushing['step_time_s'] / max(compute.values()):.2f}x, measured "
            f"{ours['samples_per_s'] / flushing['samples_per_s']:.2f}x: where the two lie far apart, the step is spent "
            f"waiting on messages and in the runtime, not computing.", ""]


def _breakdown(rows: dict[str, Any]) -> list[str]:
    """Where async-1f1b's step goes on its busiest rank (the most compute and updates per step): its passes, its
    optimizer updates, its waits on receives, and the rest (sending, adding each backward's gradients to the step's,
    the weight versions, the round's drain beyond its waits); rows measured before receives were kept lack it."""
    ours = rows["async-1f1b"]
    if "recv_s" not in ours:
        return []
    busiest = max(ours["compute_s"], key=lambda d: ours["compute_s"][d] + ours["update_s"][d])
    step = ours["step_time_s"]
    parts = {"passes": ours["compute_s"][busiest], "optimizer updates": ours["update_s"][busiest],
             "waiting on receives": ours["recv_s"][busiest]}
    parts["the rest"] = step - sum(parts.values())
    steady = ours.get("predicted_steady_step_s")
    # the predicted step for the run's rounds: the step's samples over the predicted samples per second
    predicted = step * ours["samples_per_s"] / ours["predicted_samples_per_s"]
    drains = (f" The simulator puts the rounds' drains at {predicted / steady - 1:.1%} of the steady step (its step "
              f"for the run's rounds over its step with no drain)." if steady else "")
    return [f"async-1f1b's step on its busiest rank ({busiest}; each part the median over the runs, the rest what "
            f"the median step leaves): "
            + ", ".join(f"{name} {seconds * 1e3:.1f} ms ({seconds / step:.1%})" for name, seconds in parts.items())
            + "." + drains, ""]


def _receives(rows: dict[str, Any]) -> list[str]:
    """async-1f1b as ``plan run`` runs it on gloo (each receive posted when the rank is about to wait for it) against
    the same plan with every receive posted one message ahead (``--async-receives ahead``), measured in turns."""
    ahead = rows.get("async-1f1b, receives ahead")
    if ahead is None:
        return []
    ratio = rows["async-1f1b"]["samples_per_s"] / ahead["samples_per_s"]
    return [f"Receives posted on demand (async-1f1b, gloo's default) against one message ahead (*receives ahead*, "
            f"`--async-receives ahead`, the same plan): {ratio:.2f}x the samples/s ([async.md](async.md#the-runtime)).",
            ""]


def render(results: dict[str, Any]) -> str:
    lines = ["# The asynchronous pipeline on 2 CPU ranks", "",
             "<!-- generated by bench/async.py; do not edit by hand -->", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; 2 gloo ranks, "
             "one intra-op thread each, loopback links. Load: the 1-minute load average before / after each run (2.0 = "
             "both cores busy). Each schedule is planned by the default placer for 2 stages (`plan partition "
             "--cluster cpu-2 -d 1 -s SCHEDULE`). Reproduce: `python3 bench/async.py` ([async.md](async.md)).", ""]
    speed = sorted(k for k in results if k.startswith("throughput/"))
    if speed:
        lines += ["## Throughput", "",
                  "Samples per second from the steady step time (rounds after the first), beside the plan's predicted "
                  "step (for the asynchronous schedules: simulated over rounds of the run's length, each from an empty "
                  "pipeline to a drained one, `plan partition --round-steps`). *vs 1f1b*: its samples/s over "
                  "1f1b's; *vs MP*: over plain model parallelism's (the step's rows as one micro-batch, no pipelining). "
                  "Each schedule runs several times, the schedules taking turns; the row is the median run and lists "
                  "every run's step. "
                  "The asynchronous schedules drain the pipeline once per round (each section says how many steps a "
                  "round has). "
                  "Each model is profiled afresh when its section starts (`plan profile --threads 1 --colocate 2`: one "
                  "thread, timed beside a second training process, as each rank runs) and every schedule planned from "
                  "that profile, so the predictions meet the machine as it is that hour; since 2026-11-29 on `cpu-2` "
                  "with its intra-host link and the runtime's cost per pass and per byte probed with it "
                  "(`plan profile --probe-links`, bench/run.py `probed_cluster`; each section says so), before on "
                  "the bundled file's figures.", ""]
        for key in speed:
            entry = results[key]
            rows = entry["rows"]
            base, plain = rows["1f1b"]["samples_per_s"], rows["model parallel"]["samples_per_s"]
            lines += [f"### {entry['model']}, {entry['microbatches']} micro-batches", "",
                      f"Measured {entry['date']}, rounds of {entry.get('round_steps', 5)} steps; the bubble bound "
                      f"of 1f1b on 2 stages is "
                      f"{(entry['microbatches'] + 1) / entry['microbatches']:.2f}x.{_probed(entry)}", "",
                      "| schedule | samples/s | predicted | measured / predicted | vs 1f1b | vs MP | steps of the runs (ms) "
                      "| load (min / max) |",
                      "|---|---|---|---|---|---|---|---|"]
            for variant in VARIANTS:
                r = rows.get(variant)
                if r is None:
                    continue
                pred = r["predicted_samples_per_s"]
                shown, against = (f"{pred:.1f}", f"{r['samples_per_s'] / pred:.2f}") if pred else ("-", "-")
                lines.append(f"| {variant} | {r['samples_per_s']:.1f} | {shown} | {against} | "
                             f"{r['samples_per_s'] / base:.2f}x | {r['samples_per_s'] / plain:.2f}x | "
                             f"{', '.join(f'{s * 1e3:.1f}' for s in r.get('runs_s', [r['step_time_s']]))} | "
                             f"{r['load'][0]:.2f} / {r['load'][1]:.2f} |")
            lines += [""] + _compute_bound(rows) + _breakdown(rows) + _receives(rows)
            lines += [f"Command (async-1f1b): `{rows['async-1f1b']['command']}`", ""]
    for key in sorted(k for k in results if k.startswith("convergence/")):
        entry = results[key]
        variants, metric = entry["variants"], entry["metric"]
        base = variants["1f1b"]
        lines += [f"## Convergence: {entry['data']}, target {entry['target']}", "",
                  f"Measured {entry['date']}{_setting(entry)}; medians of {base['seeds']} seeds. *to target*: "
                  "training seconds "
                  "(evaluation excluded) to the first evaluation (every 10 steps, at round ends) that reaches the "
                  "target, \"not reached\" when a seed missed it; *vs 1f1b*: 1f1b's time over the schedule's; "
                  "*final*: the last evaluation's metric, and its difference from 1f1b's. *paired*: the median over "
                  "seeds of the same comparison on each seed (time: over the seeds on which both reached the "
                  "target; final: every seed), where the section kept every seed's figures.", "",
                  f"| schedule | to target (s) | vs 1f1b | paired | reached | final {metric} | vs 1f1b | paired "
                  "| step (ms) | load |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for variant in (v for v in LEARN_VARIANTS if v in variants):  # an older section lacks the newer variants
            r = variants[variant]
            t = r["time_to_target_s"]
            ratio = f"{base['time_to_target_s'] / t:.2f}x" if t and base["time_to_target_s"] else "-"
            if metric == "accuracy":
                final, diff = f"{r['final']:.2%}", f"{(r['final'] - base['final']) * 100:+.2f} pp"
            else:
                final, diff = f"{r['final']:.3f}", f"{(r['final'] / base['final'] - 1):+.1%}"
            paired_time, paired_final = _paired(r, base, metric)
            lines.append(f"| {variant} | {'not reached' if t is None else f'{t:.2f}'} | {ratio} | {paired_time} | "
                         f"{r['reached']}/{r['seeds']} | {final} | {diff} | {paired_final} | "
                         f"{r['step_time_s'] * 1e3:.1f} | {r['load'][0]:.2f} / {r['load'][1]:.2f} |")
        lines += [""] + _control(variants, metric) + _step_lead(variants)
        lines += [f"Command (1f1b, seed 0): `{base['command']}`", "",
                  f"![{entry['data']}](img/async-{entry['data']}.png)", ""]
    lines += _render_sooner(results) + _render_rule(results)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
