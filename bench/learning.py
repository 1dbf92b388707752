"""Benchmark of learning with ``plan run`` on 2 CPU ranks: the bundled real data sets reach their targets,
and an emulated link slows a pipeline by what the cost model predicts.

1. Digits: ``digits_cnn`` on scikit-learn's digits, the dp plan on ``cpu-2`` (8 micro-batches, 1F1B),
   evaluated every 25 steps on the validation split; target: 95% validation accuracy.
2. Text: ``gpt_bytes`` (byte-level GPT) on the standard library's source bytes, the dp plan on ``cpu-2``
   (4 micro-batches), evaluated every 25 steps; target: validation loss 3.0 nats per byte (a uniform
   guess is ln 256 = 5.55).
3. Emulated link: the digits plan for 30 steps on loopback and with ``--emulate-link 1e8,0.005``; the
   growth of the measured step time against the growth of the predicted one (the prediction re-simulated
   on the slowed links).

Writes docs/bench-learning.md and the curves docs/img/learning-digits.{png,svg} and
docs/img/learning-text.{png,svg}. The 1-minute load average is recorded around every run.

    python3 bench/learning.py
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _paths import REPO  # first: the repository on sys.path

WORK = REPO / "bench" / ".cache" / "learning"
OUTPUT = REPO / "docs" / "bench-learning.md"
IMAGES = REPO / "docs" / "img"
PLAN = [sys.executable, "-c", "from planner.cli import main; main()"]

DIGITS = {"model": "planner.examples.digits:digits_cnn", "data": "planner.data.digits:batches", "microbatches": 8,
          "steps": 300, "lr": 0.001, "target": "accuracy=0.95"}
TEXT = {"model": "planner.examples.gpt:gpt_bytes", "data": "planner.data.text:batches", "microbatches": 4,
        "steps": 300, "lr": 0.003, "target": "loss=3.0"}
LINK = "1e8,0.005"


def plan_cli(*args: str, work: Path = WORK) -> str:
    """``plan ARGS`` run in ``work``; its stdout, or exit with its error."""
    done = subprocess.run([*PLAN, *args], cwd=work, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"plan {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def make_plan(name: str, spec: dict[str, Any], *partition_args: str, work: Path = WORK, cluster: str = "cpu-2") -> Path:
    """Profile ``spec["model"]`` and partition it on ``cluster`` with ``spec["microbatches"]`` (and
    ``partition_args``)."""
    profile, plan = work / f"{name}-profile.json", work / f"{name}-plan.json"
    plan_cli("profile", spec["model"], "-o", str(profile), "--json", work=work)
    plan_cli("partition", str(profile), "--cluster", cluster, "-n", str(spec["microbatches"]), "-o", str(plan), "--json",
             *partition_args, work=work)
    return plan


LAST = 5
"""Evaluations averaged for a run's smoothed final metric (``final_mean``): one evaluation of digits' 288 held-out
samples moves by 1-2 points between neighbours of the same run, more than the half point an accuracy criterion
allows."""


def final_mean(run: dict[str, Any], metric: str) -> float:
    """The mean of ``metric`` over a run summary's last ``LAST`` evaluations."""
    return statistics.fmean(e[metric] for e in run["eval"][-LAST:])


def final_gap(metric: str, ours: float, theirs: float) -> str:
    """How far one mode's smoothed final metric lies from another's: accuracy in points, a loss in percent."""
    return f"{(ours - theirs) * 100:+.2f} points" if metric == "accuracy" else f"{ours / theirs - 1:+.1%}"


def metric_text(metric: str, value: float | None) -> str:
    """A validation metric as the pages print it: accuracy in percent, a loss to 3 places, ``-`` when absent."""
    if value is None:
        return "-"
    return f"{value:.2%}" if metric == "accuracy" else f"{value:.3f}"


