"""Hybrid plans (pipeline x data parallel) train exactly as one process does on the same global batch.

Hand-made plans over CPU ranks of one host: pipeline 2 x data 2 on 4 ranks with GPT's tied embedding and
head split across the stages, and data 2 with uneven shares 3:1. Losses and every parameter are compared
with ``train_reference`` (rtol 1e-5, the PyTorch pipelining tests' tolerance). 4 ranks on this 2-core
machine test correctness only, not speed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_runtime_parity import GPT, ROOT, STEPS, TIMEOUT_S, assert_parity, run_pipeline

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def cpu_cluster(count: int) -> dict:
    """The bundled cpu-2 cluster widened to ``count`` CPU ranks on the same host."""
    cluster = json.loads((ROOT / "profiles" / "clusters" / "cpu-2.json").read_text())
    device = cluster["devices"][0]
    cluster["name"] = f"cpu-{count}"
    cluster["devices"] = [dict(device, id=f"cpu{i}") for i in range(count)]
    return cluster


def hybrid_case(tmp: Path, profile_path: Path, replicas: list[list[str]], shares: list[int], schedule: str,
                bounds: list[int] | None = None) -> Path:
    """A plan cutting the profile's ops into ``len(replicas)`` stages, stage ``s`` on ``replicas[s]``: equal ones,
    or between the given node ``bounds``."""
    names = [n["name"] for n in json.loads(profile_path.read_text())["nodes"]]
    parts = len(replicas)
    bounds = bounds or [len(names) * i // parts for i in range(parts + 1)]
    devices = {d for group in replicas for d in group}
    plan = {
        "schema_version": 1, "method": "hand", "schedule": schedule, "microbatches": sum(shares),
        "stages": [{"index": i, "device": group[0], "replicas": group, "nodes": names[bounds[i]:bounds[i + 1]]}
                   for i, group in enumerate(replicas)],
        "data_parallel": {"degree": len(shares), "microbatches": shares, "sync": "ssgd"},
        "predicted": {"step_time_s": 1.0, "devices": {}},
        "profile": {"path": str(profile_path)},
        "cluster": cpu_cluster(len(devices)),
    }
    (tmp / "plan.json").write_text(json.dumps(plan))
    return tmp / "plan.json"


@pytest.fixture(scope="module")
def gpt_profile(tmp_path_factory) -> Path:
    from planner.formats.profile import save_profile
    from planner.profile.profiler import profile_model

    path = tmp_path_factory.mktemp("profiles") / "gpt.json"
    save_profile(profile_model(GPT, repeats=1, warmup=0), path)
    return path


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_pipeline_2_by_data_2_on_4_ranks_with_tied_weights(tmp_path, gpt_profile):
    plan = hybrid_case(tmp_path, gpt_profile, [["cpu0", "cpu2"], ["cpu1", "cpu3"]], [2, 2], "1f1b")
    stages = json.loads(plan.read_text())["stages"]
    assert stages[0]["nodes"][0].startswith("embedding") or any(n.startswith("embedding") for n in stages[0]["nodes"])
    assert stages[1]["nodes"][-1].startswith("linear")  # the head tied to the embedding is on the other stage
    summary = run_pipeline(tmp_path, plan, GPT, launcher="torchrun", extra=("--lr", "0.05"), world=4)
    assert summary["world_size"] == 4 and summary["sync"]["mode"] == "ssgd"
    assert_parity(tmp_path, plan, GPT, summary, lr=0.05, world=4)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_local_sgd_every_step_on_pipeline_2_by_data_2_equals_one_process(tmp_path, gpt_profile):
    """Issue 24: local-sgd with one local step and plain SGD is ssgd, so it trains as one process does."""
    plan = hybrid_case(tmp_path, gpt_profile, [["cpu0", "cpu2"], ["cpu1", "cpu3"]], [3, 1], "gpipe")
    summary = run_pipeline(tmp_path, plan, GPT, launcher="plan",
                           extra=("--lr", "0.05", "--sync", "local-sgd", "--sync-period", "1"), world=4)
    assert summary["sync"]["mode"] == "local-sgd" and summary["sync"]["aggregations"] == STEPS
    assert_parity(tmp_path, plan, GPT, summary, lr=0.05, world=4)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_adaptive_sync_runs_a_hybrid_plan_on_4_ranks(tmp_path, gpt_profile):
    """Issue 24: ``plan run --sync adaptive`` on replicated stages (2 stages x 2 replicas, 4 local ranks): the
    replicas aggregate as prioritised chunks, every rank keeps the same interval, and the losses stay finite."""
    plan = hybrid_case(tmp_path, gpt_profile, [["cpu0", "cpu2"], ["cpu1", "cpu3"]], [2, 2], "1f1b")
    summary = run_pipeline(tmp_path, plan, GPT, launcher="plan",
                           extra=("--lr", "0.05", "--sync", "adaptive", "--sync-period", "2",
                                  "--sync-chunk-bytes", "4096"), world=4)
    sync = summary["sync"]
    assert sync["mode"] == "adaptive" and sync["aggregations"] >= 1 and sync["periods"][0] == 2
    assert all(loss == loss and abs(loss) < 1e3 for loss in summary["losses"])


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_data_2_with_uneven_shares_3_to_1(tmp_path, gpt_profile):
    plan = hybrid_case(tmp_path, gpt_profile, [["cpu0", "cpu1"]], [3, 1], "gpipe")
    summary = run_pipeline(tmp_path, plan, GPT, launcher="plan", extra=("--lr", "0.05"))
    assert summary["world_size"] == 2 and summary["microbatches"] == 4
    sync = summary["sync"]
    assert (sync["mode"], sync["degree"], sync["shares"], sync["aggregations"]) == ("ssgd", 2, [3, 1], STEPS)
    assert_parity(tmp_path, plan, GPT, summary, lr=0.05)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_rebalancing_change_moves_cuts_and_shares_mid_run_and_keeps_training_exact(tmp_path, gpt_profile):
    """pipeline 2 x data 2 on 4 ranks, replica 0's ranks emulated 3x and 4x slower: the re-plan (a test placer that
    cuts at blocks.1.mlp) moves the cut and the hybrid search moves the shares off the slow pipeline;
    parameters migrate, and losses and parameters still equal one process's."""
    from tests._runtime_jobs import job

    names = [n["name"] for n in json.loads(gpt_profile.read_text())["nodes"]]
    modules = [n.get("module_path", "") for n in json.loads(gpt_profile.read_text())["nodes"]]
    cut = next(i for i, m in enumerate(modules) if m.startswith("blocks.1.mlp"))
    # The plan in force leaves the second stage only the last 4 ops, so the shifted cut is predicted faster whatever
    # speeds the fit reads on 4 ranks sharing 2 cores: from equal halves, the fit once predicted it slower and the
    # test saw no re-plan (a fresh clone, 2026-11-26).
    plan = hybrid_case(tmp_path, gpt_profile, [["cpu0", "cpu2"], ["cpu1", "cpu3"]], [4, 4], "gpipe",
                       bounds=[0, len(names) - 4, len(names)])
    assert len(json.loads(plan.read_text())["stages"][0]["nodes"]) != cut
    log = tmp_path / "rounds.jsonl"
    # patience 3 over 5 rounds: a round whose waits the shared machine blurs does not end rebalancing early; any
    # predicted gain adopts the re-plan (min_improvement 0): 4 ranks on 2 cores blur the fitted speeds, and the
    # default 5% then failed about 1 run in 4, before and after this test's subject changed
    options = {"emulate_slowdown": "0=3.0,1=4.0", "log": str(log), "replan_method": "test-shift", "patience": 3,
               "min_improvement": 0.0}
    env = {"PLANNER_TEST_HOOKS": "tests._shift_placer:hooks", "PLANNER_TEST_CUT": str(cut),
           "PLANNER_TEST_PARAMS_OUT": str(tmp_path / "params")}
    code, summary, _ = job(plan, STEPS + 7, options, env=env, nproc=4)
    assert code == 0, summary
    rounds = [json.loads(line) for line in log.read_text().splitlines() if '"round"' in line]
    changed = [r for r in rounds if r["plan_changed"]]
    assert changed and changed[0]["moved_tensors"] > 0
    final = summary["plan"]
    assert len(final["stages"][0]["nodes"]) == cut  # the cut moved
    assert final["data_parallel"]["microbatches"] != [4, 4]  # so did the shares
    assert sum(final["data_parallel"]["microbatches"]) == 8 and len(final["stages"][0]["replicas"]) == 2
    assert sorted(n for st in final["stages"] for n in st["nodes"]) == sorted(names)  # no node dropped
    assert_parity(tmp_path, plan, GPT, summary, world=4, steps=STEPS + 7)


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_hybrid_run_checkpoints_and_resumes_with_unchanged_training(tmp_path, gpt_profile):
    """Data 2 at shares 3:1 checkpoints every 2 steps (each replica's copy of every tensor); a second job resumes
    at step 4 under the checkpoint's plan and trains to step 8 exactly as one uninterrupted process would."""
    from tests._runtime_jobs import stopped_and_resumed

    plan = hybrid_case(tmp_path, gpt_profile, [["cpu0", "cpu1"]], [3, 1], "gpipe")
    _, second = stopped_and_resumed(plan, tmp_path, 4, 8)
    assert_parity(tmp_path, plan, GPT, second, steps=8)


