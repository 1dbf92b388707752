"""The gold test of ``plan run``: pipelined training on 2 gloo ranks equals single-process training.

Each case profiles a tiny model, cuts its op list into a hand-made plan (GPT: the tied embedding on the
first stage and the LM head on the last; U-Net: long skips crossing the cut), trains 3 steps with
``plan run`` (which starts its ranks with torch's elastic launcher on a free port; run inside the test process,
``tests/_inproc.py``) or with ``torchrun --standalone -m planner.run``, and compares losses and every updated
parameter with ``train_reference`` (rtol 1e-5, atol 1e-5).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from planner.formats.profile import save_profile
from planner.profile.loader import load_factory
from planner.profile.profiler import profile_model
from planner.runtime.pipeline.graph_split import assign_nodes, split_graph
from planner.runtime.launch.prepare import prepare
from planner.runtime.pipeline.training import train_reference
from planner.runtime.launch.config import RunConfig
from tests._inproc import plan as plan_in_process

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

GPT = "planner.examples.gpt:gpt_tiny"
UNET = f"{Path(__file__).resolve()}:unet_tiny"
STEPS = 3
TIMEOUT_S = 240
ROOT = Path(__file__).resolve().parents[1]


def unet_tiny():
    """Two levels, 8/16 channels, 16x16 images: the skip from level 0 crosses the cut."""
    from planner.examples.unet import UNet

    torch.manual_seed(0)
    return UNet(widths=(8, 16)), (torch.randn(2, 3, 16, 16),)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory) -> dict[str, Path]:
    """One profile per model, shared by the cases (measuring takes a few seconds)."""
    root = tmp_path_factory.mktemp("profiles")
    paths = {}
    for key, model in (("gpt", GPT), ("unet", UNET)):
        paths[model] = root / f"{key}.json"
        save_profile(profile_model(model, repeats=1, warmup=0), paths[model])
    return paths


def write_case(tmp: Path, profile_path: Path, devices: list[str], schedule: str, microbatches: int,
               cut_at: float | None = None) -> Path:
    """A plan over ``devices`` (ids of the bundled cpu-2 cluster) cutting the profile's ops in order:
    equal parts, or ``cut_at`` for 2 stages."""
    names = [n["name"] for n in json.loads(profile_path.read_text())["nodes"]]
    parts = len(devices)
    bounds = [len(names) * i // parts for i in range(parts + 1)]
    if cut_at is not None:
        bounds = [0, round(len(names) * cut_at), len(names)]
    plan = {
        "schema_version": 1, "method": "hand", "schedule": schedule, "microbatches": microbatches,
        "stages": [{"index": i, "device": d, "nodes": names[bounds[i]:bounds[i + 1]]} for i, d in enumerate(devices)],
        "predicted": {"step_time_s": 1.0, "devices": {}},
        "profile": {"path": str(profile_path)},
        "cluster": json.loads((ROOT / "profiles" / "clusters" / "cpu-2.json").read_text()),  # as partition embeds it
    }
    (tmp / "plan.json").write_text(json.dumps(plan))
    return tmp / "plan.json"


def run_pipeline(tmp: Path, plan: Path, model: str, *, launcher: str, extra: tuple[str, ...] = (), world: int = 2) -> dict:
    """Train with ``plan run`` in this process (``tests/_inproc.py``) or with ``torchrun -m planner.run``."""
    # A relative --params-out: the ranks write in the launcher's working directory, also when their fork server
    # was started by an earlier job in another directory (tests/_inproc.py).
    args = [str(plan), model, "--steps", str(STEPS), "--round-steps", "2", "--json",
            "--params-out", "params", "--timeout-s", "60", "--no-rebalance", *extra]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
               "-m", "planner.run", *args]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    else:
        done = plan_in_process("run", *args, "--nproc-per-node", str(world), cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout[done.stdout.index("{"):])


def assert_parity(tmp: Path, plan: Path, model: str, summary: dict, skip: tuple[str, ...] = (), world: int = 2,
                  steps: int = STEPS, parameter_free_ok: bool = False, **options: Any) -> Any:
    """The run's losses and every rank's parameters equal one process's. ``parameter_free_ok``: a rank may end with
    no parameters (a re-plan may leave a slow rank only parameter-free ops); otherwise every rank must have some."""
    config = RunConfig(plan=str(plan), model=model, steps=steps, **options)
    prepared = prepare(config, world, torch.device("cpu"))
    torch.manual_seed(0)
    module, _ = load_factory(model, microbatch_size=prepared.settings.microbatch_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs: CPU kernels sum in a thread-count-dependent order
    try:
        reference = train_reference(module, prepared.spec, prepared.settings, prepared.batch, steps)
    finally:
        torch.set_num_threads(threads)
    assert summary.get("steps", steps) == steps and len(summary["losses"]) == steps
    torch.testing.assert_close(torch.tensor(summary["losses"], dtype=torch.float64),
                               torch.tensor(reference.losses, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    shards = [torch.load(tmp / "params" / f"rank{r}.pt") for r in range(world)]
    for shard in shards:
        assert shard or parameter_free_ok, "every rank trains some parameters"
    for name, expected in reference.params.items():
        if name.endswith(skip) and skip:
            continue
        holders = [s[name] for s in shards if name in s]
        assert holders, f"parameter {name} was trained by no rank"
        for value in holders:  # a tied parameter held by both ranks must match on both
            torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5, msg=name)
    torch.manual_seed(0)
    initial, _ = load_factory(model)
    changed = [n for n, v in initial.named_parameters() if not torch.equal(v.detach(), reference.params[n])]
    assert len(changed) >= len(reference.params) - 2  # parameters were trained, so equality means something
    return prepared


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpt_with_tied_weights_split_across_ranks(tmp_path, profiles, schedule):
    plan = write_case(tmp_path, profiles[GPT], ["cpu0", "cpu1"], schedule, microbatches=2)
    stages = json.loads(plan.read_text())["stages"]
    first_params = [n for n in stages[0]["nodes"] if n.startswith("embedding")]
    assert first_params and stages[1]["nodes"][-1].startswith("linear")  # embedding first, tied head last
    launcher = "torchrun" if schedule == "1f1b" else "plan"
    summary = run_pipeline(tmp_path, plan, GPT, launcher=launcher, extra=("--lr", "0.05"))
    assert summary["schedule"] == schedule and summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert summary["optimizer"] == "sgd" and summary["loss"] == "lm-cross-entropy"
    assert_parity(tmp_path, plan, GPT, summary, lr=0.05)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_gpt_with_adam(tmp_path, profiles):
    """Adam: losses and every parameter with a real gradient match. The attention's key bias does not
    change the output (softmax ignores a constant per query), so its true gradient is 0 and Adam turns
    ~1e-9 rounding noise into lr-sized steps of arbitrary sign; it is left out of the comparison."""
    plan = write_case(tmp_path, profiles[GPT], ["cpu0", "cpu1"], "1f1b", microbatches=4)
    summary = run_pipeline(tmp_path, plan, GPT, launcher="plan", extra=("--optimizer", "adam"))
    assert summary["optimizer"] == "adam" and summary["microbatches"] == 4
    assert_parity(tmp_path, plan, GPT, summary, optimizer="adam", skip=("attn.qkv.bias",))


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_unet_with_long_skips(tmp_path, profiles, schedule):
    plan = write_case(tmp_path, profiles[UNET], ["cpu0", "cpu1"], schedule, microbatches=2, cut_at=0.45)
    # SGD: the conv biases before GroupNorm have a true gradient of 0, and Adam would turn the rounding
    # noise in it into lr-sized steps that differ between any two summation orders.
    summary = run_pipeline(tmp_path, plan, UNET, launcher="plan", extra=("--lr", "0.05"))
    assert summary["optimizer"] == "sgd" and summary["loss"] == "mse"
    prepared = assert_parity(tmp_path, plan, UNET, summary, lr=0.05)
    stage_of = assign_nodes(prepared.captured, prepared.plan.assignment(), 2)
    second = split_graph(prepared.captured, prepared.module, stage_of, 2)[1]
    assert len(second.input_names) >= 2  # the bottleneck path and at least one long skip cross the cut


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_gpt_interleaved_two_stages_per_rank(tmp_path, profiles):
    """Interleaved 1F1B: stages 0 and 2 on rank 0, 1 and 3 on rank 1; the tied weight is read by
    stage 0 (rank 0) and stage 3 (rank 1)."""
    plan = write_case(tmp_path, profiles[GPT], ["cpu0", "cpu1", "cpu0", "cpu1"], "interleaved-1f1b", microbatches=4)
    summary = run_pipeline(tmp_path, plan, GPT, launcher="plan", extra=("--lr", "0.05"))
    assert summary["schedule"] == "interleaved-1f1b" and summary["world_size"] == 2
    assert_parity(tmp_path, plan, GPT, summary, lr=0.05)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_stage_whose_input_is_an_index_from_another_rank(tmp_path, profiles):
    """The cut after the token embedding sends the position ids (``arange``'s output, int64) to the stage that looks
    them up. torch infers each stage's metadata by running it on inputs made with ``torch.empty``; the fault plugin
    fills those with what reused memory may hold, as after a mid-run re-plan moved the cut here (an IndexError in
    the position embedding, 2026-11-27)."""
    from tests._runtime_jobs import job

    names = [n["name"] for n in json.loads(profiles[GPT].read_text())["nodes"]]
    plan = write_case(tmp_path, profiles[GPT], ["cpu0", "cpu1"], "1f1b", microbatches=2,
                      cut_at=names.index("embedding_1") / len(names))
    stages = json.loads(plan.read_text())["stages"]
    assert "arange" in stages[0]["nodes"] and stages[1]["nodes"][0] == "embedding_1"
    env = {"PLANNER_TEST_STALE_BUFFERS": "1", "PLANNER_TEST_PARAMS_OUT": str(tmp_path / "params")}
    code, summary, _ = job(plan, STEPS, {"rebalance": False}, env=env)
    assert code == 0, summary
    assert_parity(tmp_path, plan, GPT, summary)


def _tied_sync(rank: int, world: int) -> None:
    import torch.distributed as dist

    from planner.runtime.pipeline.stages import RankStages, TiedGroup, sync_tied_grads, sync_tied_params

    weight = torch.nn.Parameter(torch.full((3,), float(rank + 1)))  # a factory that differs per rank
    weight.grad = torch.full((3,), 10.0 * (rank + 1))
    group = dist.new_group([0, 1])
    stages = RankStages(None, rank, (0, 1), (), (), {"w": weight}, (TiedGroup("w", (0, 1), group),))
    sync_tied_params(stages)
    sync_tied_grads(stages)
    assert torch.equal(weight.detach(), torch.full((3,), 1.0))  # rank 0's copy everywhere
    assert torch.equal(weight.grad, torch.full((3,), 30.0))  # the sum of both ranks' gradients


@pytest.mark.timeout(120)
def test_tied_copies_start_equal_and_gradients_are_summed():
    from tests._gloo import run_ranks

    run_ranks(_tied_sync, 2, timeout_s=90)


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("which", ["every stage, as earlier versions wrote it", "the first stage only"])
def test_gpt_with_recomputation(tmp_path, profiles, which):
    """Activation recomputation (a stage's ``recompute: "full"``: the stage wrapped in torch.utils.checkpoint) trains
    exactly as single-process training does: the tied GPT split across ranks, 1F1B; in every stage (the top-level
    flag of earlier versions' plans) and in one stage of two."""
    plan = write_case(tmp_path, profiles[GPT], ["cpu0", "cpu1"], "1f1b", microbatches=2)
    doc = json.loads(plan.read_text())
    if which.startswith("every"):
        doc["recompute"] = True
    else:
        doc["stages"][0]["recompute"] = "full"
    plan.write_text(json.dumps(doc))
    summary = run_pipeline(tmp_path, plan, GPT, launcher="plan", extra=("--lr", "0.05"))
    assert_parity(tmp_path, plan, GPT, summary, lr=0.05)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_memory_tight_cluster_gets_a_plan_with_recomputation_that_runs(tmp_path, profiles):
    """On a cluster with too little memory for any split's saved activations, --recompute auto plans with
    recomputation (every split without it is refused), and the plan trains as single-process training does."""
    from planner.app.partition import partition_file
    from planner.errors import InfeasibleError

    cluster = json.loads((ROOT / "profiles" / "clusters" / "cpu-2.json").read_text())
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(cluster))
    options = dict(method="dp", microbatches=8, schedule="gpipe", data_parallel=1)
    roomy = partition_file(profiles[UNET], str(path), None, recompute="on", **options)
    without = partition_file(profiles[UNET], str(path), None, recompute="off", **options)
    need_on, need_off = roomy.peak_memory_bytes, without.peak_memory_bytes
    assert need_on < need_off / 2  # GPipe keeps 8 micro-batches of activations; recomputation keeps their inputs
    for device in cluster["devices"]:
        device["memory_bytes"] = int(need_on * 1.1)
    path.write_text(json.dumps(cluster))
    with pytest.raises(InfeasibleError):
        partition_file(profiles[UNET], str(path), None, recompute="off", **options)
    plan = partition_file(profiles[UNET], str(path), tmp_path / "plan.json", recompute="auto", **options)
    assert any(plan.recomputed()) and plan.peak_memory_bytes <= need_on * 1.1
    assert plan.step_time_s > without.step_time_s  # the forward runs twice
    summary = run_pipeline(tmp_path, tmp_path / "plan.json", UNET, launcher="plan", extra=("--lr", "0.05"))
    assert_parity(tmp_path, tmp_path / "plan.json", UNET, summary, lr=0.05)
