"""The benchmark scripts' own code, without running them: they take half an hour or more and run by hand, so a slip
in them (one crashed every rebalancing run of bench/run.py for a day unseen) must show here first. Each committed
page is its committed results rendered by the script as it is now, and bench/run.py's bookkeeping of a rebalancing
run is replayed on round records of the runtime's shape."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "tests" / "golden" / "plans" / "gpt_tiny-mixed-a100-v100-greedy.json"


def _script(name: str) -> Any:
    """``bench/<name>.py`` as a module (its ``main`` does not run)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))  # for its ``_paths``; last, as bench/_paths.py keeps it
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench_run() -> Any:
    return _script("run")


@pytest.mark.parametrize(("script", "page"), [("run", "bench-run"), ("async", "bench-async"), ("sync", "bench-sync"),
                                              ("dasp", "bench-dasp"), ("schedules", "bench-schedules")])
def test_each_page_is_its_results_rendered(script: str, page: str) -> None:
    module = _script(script)
    results = json.loads((ROOT / "docs" / f"{page}.json").read_text())
    rendered = module.render(results, argparse.Namespace()) if script == "run" else module.render(results)
    flag = {"run": "--render-only", "schedules": None}.get(script, "--render")
    how = f"python3 bench/{script}.py {flag}" if flag else f"python3 bench/{script}.py"
    committed = (ROOT / "docs" / f"{page}.md").read_text()
    assert _measured(rendered) == _measured(committed), f"docs/{page}.md is not its results rendered: {how}"


def _measured(page: str) -> list[str]:
    """The page without the lines that describe the machine rendering it (cores, Python, torch), which the scripts
    read from the running interpreter."""
    return [line for line in page.splitlines() if not line.startswith(("Machine:", "**Busy machine:"))]


def _rounds(compute: dict[str, float], changed: tuple[int, ...] = (), converged: int | None = None) -> list[dict[str, Any]]:
    """Four round records in the runtime's shape (``--log``), 2 steps each."""
    out = []
    for r in range(4):
        devices = {d: {"compute_s": 2 * c, "wait_s": 0.1, "recv_s": 0.05, "post_s": 0.01, "update_s": 0.02,
                       "weight": 1.0, "speed_factor": 2.0 if d == "cpu1" else 1.0} for d, c in compute.items()}
        out.append({"round": r, "steps": 2, "step_time_s": 1.0 - 0.1 * (r in changed or r > 1), "max_wait_s": 0.2,
                    "mean_wait_s": 0.1, "imbalance": 0.02, "plan_changed": r in changed,
                    "converged": converged is not None and r >= converged, "reason": "recorded shape",
                    "devices": devices, "stages": [{"device": "cpu0", "nodes": 5}, {"device": "cpu1", "nodes": 4}]})
    return out