def median_of_all(values: list[float | None]) -> float | None:
    """The median of the seeds' values, or None when any seed has none (a target some seed missed)."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) and known else None


def train(name: str, plan: Path, spec: dict[str, Any], *extra: str, work: Path = WORK,
          round_steps: int = 5) -> dict[str, Any]:
    """``plan run`` of ``plan`` on ``spec``'s data with ``extra`` options; its summary (without the plan), with the
    load around it and the command, also kept as ``work/NAME.json`` beside the round log ``NAME.jsonl``."""
    log = work / f"{name}.jsonl"
    log.unlink(missing_ok=True)
    before = os.getloadavg()[0]
    data = ["--data", spec["data"]] if spec.get("data") else []  # none: the model's synthetic batches
    args = ["run", str(plan), spec["model"], *data, "--steps", str(spec["steps"]), "--round-steps",
            str(round_steps), "--lr", str(spec["lr"]), "--no-rebalance", "--log", str(log), "--json", *extra]
    summary = json.loads(plan_cli(*args, work=work))
    summary.pop("plan", None)
    summary["load"] = [before, os.getloadavg()[0]]
    shown = {str(plan): plan.name, str(log): log.name}
    summary["command"] = "plan " + " ".join(shown.get(a, a) for a in args if a != "--json")
    (work / f"{name}.json").write_text(json.dumps(summary))
    return summary


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    IMAGES.mkdir(parents=True, exist_ok=True)
    from planner.app.curves import load_run
    from planner.report.curves import draw

    results: dict[str, Any] = {}
    for name, spec in (("digits", DIGITS), ("text", TEXT)):
        plan = make_plan(name, spec)
        results[name] = train(name, plan, spec, "--eval-every", "25", "--target", spec["target"])
        draw([load_run(WORK / f"{name}.json")], IMAGES / f"learning-{name}.png")
    plan = WORK / "digits-plan.json"
    short = dict(DIGITS, steps=30)
    results["loopback"] = train("loopback", plan, short)
    results["emulated"] = train("emulated", plan, short, "--emulate-link", LINK)
    OUTPUT.write_text(render(results))
    print(f"wrote {OUTPUT.relative_to(REPO)}")


def _load(summary: dict[str, Any]) -> str:
    return f"{summary['load'][0]:.2f} / {summary['load'][1]:.2f}"


def render(results: dict[str, Any]) -> str:
    lines = ["# Learning on 2 CPU ranks: real data, time to target, emulated links", "",
             "<!-- generated by bench/learning.py; do not edit by hand -->", "",
             f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; 2 gloo "
             f"ranks, one intra-op thread each. Load: the 1-minute load average before / after each run "
             f"(2.0 = both cores busy). Reproduce: `python3 bench/learning.py` (about {_minutes(results)} minutes).",
             "", "## Targets", "",
             "| data | model | parameters | plan | steps | final validation loss | final accuracy | target | "
             "time to target (training s) | training s | load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, spec in (("digits", DIGITS), ("text", TEXT)):
        r = results[name]
        last = r["eval"][-1]
        acc = "-" if last["accuracy"] is None else f"{last['accuracy']:.2%}"
        reached = "not reached" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        params = _parameters(spec["model"])
        lines.append(f"| {name} | `{spec['model'].split(':')[1]}` | {params:,} | dp on {r['world_size']} ranks, "
                     f"{r['schedule']} x {r['microbatches']} | {r['steps']} | {last['loss']:.3f} | {acc} | "
                     f"{spec['target']} | {reached} | {r['wall_s']:.1f} | {_load(r)} |")
    lines += ["", "Commands (after `plan profile MODEL -o NAME-profile.json` and `plan partition NAME-profile.json "
              "--cluster cpu-2 -n N -o NAME-plan.json`):", ""]
    lines += [f"    {results[name]['command']}" for name in ("digits", "text")]
    lines += ["", "Validation accuracy of the digits CNN and validation loss (nats per byte) of the byte-level GPT "
              "against training time and step:", "", "![digits](img/learning-digits.png)", "",
              "![text](img/learning-text.png)", "",
              f"The text corpus: {results['text']['data'].get('fingerprint')} (SHA-256 prefix of the standard "
              f"library's bytes on this machine; another Python version gives another corpus).", ""]
    loop, emu = results["loopback"], results["emulated"]
    measured = emu["step_time_s"] - loop["step_time_s"]
    predicted = emu["predicted_step_time_s"] - loop["predicted_step_time_s"]
    lines += ["## Emulated link", "",
              f"The digits plan for 30 steps, on loopback and with `--emulate-link {LINK}` (100 MB/s, 5 ms).", "",
              "| run | measured step | predicted step | bytes sent | load |", "|---|---|---|---|---|",
              f"| loopback | {loop['step_time_s'] * 1e3:.1f} ms | {loop['predicted_step_time_s'] * 1e3:.1f} ms | "
              f"{loop['bytes_sent'] / 1e6:.1f} MB | {_load(loop)} |",
              f"| emulated | {emu['step_time_s'] * 1e3:.1f} ms | {emu['predicted_step_time_s'] * 1e3:.1f} ms | "
              f"{emu['bytes_sent'] / 1e6:.1f} MB | {_load(emu)} |", "",
              f"Growth of the step time: {measured * 1e3:.1f} ms measured, {predicted * 1e3:.1f} ms predicted "
              f"(ratio {measured / predicted:.2f}).", ""]
    return "\n".join(lines)


def _parameters(model: str) -> int:
    from planner.profile.loader import load_factory

    module, _ = load_factory(model)
    return sum(p.numel() for p in module.parameters())


def _minutes(results: dict[str, Any]) -> int:
    return max(1, round(sum(r.get("wall_s", 0.0) for r in results.values()) / 60 * 1.5 + 1))


if __name__ == "__main__":
    started = time.time()
    main()
    print(f"{time.time() - started:.0f} s")
