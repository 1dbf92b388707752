"""``plan train``: the strategy it picks, the profile cache, bad input before anything is profiled, and one run
end to end on 2 ranks with the digits data.

The dry runs read committed profiles through the cache (seeded under the key ``plan train`` computes), so they
plan without measuring; the cache tests and the end-to-end run measure for real.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.cli import app
from tests._inproc import plan as plan_in_process

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "profiles"
runner = CliRunner()


def invoke(*args: str | Path, cache: Path) -> tuple[int, str, str]:
    result = runner.invoke(app, ["train", *map(str, args)], env={"PLANNER_CACHE_DIR": str(cache), "COLUMNS": "160"})
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def seed_cache(cache: Path, model: str, cluster: str, golden: str) -> None:
    """Put a committed profile where ``plan train`` will look for ``model`` on ``cluster`` (its cache key)."""
    from planner.app.train import TrainRequest, check_request
    from planner.profile.cache import cached_profile_path, profile_key

    request = TrainRequest(model=model, cluster=cluster, dry_run=True)
    checked = check_request(request)
    key, _ = profile_key(model, input_spec=None, microbatch_size=None, tracer="auto", colocate=checked.colocate,
                         repeats=request.repeats, warmup=request.warmup, estimate=checked.estimate, model_output=None)
    path = cached_profile_path(key, cache)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(GOLDEN / f"{golden}.json", path)


@pytest.mark.slow  # the whole strategy search: 4-9 s, and about 30 s on 4 T4s
@pytest.mark.parametrize("model, golden, cluster", [
    ("planner.examples.gpt:gpt_tiny", "gpt_tiny", "cpu-2"),
    ("planner.examples.gpt:gpt_tiny", "gpt_tiny", "a100-4"),
    ("planner.examples.resnet:resnet_small", "resnet_small", "t4-4-pcie"),
    ("planner.examples.unet:unet_small", "unet_small", "cpu-2"),
])
def test_dry_run_picks_the_fastest_recorded_candidate_and_the_plan_passes_check(
        tmp_path: Path, model: str, golden: str, cluster: str) -> None:
    from planner.app.check import check_files

    cache, out = tmp_path / "cache", tmp_path / "out"
    seed_cache(cache, model, cluster, golden)
    code, stdout, stderr = invoke(model, "--cluster", cluster, "-o", out, "--dry-run", "--json", cache=cache)
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["profile"]["cached"] is True and summary["dry_run"] is True
    assert "run" not in summary and not (out / "rounds.jsonl").exists()
    for name in ("profile", "plan", "timeline_png", "timeline_svg", "trace", "summary"):
        assert Path(summary["artifacts"][name]).is_file(), name
    result = check_files(out / "plan.json")
    assert result.passed, result
    chosen, *others = summary["strategy"]["candidates"]
    plan = json.loads((out / "plan.json").read_text())
    assert chosen["verdict"] == "chosen" and chosen["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"])
    planned_alike = [c for c in others if c["step_time_s"] is not None and c.get("sync") in (None, "ssgd")]
    assert planned_alike, "the search recorded no alternative"
    assert all(c["step_time_s"] >= chosen["step_time_s"] * (1 - 1e-9) for c in planned_alike)
    sync = summary["strategy"]["sync"]
    if chosen["degree"] > 1:  # the sync rule ran and recorded both modes' predictions
        assert {a["sync"] for a in sync["alternatives"]} == {"ssgd", "adaptive"}
        assert chosen["sync"] == ("adaptive" if sync["ssgd_sync_share"] > 0.1 else "ssgd")


def test_the_search_prices_an_asynchronous_schedule_for_the_rounds_the_run_drains_at(tmp_path: Path) -> None:
    """``plan train`` drains an asynchronous pipeline at every round end: its plan is predicted for ``--round-steps``
    (``async.drain_every``), and shorter rounds predict a slower step; a run that ends within the synchronous
    warm-up (default 50 steps) drains every step, and is priced so."""
    model = "planner.examples.gpt:gpt_tiny"
    cache = tmp_path / "cache"
    seed_cache(cache, model, "cpu-2", "gpt_tiny")
    steps = {}
    for rounds, run in ((1, ["--steps", "60"]), (4, ["--steps", "60"]), (4, []), (4, ["--async-warmup", "0"])):
        out = tmp_path / f"out{rounds}{''.join(run)}"
        code, _, stderr = invoke(model, "--cluster", "cpu-2", "--schedule", "async-1f1b", "--microbatches", "2",
                                 "--data-parallel", "1", "--round-steps", str(rounds), *run, "-o", out, "--dry-run",
                                 "--json", cache=cache)
        assert code == 0, stderr
        plan = json.loads((out / "plan.json").read_text())
        assert plan["async"]["drain_every"] == (1 if not run else rounds), run  # 40 steps by default
        assert plan["async"]["warmup"] == (0 if "0" in run else 50)
        steps[rounds, tuple(run)] = plan["predicted"]["step_time_s"]
    assert steps[1, ("--steps", "60")] > steps[4, ("--steps", "60")] == steps[4, ("--async-warmup", "0")]
    assert steps[4, ()] == steps[1, ("--steps", "60")]


MODEL_SOURCE = '''
import torch
from torch import nn


def build():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 16))
    return model, (torch.randn(8, 16),)
'''


@pytest.mark.slow  # measures for real: outside the fast tier (docs/ci.md)
def test_under_torchrun_the_plan_uses_every_rank_though_one_device_is_fastest(tmp_path: Path) -> None:
    """digits_mlp profiled under load in a CI run: twice the rows took no longer (fixed_fraction 1), so one device
    with one micro-batch of 128 rows is the fastest plan on cpu-2, and plan train alone starts one rank. torchrun
    has started two already: the plan must use both, as replicas of that plan, and its weights cover the devices
    it runs on (the runtime refused weights for a device without a rank)."""
    from planner.app.train import ProfileUse, TrainRequest, _every_rank_degree, choose_strategy
    from planner.errors import PlannerError
    from planner.formats.profile import load_profile
    from planner.partition.search.rebalance import initial_state
    from planner.runtime.launch.prepare import world_size_of
    from planner.runtime.rebalancing.replan import device_order, start_weights

    path = GOLDEN / "digits_mlp-launch-bound.json"
    profile = ProfileUse(path, load_profile(path), True, path, 0.0)
    request = TrainRequest(model="planner.examples.digits:digits_mlp", cluster="cpu-2", dry_run=True)
    alone = choose_strategy(profile, request)
    assert world_size_of(alone.plan) == 1 and alone.every_rank is None
    assert set(alone.plan.extra["weights"]) == {"cpu0", "cpu1"}  # the placer's, for the whole cluster
    assert start_weights(alone.plan) == {"cpu0": 1.0}
    initial_state(device_order(alone.plan), start_weights(alone.plan))
    with pytest.raises(PlannerError, match="cpu1"):
        initial_state(device_order(alone.plan), alone.plan.extra["weights"])
    both = choose_strategy(profile, request, ranks=2)
    assert world_size_of(both.plan) == 2 and both.plan.shape().degree == 2
    assert both.every_rank == {"fastest_uses": 1, "ranks": 2, "data_parallel": 2}
    assert [_every_rank_degree(used, ranks, "auto") for used, ranks in ((1, 2), (2, 4), (3, 4))] == [2, 2, 4]
    with pytest.raises(PlannerError, match="describe 2 devices"):
        _every_rank_degree(4, 2, "auto")
    with pytest.raises(PlannerError, match="start 1 ranks"):
        _every_rank_degree(1, 2, "1")


@pytest.mark.slow  # profiles a model twice for real: about 24 s
def test_the_profile_cache_is_used_on_the_second_call_and_refreshed_when_the_model_changes(tmp_path: Path) -> None:
    cache, source = tmp_path / "cache", tmp_path / "tiny_model.py"
    source.write_text(MODEL_SOURCE.replace("WIDTH", "32"))
    args = (f"{source}:build", "--cluster", "cpu-2", "--dry-run", "--repeats", "1", "--warmup", "0")
    first = invoke(*args, "-o", tmp_path / "a", cache=cache)
    assert first[0] == 0, first[2]
    assert "profile: measuring" in first[1]
    second = invoke(*args, "-o", tmp_path / "b", cache=cache)
    assert second[0] == 0 and "profile: from the cache" in second[1], second
    assert (tmp_path / "a" / "profile.json").read_bytes() == (tmp_path / "b" / "profile.json").read_bytes()
    source.write_text(MODEL_SOURCE.replace("WIDTH", "48"))  # a changed layer: another graph, another profile
    third = invoke(*args, "-o", tmp_path / "c", cache=cache)
    assert third[0] == 0 and "profile: measuring" in third[1], third
    assert len(list((cache / "profiles").iterdir())) == 2
    fourth = invoke(*args, "--reprofile", "-o", tmp_path / "d", cache=cache)
    assert "profile: measuring" in fourth[1]


@pytest.mark.parametrize("args, expected", [
    (["no_colon_here", "--cluster", "cpu-2"], "MODEL must look like"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "no-such-cluster"], "no-such-cluster"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "dgx-h100-8"], "pass --dry-run to plan only"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--steps", "0"], "--steps must be"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--schedule", "zigzag"], "unknown schedule 'zigzag'"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--target", "speed=3"], "target"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--sync", "gossip"], "sync"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--sync-period", "4"], "--sync-period goes with"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "-n", "4", "--global-batch", "32"], "--global-batch"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--data-parallel", "many"], "--data-parallel"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--method", "magic"], "magic"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--data", "nowhere.mod:batches"], "--data"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--emulate-link", "fast"], "link"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--optimizer", "lion"], "--optimizer"),
    (["planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "--eval-every", "0", "--target", "loss=1"], "--target"),
])
def test_bad_options_get_one_line_before_anything_is_profiled(tmp_path: Path, args: list[str], expected: str) -> None:
    cache, out = tmp_path / "cache", tmp_path / "out"
    code, stdout, stderr = invoke(*args, "-o", out, cache=cache)
    lines = stderr.strip().splitlines()
    assert code != 0 and len(lines) == 1 and lines[0].startswith("error: "), (code, stdout, stderr)
    assert expected in lines[0]
    assert not cache.exists() and not out.exists()


def test_an_output_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.write_text("x")
    code, _, stderr = invoke("planner.examples.gpt:gpt_tiny", "--cluster", "cpu-2", "-o", out, cache=tmp_path / "c")
    assert code != 0 and "is a file" in stderr and out.read_text() == "x"


def test_a_model_that_fails_leaves_no_output_directory(tmp_path: Path) -> None:
    source = tmp_path / "broken.py"
    source.write_text("def build():\n    raise RuntimeError('no model today')\n")
    out = tmp_path / "out"
    code, _, stderr = invoke(f"{source}:build", "--cluster", "cpu-2", "-o", out, "--dry-run", cache=tmp_path / "c")
    assert code != 0 and len(stderr.strip().splitlines()) == 1 and not out.exists(), stderr


@pytest.mark.distributed
@pytest.mark.timeout(420)
def test_train_end_to_end_on_two_ranks_reaches_the_digits_target(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # -d 2: two ranks whatever the profile says. The model is so small that one device can be the fastest plan
    # (twice the rows cost little more; see the every-rank test above), and a noisy profile decides which.
    done = plan_in_process("train", "planner.examples.digits:digits_mlp", "--cluster", "cpu-2", "--data",
                           "planner.data.digits:batches", "--target", "accuracy=0.95", "--repeats", "2", "--timeout-s",
                           "60", "-d", "2", "-o", str(out), "--json", env={"PLANNER_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    run = summary["run"]
    assert run["world_size"] == 2
    assert summary["time_to_target_s"] is not None and run["eval"][-1]["accuracy"] >= 0.95
    assert run["steps"] < 1000  # stopped at the target, not at the step cap
    assert run["schedule"] == summary["strategy"]["chosen"]["schedule"]
    for name in ("plan", "timeline_png", "trace", "rounds", "final_plan", "curves_png", "summary"):
        assert Path(summary["artifacts"][name]).is_file(), name
    assert json.loads((out / "summary.json").read_text())["run"]["steps"] == run["steps"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("own_store", ["0", "1"])
def test_train_under_torchrun_plans_on_rank_0_and_hands_the_plan_to_the_others(tmp_path: Path, own_store: str) -> None:
    """The same command on every rank (as on every host): rank 0 profiles and plans, rank 1 takes the profile and
    the plan through the job's store -- the launcher's shared one, or (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as
    plan run's own launcher sets it) the one rank 0 serves for the process group --, both train, rank 0 prints the
    summary. The second job starts from the launch-bound digits profile in the cache (one device is fastest):
    rank 0 plans two replicas, so that both ranks train, and the summary says why."""
    measure = ("--repeats", "1", "--warmup", "0")  # a quick profile; the seeded one is cached for the defaults
    if own_store == "1":
        seed_cache(tmp_path / "cache", "planner.examples.digits:digits_mlp", "cpu-2", "digits_mlp-launch-bound")
        measure = ()
    env = {**os.environ, "PLANNER_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": own_store}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "planner.train", "planner.examples.digits:digits_mlp", "--cluster", "cpu-2", "--data",
                           "planner.data.digits:batches", "--steps", "4", "--round-steps", "2", *measure,
                           "--timeout-s", "60", "-o", "out", "--json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["run"]["steps"] == 4 and summary["run"]["world_size"] == 2
    assert summary["profile"]["cached"] is (own_store == "1")
    if own_store == "1":
        assert summary["strategy"]["every_rank"] == {"fastest_uses": 1, "ranks": 2, "data_parallel": 2}
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert summary["run"]["schedule"] == plan["schedule"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_under_torchrun_on_two_nodes_runs_the_same_command_on_each_host(tmp_path: Path) -> None:
    """Two hosts, emulated on this machine: two torchrun agents (``--nnodes 2``, one rank each, the c10d rendezvous over
    loopback, docs/train.md's command), each in its own directory with its own profile cache as a host would have,
    run the same ``plan train`` command. The rank that rendezvous makes 0 profiles and plans; the other takes both
    through the store and writes the same plan under its own ``-o``; both train, and rank 0 prints the summary."""
    from tests._runtime_jobs import emulated_hosts, free_port

    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "planner.train",
               "planner.examples.digits:digits_mlp", "--cluster", "cpu-2", "--data", "planner.data.digits:batches",
               "--steps", "4", "--round-steps", "2", "--repeats", "1", "--warmup", "0", "--timeout-s", "60",
               "-o", "out", "--json"]
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for home in hosts:
        home.mkdir()
    results = emulated_hosts([(command, home, {**os.environ, "PLANNER_CACHE_DIR": str(home / "cache"),
                                               "OMP_NUM_THREADS": "1"}) for home in hosts], timeout_s=280)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    printed = [out for _, out, _ in results if "{" in out]
    assert len(printed) == 1  # rank 0's summary, on whichever host rendezvous made rank 0
    summary = json.loads(printed[0][printed[0].index("{"):])
    assert summary["run"]["steps"] == 4 and summary["run"]["world_size"] == 2
    plans = [json.loads((home / "out" / "plan.json").read_text()) for home in hosts]
    assert plans[0] == plans[1] and summary["run"]["schedule"] == plans[0]["schedule"]