def test_a_rebalancing_run_is_summarised_and_rendered(bench_run: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def run_job(plan: Path, model: str, steps: int, round_steps: int, options: dict[str, Any], **kwargs: Any) -> dict:
        tag = kwargs["tag"]
        rounds = _rounds({"cpu0": 0.4, "cpu1": 0.8}, (1,), 3) if tag.endswith("dynamic") else \
            _rounds({"cpu0": 0.4, "cpu1": 0.84})
        return {"rounds": rounds, "load_before": 1.0, "load_after": 1.2, "wall_s": 9.0}

    monkeypatch.setattr(bench_run, "profile_path", lambda name, reprofile, colocate=2: PLAN)
    monkeypatch.setattr(bench_run, "make_plan", lambda name, prof, tag, **kwargs: PLAN)
    monkeypatch.setattr(bench_run, "run_job", run_job)
    args = argparse.Namespace(reprofile=False, steps=8, rebalance_steps=16, round_steps=2)
    result = bench_run.rebalance_one(args, "gpt_small", 2.0, 0)
    assert result["plan_changes"] == [1] and result["converged_round"] == 3
    assert result["relative_speed"] == pytest.approx(2.0)
    assert result["static_compute_ratio"] == pytest.approx(0.84 / 2.0 / 0.4)
    assert result["stages"]["rebalanced"] == [5, 4] and len(result["stages"]["static"]) >= 1

    results = json.loads((ROOT / "docs" / "bench-run.json").read_text())
    results["rebalance"] = [result]
    page = bench_run.render(results, argparse.Namespace())
    assert "| gpt_small | 2 | 0 | 2.00 (+0%) |" in page


def test_a_partial_run_keeps_its_sections_in_the_history(bench_run: Any) -> None:
    """A `--only fidelity` run adds a history line with its trials (raw and calibrated) and nothing for the sections it
    did not run; the spread table shows those as dashes and counts the trials within 10% both ways."""
    fidelity = [{"model": "gpt_small", "error": 0.04, "errors": [0.01, 0.04, 0.12],
                 "calibrated_errors": [0.02, 0.03, 0.05]},
                {"model": "gpt_small", "shape": "data parallel", "error": -0.02, "errors": [-0.02]}]
    results = {"finished": "2026-11-28 06:00 UTC", "command": "python3 bench/run.py --only fidelity",
               "fidelity": fidelity, "rebalance": [{"never": "read"}]}
    entry = bench_run.history_entry(results, ["fidelity"])
    assert set(entry) == {"finished", "command", "fidelity"}
    assert entry["fidelity"]["gpt_small"]["calibrated_errors"] == [0.02, 0.03, 0.05]
    assert entry["fidelity"]["gpt_small (data parallel)"]["calibrated_errors"] == []
    gain, cases, counts, rebalance = bench_run._history_cells(entry).split(" | ")
    assert (gain, rebalance) == ("-", "-")
    assert counts == "3 of 4 / 3 of 3"  # 0.12 is beyond 10% raw; only one row has calibrated errors
    assert "gpt_small +4.0% (+1.0%, +4.0%, +12.0%)" in cases


def test_the_async_bench_prices_the_rounds_drains_against_the_steady_state(tmp_path: Path) -> None:
    """bench/async.py's *drains* figure: an asynchronous plan priced for rounds of 3 steps, re-simulated with no drain,
    is the plan partition writes for the steady state (no ``--round-steps``), and faster; a flushing plan has none."""
    from typer.testing import CliRunner

    from planner.cli import app
    from planner.formats.plan import load_plan

    bench_async = _script("async")
    profile = str(ROOT / "tests" / "golden" / "profiles" / "gpt_tiny.json")
    made = {}
    for name, extra in (("drained", ["-s", "async-1f1b", "--round-steps", "3"]), ("steady", ["-s", "async-1f1b"]),
                        ("flushing", ["-s", "1f1b"])):
        made[name] = tmp_path / f"{name}.json"
        args = ["partition", profile, "--cluster", "cpu-2", "-m", "uniform", "-d", "1", "-n", "4", *extra]
        result = CliRunner().invoke(app, [*args, "-o", str(made[name])])
        assert result.exit_code == 0, result.output
    drained, steady = load_plan(made["drained"]), load_plan(made["steady"])
    assert drained.drain_every == 3 and steady.drain_every is None
    assert bench_async._steady_step_s(made["drained"]) == pytest.approx(steady.step_time_s, rel=1e-9)
    assert steady.step_time_s < drained.step_time_s
    assert bench_async._steady_step_s(made["flushing"]) is None


def test_the_async_bench_splits_the_busiest_ranks_step() -> None:
    """bench/async.py's breakdown of async-1f1b's step on the rank with the most passes and updates: the parts and the
    rest add up to the measured step, and the drains' share is the prediction over the steady state's; a row measured
    before receives were kept shows none."""
    bench_async = _script("async")
    row = {"step_time_s": 0.5, "compute_s": {"cpu0": 0.40, "cpu1": 0.42}, "update_s": {"cpu0": 0.03, "cpu1": 0.005},
           "recv_s": {"cpu0": 0.02, "cpu1": 0.04}, "samples_per_s": 16.0, "predicted_samples_per_s": 16.0 * 0.5 / 0.44,
           "predicted_steady_step_s": 0.4}  # predicted 0.44 s for the rounds, 0.4 s with no drain
    line = " ".join(bench_async._breakdown({"async-1f1b": row}))
    assert "busiest rank (cpu0;" in line  # 0.43 of passes and updates against cpu1's 0.425
    assert "passes 400.0 ms (80.0%), optimizer updates 30.0 ms (6.0%), waiting on receives 20.0 ms (4.0%), " \
           "the rest 50.0 ms (10.0%)." in line
    assert "drains at 10.0% of the steady step" in line
    assert bench_async._breakdown({"async-1f1b": {k: v for k, v in row.items() if k != "recv_s"}}) == []


def test_the_async_bench_compares_the_warm_ups_with_the_synchronous_engine() -> None:
    """bench/async.py's control: the engine synchronous throughout against torch's 1F1B, then each row with a warm-up
    against that control, seed by seed (times: the control's over the row's; finals: the row's against the
    control's); sections without the control say nothing."""
    bench_async = _script("async")

    def row(times: list[float], finals: list[float]) -> dict[str, Any]:
        return {"time_to_target_s": sorted(times)[len(times) // 2], "final": sorted(finals)[len(finals) // 2],
                "per_seed": {"time_to_target_s": times, "final": finals}}

    variants = {"1f1b": row([4.0, 8.0, 6.0], [0.95, 0.96, 0.97]),
                bench_async.SYNCHRONOUS: row([2.0, 4.0, 3.0], [0.95, 0.96, 0.97]),
                "async-1f1b, warm-up 50": row([1.0, 2.0, 1.5], [0.96, 0.96, 0.97]),
                "async-1f1b": row([1.0, 1.0, 1.0], [0.9, 0.9, 0.9])}  # no warm-up: not judged against the control
    line = " ".join(bench_async._control(variants, "accuracy"))
    assert "against torch's 1F1B, the engine's own cost per pass: paired 2.00x (3), final +0.00 pp" in line
    assert "*async-1f1b, warm-up 50* paired 2.00x over 3 seeds (final +0.00 pp)" in line  # no target steps kept
    assert "*async-1f1b* " not in line
    # seeds whose target the control reaches within the warm-up ran the same steps in both: the spread, not a lead
    variants[bench_async.SYNCHRONOUS]["per_seed"]["target_step"] = [40, 60, 100]
    variants["async-1f1b, warm-up 50"]["per_seed"]["time_to_target_s"] = [2.5, 2.0, 1.5]
    line = " ".join(bench_async._control(variants, "accuracy"))
    assert ("*async-1f1b, warm-up 50* paired 2.00x over 2 seeds whose target lies past its warm-up; on 1 seed the "
            "control reaches it within the warm-up, where the row runs the control's own steps: 0.80x, the spread "
            "between identical runs (final +0.00 pp)") in line
    assert bench_async._control({k: v for k, v in variants.items() if k != bench_async.SYNCHRONOUS}, "accuracy") == []


def test_the_async_bench_times_the_target_over_more_seeds_against_1f1b_and_the_control() -> None:
    """bench/async.py's *more seeds* section: per row the seeds that reached the target, the ratio of medians and the
    paired one against 1f1b, against the control split by where the control reached the target (past the row's
    warm-up, or within it), and the seeds that reached it at 1f1b's evaluation; a missed seed counts in no ratio."""
    bench_async = _script("async")

    def row(times: list[float | None], steps: list[int | None]) -> dict[str, Any]:
        return {"per_seed": {"time_to_target_s": times, "target_step": steps}, "load": [1.0, 2.0],
                "command": "plan run ..."}

    variants = {"1f1b": row([4.0, 8.0, 6.0, 2.0], [20, 80, 60, 20]),
                bench_async.SYNCHRONOUS: row([4.0, 8.0, 6.0, 2.0], [20, 80, 60, 20]),
                "async-1f1b, warm-up 50": row([4.0, 4.0, 3.0, None], [20, 80, 60, None]),
                "async-1f1b, warm-up 20": row([2.0, 4.0, 6.0, 1.0], [20, 40, 60, 20])}
    lines = bench_async._render_sooner({"sooner/text": {"data": "text", "target": "loss=3.0", "date": "2026-11-30",
                                                        "steps": 400, "lr": 0.003, "seeds": 4, "variants": variants}})
    page = "\n".join(lines)
    assert "## Time to target over more seeds: text, target loss=3.0" in page
    assert "| 1f1b | 4/4 | 5.00 | 1.00x | 1.00x (4) | - / - | 4/4 | 1.00 / 2.00 |" in page
    # a missed seed: no median, no ratio of medians; paired over the 3 others (1.0, 2.0, 2.0); against the control:
    # past step 50 seeds 1 and 2 (2.0, 2.0), within seed 0 (1.0); the missed seed 3 in neither
    assert "| async-1f1b, warm-up 50 | 3/4 | - | - | 2.00x (3) | 2.00x (2) / 1.00x (1) | 3/4 |" in page
    # warm-up 20: past it seeds 1 and 2 (2.0, 1.0), within it seeds 0 and 3 (2.0, 2.0)
    assert "| async-1f1b, warm-up 20 | 4/4 | 3.00 | 1.67x | 2.00x (4) | 1.50x (2) / 2.00x (2) | 3/4 |" in page
    # a seed the control missed lies neither past the warm-up nor within it
    variants[bench_async.SYNCHRONOUS]["per_seed"] = {"time_to_target_s": [4.0, 8.0, 6.0, None],
                                                      "target_step": [20, 80, 60, None]}
    page = "\n".join(bench_async._render_sooner({"sooner/text": {"data": "text", "target": "loss=3.0",
                                                                  "date": "2026-11-30", "steps": 400, "lr": 0.003,
                                                                  "seeds": 4, "variants": variants}}))
    assert "| async-1f1b, warm-up 20 | 4/4 | 3.00 | 1.67x | 2.00x (4) | 1.50x (2) / 2.00x (1) | 3/4 |" in page


def test_the_async_bench_gives_the_lead_the_step_times_allow_at_1f1bs_steps() -> None:
    """bench/async.py's step lead: a row reaching the target at 1f1b's step, its warm-up's steps at the control's step
    time and the rest at its own, against 1f1b's time for those steps (and the control's); a warm-up past every target
    leaves only the engine's drained steps; sections without 1f1b's target steps or the control say nothing."""
    bench_async = _script("async")
    variants = {"1f1b": {"step_time_s": 0.2, "per_seed": {"target_step": [20, 100, None]}},
                bench_async.SYNCHRONOUS: {"step_time_s": 0.18},
                "async-1f1b": {"step_time_s": 0.15},
                "async-1f1b, warm-up 50": {"step_time_s": 0.15}}
    line = " ".join(bench_async._step_lead(variants))
    assert "on each seed (20, 100)" in line  # a seed 1f1b never reached has no step to compare at
    assert "*async-1f1b* 1.33x (1.20x)" in line  # 0.2 / 0.15, 0.18 / 0.15 on both seeds
    # seed 20 lies within the warm-up: 0.2 / 0.18 = 1.11x (1.00x); seed 100: 100 * 0.2 / (50 * 0.18 + 50 * 0.15)
    # = 1.21x (1.09x); the median of the two
    assert "*async-1f1b, warm-up 50* 1.16x (1.05x)" in line
    assert bench_async._step_lead({k: v for k, v in variants.items() if k != bench_async.SYNCHRONOUS}) == []
    assert bench_async._step_lead({**variants, "1f1b": {"step_time_s": 0.2}}) == []
