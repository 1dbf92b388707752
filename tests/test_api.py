"""Issue 18 (part): the library API trains exactly as ``plan run`` does, in the user's own loop."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._digits import digits_plan
from tests._inproc import plan as plan_in_process

ROOT = Path(__file__).resolve().parent.parent


def test_the_api_is_importable_without_torch() -> None:
    script = "import sys, planner; assert 'torch' not in sys.modules; print(callable(planner.build_pipeline))"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


def test_rebalance_moves_weight_towards_the_device_that_waited() -> None:
    import planner
    from planner.formats.plan import Plan, Stage

    plan = Plan("dp", "1f1b", 4, (Stage(0, "a", ("x",)), Stage(1, "b", ("y",))), {"step_time_s": 1.0})
    balanced = planner.rebalance(plan, waits={"a": 0.1, "b": 0.1}, compute={"a": 1.0, "b": 1.0})
    assert balanced["balanced"] and balanced["weights"] == {"a": 1.0, "b": 1.0}
    slow_b = planner.rebalance(plan, waits={"a": 1.0, "b": 0.0}, compute={"a": 1.0, "b": 2.0})
    assert not slow_b["balanced"] and slow_b["weights"]["a"] > 1.0 > slow_b["weights"]["b"]


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_own_loop_gets_the_losses_of_plan_run(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    digits_plan(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    steps = "6"
    done = plan_in_process("run", str(tmp_path / "plan.json"), "planner.examples.digits:digits_mlp", "--data",
                           "planner.data.digits:batches", "--steps", steps, "--optimizer", "sgd", "--lr", "0.05",
                           "--no-rebalance", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    expected = json.loads(done.stdout)["losses"]
    own = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "own_loop.py"), str(tmp_path / "plan.json"), "--steps", steps],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr[-2000:]
    got = json.loads(next(line for line in own.stdout.splitlines() if line.startswith("{")))["losses"]
    assert got == pytest.approx(expected, rel=1e-5) and got[-1] < got[0]


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_own_loop_refuses_a_hybrid_plan_in_one_line(tmp_path: Path) -> None:
    """Issue 23, item 1: with `--data-parallel auto` the digits plan on cpu-2 is 1 stage x 2 replicas, and
    `build_pipeline` used to accept it and deadlock. Every rank now refuses it before any collective."""
    from typer.testing import CliRunner

    from planner.cli import app

    digits_plan(tmp_path)
    result = CliRunner().invoke(app, ["partition", str(tmp_path / "profile.json"), "--cluster", "cpu-2", "-d", "2",
                                      "-n", "2", "-o", str(tmp_path / "hybrid.json")])
    assert result.exit_code == 0, result.output
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    own = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "own_loop.py"), str(tmp_path / "hybrid.json"), "--steps", "2"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert own.returncode != 0
    mine = [line for line in own.stderr.splitlines() if line.startswith("error: ")]
    assert len(mine) == 1 and "2 replicas of each stage" in mine[0] and "--data-parallel 1" in mine[0], own.stderr


def test_build_pipeline_refuses_a_job_with_more_ranks_than_the_plan_has_devices(tmp_path: Path) -> None:
    """The README's digits plan with the default placer keeps the MLP on one CPU; started on 2 ranks, the
    rank with no stage used to fail with an IndexError inside torch's schedule (and the other to wait)."""
    import torch.distributed as dist
    import torch.distributed.pipelining  # noqa: F401  before init (see the test below)

    import planner
    from planner.examples.digits import digits_mlp
    from planner.formats.plan import Plan, Stage

    model, example = digits_mlp()
    plan = Plan("dp", "1f1b", 2, (Stage(0, "cpu0", ("x",)), Stage(1, "cpu1", ("y",))), {"step_time_s": 1.0})
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(planner.PlannerError, match=r"runs on 2 rank\(s\).*the job has 1: start it with "
                                                       r"`torchrun --nproc-per-node 2`"):
            planner.build_pipeline(model, example, plan, rank=0, loss_fn=lambda out, y: out.sum())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # a fresh interpreter each: about 5 s
@pytest.mark.parametrize("pipelining_first", [True, False], ids=["imported-before-init", "imported-after-init"])
def test_destroy_process_group_frees_the_default_group_when_pipelining_came_first(pipelining_first: bool) -> None:
    """The CI failure of 2026-11-27: `own_loop.py` aborted a rank at exit ("terminate called without an active
    exception"). torch.distributed.nn.functional, which torch's pipelining imports, binds the default group into its
    default arguments when first imported after init_process_group; the group then outlives destroy_process_group,
    and its gloo threads die in interpreter shutdown. `plan run` imports it before init (its worker module), the
    example does too, and `build_pipeline` warns a loop that does not. Counted by the process's threads."""
    first = "import planner.runtime.launch.worker" if pipelining_first else ""
    script = f"""
import os, warnings
import torch.distributed as dist
{first}
import planner
from planner.examples.digits import digits_mlp
from planner.formats.plan import Plan, Stage
model, example = digits_mlp()
plan = Plan("dp", "1f1b", 2, (Stage(0, "cpu0", ("x",)), Stage(1, "cpu1", ("y",))), {{"step_time_s": 1.0}})
threads = len(os.listdir("/proc/self/task"))
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        planner.build_pipeline(model, example, plan, rank=0, loss_fn=lambda out, y: out.sum())
    except planner.PlannerError:
        pass  # a 2-device plan on 1 rank: refused after the import
dist.destroy_process_group()
pinned = sum("outlives destroy_process_group" in str(w.message) for w in caught)
print(pinned, len(os.listdir("/proc/self/task")) - threads)
"""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    warned, extra_threads = map(int, done.stdout.split())
    if pipelining_first:
        assert (warned, extra_threads) == (0, 0)
    else:
        assert warned == 1 and extra_threads > 0