CHUNKED_REPLICAS = {
    "interleaved-1f1b": ([["cpu0", "cpu2"], ["cpu1", "cpu3"], ["cpu0", "cpu2"], ["cpu1", "cpu3"]], [2, 2]),
    "dualpipev": ([["cpu0", "cpu2"], ["cpu1", "cpu3"], ["cpu1", "cpu3"], ["cpu0", "cpu2"]], [4, 4]),
}
"""Schedule -> (stage replicas, shares): two replica pipelines of two ranks, each rank holding two stages
(round-robin, or in a V, where rank 0 of each pipeline holds the embedding and the tied head)."""


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("schedule", list(CHUNKED_REPLICAS))
def test_replicated_pipelines_with_two_stages_per_rank_train_as_one_process(tmp_path, gpt_profile, schedule):
    """Issues 27 and 28: interleaved and V plans with replicas (2 chunks per rank x 2 replicas on 4 ranks; correctness
    only on this 2-core machine). The DeviceMesh has one row of distinct ranks per replica, each rank's two stages
    all-reduce with their replicas, and losses and parameters equal one process's."""
    replicas, shares = CHUNKED_REPLICAS[schedule]
    plan = hybrid_case(tmp_path, gpt_profile, replicas, shares, schedule)
    summary = run_pipeline(tmp_path, plan, GPT, launcher="plan", extra=("--lr", "0.05"), world=4)
    assert summary["world_size"] == 4 and summary["schedule"] == schedule and summary["sync"]["degree"] == 2
    assert_parity(tmp_path, plan, GPT, summary, lr=0.05, world=4)
