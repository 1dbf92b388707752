"""``plan run`` refuses bad input with one line and a non-zero exit, before starting any process;
a world-size mismatch found by the ranks themselves ends quickly instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app
from planner.errors import DistributedError, PlanMismatchError
from planner.formats.profile import save_profile
from planner.profile.profiler import profile_model
from planner.runtime.launch.prepare import prepare
from planner.runtime.launch.config import RunConfig

GPT = "planner.examples.gpt:gpt_tiny"
ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Path:
    """A gpt_tiny profile and a 2-stage plan that names it by a relative path."""
    tmp = tmp_path_factory.mktemp("run")
    profile = profile_model(GPT, repeats=1, warmup=0)
    save_profile(profile, tmp / "profile.json")
    names = [n.name for n in profile.nodes]
    half = len(names) // 2
    plan = {"schema_version": 1, "method": "hand", "schedule": "gpipe", "microbatches": 2,
            "stages": [{"index": 0, "device": "a", "nodes": names[:half]},
                       {"index": 1, "device": "b", "nodes": names[half:]}],
            "predicted": {"step_time_s": 1.0}, "profile": {"path": "profile.json"}}
    (tmp / "plan.json").write_text(json.dumps(plan))
    return tmp


def _error(result) -> str:
    assert result.exit_code != 0, result.output
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


def test_missing_plan(tmp_path):
    line = _error(runner.invoke(app, ["run", str(tmp_path / "nope.json"), GPT]))
    assert "nope.json" in line


def test_model_not_found(case):
    line = _error(runner.invoke(app, ["run", str(case / "plan.json"), "no_such_module_xyz:build"]))
    assert "no_such_module_xyz" in line


def test_plan_for_another_model(case):
    line = _error(runner.invoke(app, ["run", str(case / "plan.json"), "planner.examples.unet:unet_small"]))
    assert "does not match" in line and "profile" in line


def test_profile_not_found(case, tmp_path):
    data = json.loads((case / "plan.json").read_text())
    data["profile"] = {"path": "gone.json"}
    (tmp_path / "plan.json").write_text(json.dumps(data))
    line = _error(runner.invoke(app, ["run", str(tmp_path / "plan.json"), GPT]))
    assert "gone.json" in line and "--profile" in line


def test_plan_missing_a_node(case, tmp_path):
    data = json.loads((case / "plan.json").read_text())
    data["stages"][1]["nodes"] = data["stages"][1]["nodes"][:-1]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    line = _error(runner.invoke(app, ["run", str(tmp_path / "plan.json"), GPT, "--profile", str(case / "profile.json")]))
    assert "on no stage" in line


def test_world_size_mismatch_before_launch(case):
    line = _error(runner.invoke(app, ["run", str(case / "plan.json"), GPT, "--nproc-per-node", "3"]))
    assert "2 devices" in line and "--nproc-per-node 2" in line


@pytest.mark.parametrize("args", [["--steps", "0"], ["--round-steps", "0"], ["--timeout-s", "0"],
                                  ["--optimizer", "lbfgs"], ["--nnodes", "2:1"]])
def test_bad_options(case, args):
    _error(runner.invoke(app, ["run", str(case / "plan.json"), GPT, *args]))


def test_micro_batches_must_split_the_batch(case):
    line = _error(runner.invoke(app, ["run", str(case / "plan.json"), GPT, "--data", f"{__file__}:odd_batches"]))
    assert "micro-batches" in line


def odd_batches(seed: int, step: int, batch_size: int):
    return torch.zeros(batch_size + 1, 16, dtype=torch.int64), None


def test_ranks_refuse_a_wrong_world_size(case):
    with pytest.raises(DistributedError, match="3 ranks were started"):
        prepare(RunConfig(plan=str(case / "plan.json"), model=GPT, steps=1), 3, torch.device("cpu"))
    with pytest.raises(PlanMismatchError):
        prepare(RunConfig(plan=str(case / "plan.json"), model="planner.examples.unet:unet_small", steps=1), 2,
                torch.device("cpu"))


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_torchrun_with_the_wrong_world_size_ends_with_the_message(case):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           "-m", "planner.run", str(case / "plan.json"), GPT, "--steps", "1", "--timeout-s", "30"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, cwd=case, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "error: the plan places stages on 2 devices but 3 ranks were started" in done.stderr


def test_steady_step_time_skips_the_first_round_and_averages_the_last_ones():
    from planner.runtime.launch.config import RoundEnd
    from planner.runtime.launch.worker import steady_step_time_s

    rounds = [RoundEnd(i, 2 * i, 2, wall, ()) for i, wall in enumerate((9.0, 4.0, 2.0, 2.2, 1.8))]
    assert steady_step_time_s(rounds) == pytest.approx((2.0 + 2.2 + 1.8) / 6)
    assert steady_step_time_s(rounds[:1]) == pytest.approx(4.5)  # only the first: better than nothing
    assert steady_step_time_s([]) is None
    # an asynchronous schedule's synchronous warm-up (steps before 6 here) is left out where later rounds ran
    assert steady_step_time_s(rounds, warmup=6) == pytest.approx((2.2 + 1.8) / 4)
    assert steady_step_time_s(rounds, warmup=99) == steady_step_time_s(rounds)  # the run never left it


def test_the_summary_compares_measured_and_predicted_step_time(capsys):
    from rich.console import Console

    from planner.report import render_run

    result = {"steps": 8, "world_size": 2, "backend": "gloo", "schedule": "1f1b", "microbatches": 8,
              "microbatch_size": 4, "optimizer": "adam", "lr": 1e-3, "loss": "mse", "losses": [2.0, 1.0],
              "wall_s": 3.0, "step_time_s": 0.55, "predicted_step_time_s": 0.5}
    render_run(Console(), result)
    out = capsys.readouterr().out
    assert "step time 0.550 s measured" in out and "0.500 s predicted" in out and "+10%" in out


def test_a_slowdown_of_a_rank_the_job_lacks_is_refused_before_any_rank_starts(case):
    """Issue 23, item 6: `--emulate-slowdown 5=2.0` on 2 ranks used to be refused after "starting 2 rank(s)"."""
    result = runner.invoke(app, ["run", str(case / "plan.json"), GPT, "--emulate-slowdown", "5=2.0"])
    line = _error(result)
    assert "rank 5" in line and "2 ranks" in line and "starting" not in result.output
