"""Seed 000's asynchronous pipeline (issue 26): the order, the version rule, the correction, the simulator, the
memory model, the runtime against its single-process references, and bad input."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any, Callable, Sequence

import pytest

from _partition_cases import FREE, chain, cluster
from planner.errors import PlannerError
from planner.formats.catalog import load_catalog
from planner.partition import partition
from planner.formats.plan import DEFAULT_ASYNC_WARMUP
from planner.partition.sim.schedules import (BWD, FWD, UPD, async_orders, async_spans, async_staleness,
                                             forward_version, inflight_counts, stashed_versions)
from planner.partition.sim.simulate import SimStage, simulate
from tests._digits import digits_plan
from tests._inproc import plan as plan_in_process


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_async_orders_run_every_pass_once_and_step_after_every_mth_backward(p: int, m: int) -> None:
    steps = 4
    for r, order in enumerate(async_orders(p, m, steps)):
        passes = [op for op in order if op[0] != UPD]
        assert sorted(passes) == sorted([(FWD, r, k) for k in range(steps * m)] + [(BWD, r, k) for k in range(steps * m)])
        assert all(order.index((FWD, r, k)) < order.index((BWD, r, k)) for k in range(steps * m))
        updates = [i for i, op in enumerate(order) if op[0] == UPD]
        assert [order[i] for i in updates] == [(UPD, r, u) for u in range(steps)]
        assert all(order[i - 1] == (BWD, r, (u + 1) * m - 1) for u, i in enumerate(updates))
        assert inflight_counts(passes)[r] == min(p - r, steps * m)  # 1F1B's depth, kept across steps


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 2), (4, 3), (4, 8)])
def test_async_1f1b_forwards_use_the_weights_the_order_has_made_by_then(p: int, m: int) -> None:
    """The documented version rule, checked against the order itself: the updates a stage has run before the
    forward of k. (The runtime asserts the same on every forward; the reference test below relies on it.)"""
    for r, order in enumerate(async_orders(p, m, 5)):
        done = 0
        for kind, _, j in order:
            if kind == UPD:
                done += 1
            elif kind == FWD:
                assert forward_version("async-1f1b", r, p, m, j) == done, (r, j)


def test_one_in_flight_is_synchronous_and_2bw_is_one_update_old() -> None:
    for k in range(40):
        assert forward_version("async-1f1b", 0, 4, 4, k, inflight=1) == k // 4
        assert forward_version("2bw", 0, 4, 4, k) == max(0, k // 4 - 1)
    assert [async_staleness("async-1f1b", s, 4, 1) for s in range(4)] == [3, 2, 1, 0]
    assert [async_staleness("2bw", s, 4, 4) for s in range(4)] == [1, 1, 1, 1]
    assert [stashed_versions("2bw", s, 4, 8) for s in range(4)] == [1, 1, 1, 1]  # PipeDream-2BW: 2 versions


def test_the_warm_up_drains_each_of_its_steps_and_runs_them_on_their_own_version() -> None:
    assert async_spans(0, 5, 0) == [(0, 5)]
    assert async_spans(0, 5, 3) == [(0, 1), (1, 1), (2, 1), (3, 2)]  # it ends inside the round
    assert async_spans(5, 5, 3) == [(5, 5)] and async_spans(0, 3, 50) == [(0, 1), (1, 1), (2, 1)]
    for schedule in ("async-1f1b", "2bw"):
        for k in range(40):  # stage 0 of 4, 4 micro-batches a step, warm-up 6 steps
            step = k // 4
            version = forward_version(schedule, 0, 4, 4, k, warmup=6)
            assert version == step if step < 6 else version == forward_version(schedule, 0, 4, 4, k)
    # one step per span is 1F1B's order with its flush: every forward of the step runs on that step's version
    for r, order in enumerate(async_orders(4, 4, 1)):
        assert [forward_version("async-1f1b", r, 4, 4, 8 + j, round_start=8) for kind, _, j in order if kind == FWD] \
            == [2] * 4


def test_weight_prediction_under_sgd_is_where_sgd_would_be_tau_steps_later() -> None:
    torch = pytest.importorskip("torch")
    from planner.runtime.pipeline.asynchronous import Version, predict_weights

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    optimizer = torch.optim.SGD([w], lr=0.1)
    grad = torch.tensor([0.5, 1.0, -2.0])
    before = w.detach().clone()
    w.grad = grad.clone()
    optimizer.step()
    version = Version(1, {"w": w.detach().clone()}, {"w": (w.detach() - before)})
    for tau in (1, 2, 3):
        expected = w.detach() - 0.1 * tau * grad
        assert torch.allclose(predict_weights(version, tau)["w"], expected)
    assert predict_weights(version, 0)["w"] is version.weights["w"]
    assert predict_weights(Version(0, {"w": before}, None), 2)["w"] is before  # nothing to extrapolate from yet


def test_the_simulator_has_no_bubble_in_the_steady_state_and_counts_the_updates() -> None:
    stages = [SimStage(f"d{i}", 1.0, 2.0, 0, 0, 0, 0, update_s=0.5) for i in range(2)]
    flush = simulate(stages, cluster(2, bandwidth_Bps=FREE), "1f1b", 4)
    for schedule in ("async-1f1b", "2bw"):
        result = simulate(stages, cluster(2, bandwidth_Bps=FREE), schedule, 4)
        assert result.step_time_s == pytest.approx(4 * 3.0 + 0.5)  # m (f + b) + update, nothing idle
        assert result.bubble_fraction == pytest.approx(0.0, abs=1e-9)
        assert flush.step_time_s == pytest.approx((4 + 1) * 3.0 + 0.5)
    slow = [SimStage("d0", 1.0, 2.0, 0, 0, 0, 0), SimStage("d1", 2.0, 4.0, 0, 0, 0, 0)]
    assert simulate(slow, cluster(2, bandwidth_Bps=FREE), "async-1f1b", 4).step_time_s == pytest.approx(4 * 6.0)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_rounds_that_drain_pay_the_fill_and_drain_once_per_round(m: int) -> None:
    """``plan run`` drains an asynchronous pipeline at every round end: a round of one step is 1F1B's flushing step,
    longer rounds approach the steady state from above, and a round of R steps costs its makespan over R."""
    stages = [SimStage("d0", 1.0, 2.0, 0, 0, 0, 0, update_s=0.5), SimStage("d1", 1.5, 2.5, 0, 0, 0, 0, update_s=0.5),
              SimStage("d2", 1.0, 2.0, 0, 0, 0, 0, update_s=0.25)]
    free = cluster(3, bandwidth_Bps=FREE)
    steady = simulate(stages, free, "async-1f1b", m).step_time_s
    flush = simulate(stages, free, "1f1b", m).step_time_s
    assert simulate(stages, free, "async-1f1b", m, drain_every=1).step_time_s == pytest.approx(flush)
    rounds = [simulate(stages, free, "async-1f1b", m, drain_every=r).step_time_s for r in (1, 2, 5, 20, 80)]
    assert all(a >= b - 1e-9 for a, b in zip(rounds, rounds[1:]))  # longer rounds, never a slower step
    assert all(r >= steady - 1e-9 for r in rounds)
    assert rounds[-1] == pytest.approx(steady, rel=0.05)
    # 2 stages, one micro-batch a step, free links: the fill and drain of a round cost one F and B of the other stage
    two = stages[:2]
    round_s = simulate(two, cluster(2, bandwidth_Bps=FREE), "async-1f1b", 1, drain_every=5).step_time_s * 5
    steady_two = simulate(two, cluster(2, bandwidth_Bps=FREE), "async-1f1b", 1).step_time_s
    assert round_s > 5 * steady_two
    with pytest.raises(PlannerError, match="drain_every must be at least 1"):
        simulate(two, cluster(2, bandwidth_Bps=FREE), "async-1f1b", 1, drain_every=0)


def test_the_memory_model_counts_the_stashed_versions_and_refuses_what_cannot_hold_them() -> None:
    from planner.errors import InfeasibleError

    profile = chain(8, params=1 << 20, saved=1 << 10)
    kwargs = dict(method="uniform", microbatches=4, catalog=load_catalog())
    roomy = cluster(2, bandwidth_Bps=FREE)
    flushing = partition(profile, roomy, schedule="1f1b", **kwargs)
    stashing = partition(profile, roomy, schedule="async-1f1b", **kwargs)
    peak = {d: v["peak_memory_bytes"] for d, v in flushing.predicted["devices"].items()}
    extra = {d: stashing.predicted["devices"][d]["peak_memory_bytes"] - peak[d] for d in peak}
    four_layers = 4 << 20  # parameter bytes of each stage
    # stage 0 keeps 1 stashed version + the newest snapshot, each with its last step and a predicted copy
    assert extra == {"d0": 3 * 2 * four_layers, "d1": 3 * 1 * four_layers}
    assert stashing.extra["async"] == {"correction": "predict", "staleness": [1, 0], "weight_versions": [1, 0]}
    tight = cluster(2, bandwidth_Bps=FREE, memory_bytes=max(peak.values()) + four_layers)
    partition(profile, tight, schedule="1f1b", **kwargs)
    with pytest.raises(InfeasibleError):
        partition(profile, tight, schedule="async-1f1b", **kwargs)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return plan_in_process(*args)


def _run_digits(tmp_path: Path, name: str, partition: Sequence[str], steps: int, every: int) -> dict[str, Any]:
    """``plan partition`` the digits MLP's profile (``digits_plan``) with ``partition``, then ``plan run`` it with SGD
    for ``steps`` steps, evaluated and in rounds every ``every``; the run's summary."""
    plan = str(tmp_path / f"{name}.json")
    made = _cli("partition", str(tmp_path / "profile.json"), "-m", "uniform", *partition, "-o", plan)
    assert made.returncode == 0, made.stderr
    done = _cli("run", plan, "planner.examples.digits:digits_mlp", "--data", "planner.data.digits:batches", "--steps",
                str(steps), "--eval-every", str(every), "--round-steps", str(every), "--optimizer", "sgd", "--lr",
                "0.05", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def test_bad_asynchronous_settings_get_one_line(tmp_path: Path) -> None:
    digits_plan(tmp_path)
    profile = str(tmp_path / "profile.json")
    cases = [
        (["-s", "async-gpipe"], "unknown schedule 'async-gpipe'"),
        (["-s", "2bw", "-c", "cpu-4", "-n", "4", "-d", "2", "--sync", "bsp"],
         "runs replica pipelines that combine their updates among themselves"),
        (["-s", "async-1f1b", "--async-correction", "pipemare"], "--async-correction must be one of predict, none"),
        (["-s", "2bw", "-c", "cpu-4", "-n", "1"], "2bw needs at least 3 micro-batches per step on 4 stages"),
        (["-s", "async-1f1b", "--async-warmup", "-1"], "--async-warmup must be a whole number of steps >= 0"),
    ]
    for extra, message in cases:
        args = ["partition", profile, "-m", "uniform", "-o", str(tmp_path / "bad.json"), *extra]
        if "-c" not in extra:
            args += ["-c", "cpu-2"]
        done = _cli(*args)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode != 0 and len(lines) == 1 and message in lines[0], (extra, done.stderr)
        assert not (tmp_path / "bad.json").exists()
    made = _cli("partition", profile, "-c", "cpu-2", "-m", "uniform", "-n", "4", "-s", "async-1f1b",
                "-o", str(tmp_path / "async.json"))
    assert made.returncode == 0, made.stderr
    exported = _cli("export", str(tmp_path / "async.json"), "--to", "torchtitan")
    assert exported.returncode != 0 and "has no flush between steps" in exported.stderr
    ran = _cli("run", str(tmp_path / "async.json"), "planner.examples.digits:digits_mlp", "--async-receives", "soon")
    lines = [line for line in ran.stderr.splitlines() if line.strip()]
    assert ran.returncode != 0 and len(lines) == 1 and "unknown --async-receives 'soon'" in lines[0], ran.stderr
    doc = json.loads((tmp_path / "async.json").read_text())
    assert doc["async"]["warmup"] == DEFAULT_ASYNC_WARMUP  # recorded, so plan run and the reference read one number
    doc["async"]["warmup"] = 2.5
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    checked = _cli("check", str(tmp_path / "bad.json"))
    lines = [line for line in checked.stderr.splitlines() if line.strip()]
    assert checked.returncode != 0 and len(lines) == 1 and "async.warmup" in lines[0], checked.stderr
    (tmp_path / "bad.json").unlink()
    # a cluster that holds the 1F1B plan with 1 KiB to spare cannot hold the asynchronous plan's weight versions
    flushing = json.loads((tmp_path / "plan.json").read_text())
    cluster = flushing["cluster"]
    room = max(d["peak_memory_bytes"] for d in flushing["predicted"]["devices"].values()) + 1024
    cluster["devices"] = [{**d, "memory_bytes": room} for d in cluster["devices"]]
    (tmp_path / "tight.json").write_text(json.dumps(cluster))
    args = ["partition", profile, "-c", str(tmp_path / "tight.json"), "-m", "uniform", "-n", "2", "-d", "1"]
    assert _cli(*args, "-s", "1f1b").returncode == 0
    done = _cli(*args, "-s", "async-1f1b", "-o", str(tmp_path / "bad.json"))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "memory" in lines[0], done.stderr
    assert not (tmp_path / "bad.json").exists()


def test_a_plan_records_the_rounds_its_prediction_drains_at_and_every_reader_prices_them(tmp_path: Path) -> None:
    """``plan partition --round-steps R`` predicts rounds of R steps (``async.drain_every``); ``plan show`` replays the
    same step; ``plan run`` re-predicts a steady-state plan for its own ``--round-steps`` before ranks start."""
    from planner.formats.plan import load_plan
    from planner.formats.profile import load_profile
    from planner.report.replay import simulate_plan
    from planner.runtime.launch.config import RunConfig
    from planner.runtime.launch.prepare import with_round_drains

    digits_plan(tmp_path)
    profile = str(tmp_path / "profile.json")
    args = ["partition", profile, "-c", "cpu-2", "-m", "uniform", "-n", "2", "-d", "1", "-s", "async-1f1b"]
    assert _cli(*args, "-o", str(tmp_path / "steady.json")).returncode == 0
    made = _cli(*args, "--round-steps", "3", "-o", str(tmp_path / "drained.json"))
    assert made.returncode == 0, made.stderr
    steady, drained = load_plan(tmp_path / "steady.json"), load_plan(tmp_path / "drained.json")
    assert steady.drain_every is None and drained.drain_every == 3
    assert drained.step_time_s > steady.step_time_s
    assert simulate_plan(drained).step_time_s == pytest.approx(drained.step_time_s, rel=1e-9)
    assert simulate_plan(steady).step_time_s == pytest.approx(steady.step_time_s, rel=1e-9)
    shown = _cli("show", str(tmp_path / "drained.json"))
    shown_text = " ".join(shown.stdout.split())
    assert shown.returncode == 0 and "drains every 3 steps" in shown_text, shown.stderr
    assert "steps 0-49 synchronous (warm-up)" in shown_text  # the default warm-up, recorded in the plan
    config = RunConfig(plan=str(tmp_path / "steady.json"), model="planner.examples.digits:digits_mlp", steps=60,
                       round_steps=3)
    again = with_round_drains(steady, load_profile(profile), config)
    assert again.drain_every == 3 and again.step_time_s == pytest.approx(drained.step_time_s, rel=1e-6)
    assert with_round_drains(drained, load_profile(profile), config) is drained  # already priced for these rounds
    flushing = load_plan(tmp_path / "plan.json")
    assert with_round_drains(flushing, load_profile(profile), config) is flushing  # 1f1b drains every step anyway
    # a run that ends within the synchronous warm-up (50 steps by default) drains every step, and is priced so
    within = with_round_drains(steady, load_profile(profile), dataclasses.replace(config, steps=50))
    assert within.drain_every == 1 and within.step_time_s > again.step_time_s
    # bad values: one line each, nothing written
    done = _cli(*args, "--round-steps", "0", "-o", str(tmp_path / "bad.json"))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "--round-steps" in lines[0], done.stderr
    assert not (tmp_path / "bad.json").exists()
    doc = json.loads((tmp_path / "drained.json").read_text())
    doc["async"]["drain_every"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    checked = _cli("check", str(tmp_path / "bad.json"))
    lines = [line for line in checked.stderr.splitlines() if line.strip()]
    assert checked.returncode != 0 and len(lines) == 1 and "async.drain_every" in lines[0], checked.stderr


CASES = [("digits", "async-1f1b", "predict", None, "sgd", 0), ("digits", "async-1f1b", "none", None, "adam", 0),
         ("digits", "2bw", "predict", None, "adam", 0), ("digits", "async-1f1b", "predict", 1, "sgd", 0),
         ("gpt", "async-1f1b", "predict", None, "adam", 0), ("gpt", "async-1f1b", "predict", None, "adam", 4),
         ("digits", "2bw", "predict", None, "sgd", 4)]
"""(model, schedule, correction, micro-batches in flight, optimizer, synchronous warm-up steps); gpt_tiny's LM head
is tied to its embedding across the two ranks. A warm-up of 4 in rounds of 3 ends inside the second round. The cases
alternate between posting each receive one message ahead and on demand (gloo's default, ``receives_ahead``), so
both ways meet the reference."""


def _engine_ranks(rank: int, world: int, plans: dict[str, str], out_dir: str) -> None:
    """On 2 gloo ranks: each case trains 7 steps in rounds of 3 and is compared with its reference."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from planner.data.digits import batches
    from planner.data.factory import _lm_cross_entropy
    from planner.examples.digits import digits_mlp
    from planner.examples.gpt import gpt_tiny
    from planner.formats.plan import load_plan
    from planner.profile.capture import capture
    from planner.runtime.pipeline.asynchronous import AsyncEngine, train_async_reference
    from planner.runtime.pipeline.stages import build_rank_stages
    from planner.runtime.pipeline.training import TrainSettings, make_optimizer, train_reference

    results = {}
    for index, (name, schedule, correction, inflight, optimizer, warmup) in enumerate(CASES):
        receives = "ahead" if index % 2 else "on-demand"
        plan = load_plan(plans[name])
        plan = dataclasses.replace(plan, schedule=schedule,
                                   extra={**plan.extra, "async": {**(plan.extra.get("async") or {}), "warmup": warmup}})
        torch.manual_seed(0)
        model, example = digits_mlp() if name == "digits" else gpt_tiny()
        criterion = F.cross_entropy if name == "digits" else _lm_cross_entropy
        init = {k: v.detach().clone() for k, v in model.named_parameters()}
        stages = build_rank_stages(capture(model, example, "auto"), model, plan, rank, torch.device("cpu"))
        lr = 0.05 if optimizer == "sgd" else 1e-3
        rows = plan.microbatches * example[0].shape[0]

        def batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            if name == "digits":
                x, y = batches(seed=0, step=step, batch_size=rows)
                return (x,), y
            tokens = torch.randint(0, 128, (rows, 17), generator=torch.Generator().manual_seed(step))
            return (tokens[:, :-1],), tokens[:, 1:]

        drawn: dict[int, int] = {}

        def engine_batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            drawn[step] = drawn.get(step, 0) + 1
            return batch(step)

        opt = make_optimizer(stages.params, optimizer, lr)
        engine = AsyncEngine(stages, opt, criterion, correction, inflight=inflight, record_versions=True,
                             receives=receives)
        losses: list[float | None] = []
        log: list[tuple[int, int, int, int]] = []
        swapped = correction == "none" or (warmup > 0 and schedule == "async-1f1b")  # a re-plan's new engine at every
        # round end (one inside the warm-up, one after it): the rule goes on unchanged
        first_compute = None
        for first in range(0, 7, 3):
            if swapped and first > 0:
                log += engine.log or []
                first_compute = engine.compute_s if first_compute is None else first_compute
                engine.close()
                engine = AsyncEngine(stages, opt, criterion, correction, inflight=inflight, record_versions=True,
                                     before=engine, receives=receives)
            losses += engine.run_round(first, min(3, 7 - first), engine_batch)
        engine.close()
        log += engine.log or []
        ref_losses, ref_params = train_async_reference(stages.graphs, model, init, criterion, optimizer, lr, schedule,
                                                       plan.microbatches, batch, 7, 3, correction, inflight,
                                                       warmup=warmup)
        mine = ref_params[0][engine.stage]
        row = {"max_diff": max(float((p.detach() - mine[c]).abs().max()) for c, p in engine.params.items()),
               "losses": losses, "ref_losses": ref_losses, "log": log, "tied": [t.name for t in stages.tied],
               "report": engine.report(), "first_compute": first_compute, "draws": sorted(drawn.items()),
               "tied_sums": {t.name: float(engine.params[t.name].detach().double().sum()) for t in stages.tied}}
        if inflight == 1:  # one micro-batch at a time: plain synchronous training, torch's arithmetic
            torch.manual_seed(0)
            whole, _ = digits_mlp()
            settings = TrainSettings(optimizer, lr, plan.microbatches, example[0].shape[0], 0)
            sync = train_reference(whole, _spec(), settings, batch, 7)  # type: ignore[arg-type]
            row["sync_diff"] = max(float((p.detach() - sync.params[c]).abs().max()) for c, p in engine.params.items())
            row["sync_losses"] = list(sync.losses)
        results["/".join(map(str, (name, schedule, correction, inflight, optimizer, warmup)))] = row
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def _spec() -> object:
    """What ``train_reference`` reads of a data spec: the loss (the digits' cross-entropy)."""
    from types import SimpleNamespace

    from planner.data.factory import CROSS_ENTROPY

    return SimpleNamespace(loss=CROSS_ENTROPY)


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_ranks_equal_the_documented_update_rule_and_stash_every_version(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from tests._gloo import run_ranks

    plans = {"digits": str(digits_plan(tmp_path))}
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    for args in (["profile", "planner.examples.gpt:gpt_tiny", "-o", str(gpt / "profile.json"), "--repeats", "1",
                  "--warmup", "0"],
                 ["partition", str(gpt / "profile.json"), "-c", "cpu-2", "-m", "uniform", "-n", "2", "-d", "1",
                  "-o", str(gpt / "plan.json")]):
        done = _cli(*args)
        assert done.returncode == 0, done.stderr
    plans["gpt"] = str(gpt / "plan.json")
    run_ranks(_engine_ranks, 2, plans, str(tmp_path), timeout_s=200)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ranks[0]:
        for rank in ranks:
            row = rank[name]
            assert row["max_diff"] < 1e-5, (name, row["max_diff"])
            forwards = {k: v for k, v, _, _ in row["log"] if v >= 0}
            backwards = {k: v for k, _, v, _ in row["log"] if v >= 0}
            assert forwards == backwards and len(forwards) == 7 * 2, name  # weight stashing, every micro-batch
            assert row["draws"] == [[step, 1] for step in range(7)], name  # each step's batch drawn once, not per pass
        last = ranks[1][name]
        assert last["losses"] == pytest.approx(last["ref_losses"], rel=1e-5)
    assert ranks[0]["gpt/async-1f1b/predict/None/adam/0"]["tied"] == ["wte.weight"]  # the case tests a tie
    tied = [rank["gpt/async-1f1b/predict/None/adam/0"]["tied_sums"]["wte.weight"] for rank in ranks]
    assert tied[0] == tied[1]  # the later holder applied the last sum by the round's end: the copies are equal
    stale = [tau for _, v, _, tau in ranks[0]["digits/async-1f1b/predict/None/sgd/0"]["log"] if v >= 0]
    assert max(stale) == 1 and min(stale) == 0  # stage 0's gradients are at most one update late
    for rank in ranks:  # the case whose engine was replaced twice reports the whole run
        row = rank["digits/async-1f1b/none/None/adam/0"]
        assert row["report"]["updates"] == 7 and row["report"]["compute_s"] > row["first_compute"] > 0
    for key, steady in (("gpt/async-1f1b/predict/None/adam/4", 1), ("digits/2bw/predict/None/sgd/4", 1)):
        late: dict[int, int] = {}
        for k, v, _, tau in ranks[0][key]["log"]:
            if v >= 0:  # a forward's staleness, by step (2 micro-batches a step)
                late[k // 2] = max(late.get(k // 2, 0), tau)
        assert all(late[step] == 0 for step in range(4)), key  # the warm-up: no gradient late
        assert max(late[step] for step in range(4, 7)) == steady, key  # then the schedule's own delay
    sync = ranks[1]["digits/async-1f1b/predict/1/sgd/0"]
    assert sync["sync_diff"] < 1e-5 and sync["losses"] == pytest.approx(sync["sync_losses"], rel=1e-5)


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule, microbatches", [("2bw", 4), ("async-1f1b", 1)])
def test_plan_run_trains_an_async_plan_and_evaluates_it(tmp_path: Path, schedule: str, microbatches: int) -> None:
    """Also with fewer micro-batches than stages (plan train once chose async-1f1b with 1 micro-batch over 2 stages,
    and the run failed building torch's 1F1B schedule, which it only evaluates with)."""
    pytest.importorskip("sklearn")
    digits_plan(tmp_path)
    summary = _run_digits(tmp_path, schedule, ["-c", "cpu-2", "-n", str(microbatches), "-s", schedule,
                                               "--async-warmup", "6"], 12, 6)
    assert summary["schedule"] == schedule and len(summary["losses"]) == 12
    assert summary["async"]["updates"] == 12 and summary["async"]["correction"] == "predict"
    assert summary["async"]["warmup"] == 6  # the first round synchronous, the second asynchronous
    assert [e["step"] for e in summary["eval"]] == [0, 6, 12] and summary["eval"][-1]["accuracy"] > 0.1


REPLICA_CASES = [("async-1f1b", "predict", "sgd", [2, 2], "ssgd"), ("async-1f1b", "predict", "adam", [3, 1], "ssgd"),
                 ("2bw", "none", "sgd", [3, 1], "ssgd"), ("async-1f1b", "predict", "adam", [3, 1], "local-sgd"),
                 ("2bw", "predict", "sgd", [2, 2], "local-sgd")]
"""(schedule, correction, optimizer, shares, sync) of 2 stages x 2 replicas on 4 ranks; local-sgd averages every 2
updates."""


def _replica_ranks(rank: int, world: int, plan_path: str, out_dir: str) -> None:
    """On 4 gloo ranks: each case trains 7 steps in rounds of 3, two replica pipelines of the digits MLP, and is
    compared with the single-process reference given the same shares."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from planner.data.digits import batches
    from planner.examples.digits import digits_mlp
    from planner.formats.plan import load_plan
    from planner.profile.capture import capture
    from planner.runtime.pipeline.asynchronous import AsyncEngine, train_async_reference
    from planner.runtime.pipeline.stages import build_rank_stages
    from planner.runtime.pipeline.training import make_optimizer

    results = {}
    for schedule, correction, optimizer, shares, sync in REPLICA_CASES:
        base = load_plan(plan_path)
        period = 2 if sync == "local-sgd" else 1
        extra = {**base.extra, "data_parallel": {**base.extra["data_parallel"], "microbatches": shares, "sync": sync,
                                                 **({"period": period} if period > 1 else {})}}
        plan = dataclasses.replace(base, schedule=schedule, microbatches=sum(shares), extra=extra)
        torch.manual_seed(0)
        model, example = digits_mlp()
        init = {k: v.detach().clone() for k, v in model.named_parameters()}
        stages = build_rank_stages(capture(model, example, "auto"), model, plan, rank, torch.device("cpu"))
        lr = 0.05 if optimizer == "sgd" else 1e-3
        rows = example[0].shape[0]

        def whole(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            x, y = batches(seed=0, step=step, batch_size=rows * plan.microbatches)
            return (x,), y

        def mine(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:  # this replica's rows, as RankRun cuts
            (x,), y = whole(step)
            first, count = stages.first_microbatch * rows, stages.microbatches * rows
            return (x[first:first + count],), y[first:first + count]

        engine = AsyncEngine(stages, make_optimizer(stages.params, optimizer, lr), F.cross_entropy, correction)
        losses: list[float | None] = []
        for first in range(0, 7, 3):
            losses += engine.run_round(first, min(3, 7 - first), mine)
        engine.close()
        ref_losses, ref_params = train_async_reference(stages.graphs, model, init, F.cross_entropy, optimizer, lr,
                                                       schedule, plan.microbatches, whole, 7, 3, correction,
                                                       shares=shares, sync=sync, period=period)
        expected = ref_params[stages.replica if sync == "local-sgd" else 0][engine.stage]
        results[f"{schedule}/{correction}/{optimizer}/{shares}/{sync}"] = {
            "max_diff": max(float((p.detach() - expected[c]).abs().max()) for c, p in engine.params.items()),
            "losses": losses, "ref_losses": ref_losses, "replica": stages.replica, "stage": engine.stage}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_replica_pipelines_run_asynchronously_and_equal_the_documented_rule(tmp_path: Path) -> None:
    """Issue 26: plans with replicas under the asynchronous schedules. Each replica pipeline runs its own share without
    a flush; under ssgd every stage's update sums its gradient with its replicas', under local-sgd each replica steps
    on its own and the replicas average every 2 updates; the weights equal the single-process reference of the rule
    with the same shares (each replica's versions follow its own share), even and uneven (4 gloo ranks on 2 cores:
    correctness only). ``plan run`` runs ssgd and adaptive plans end to end."""
    pytest.importorskip("sklearn")
    from planner.formats.plan import load_plan
    from tests._gloo import run_ranks

    digits_plan(tmp_path)
    made = _cli("partition", str(tmp_path / "profile.json"), "-c", "cpu-4", "-m", "uniform", "-n", "4", "-d", "2",
                "--async-warmup", "0",
                "-s", "async-1f1b", "-o", str(tmp_path / "replicas.json"))
    assert made.returncode == 0, made.stderr
    plan = load_plan(tmp_path / "replicas.json")
    assert plan.shape().degree == 2 and len(plan.stages) == 2 and plan.shape().sync == "ssgd"
    run_ranks(_replica_ranks, 4, str(tmp_path / "replicas.json"), str(tmp_path), timeout_s=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name in ranks[0]:
        for rank in ranks:
            assert rank[name]["max_diff"] < 1e-5, (name, rank[name])
        lasts = [rank[name] for rank in ranks if rank[name]["stage"] == 1]
        summed = [sum(x) for x in zip(*(r["losses"] for r in lasts))]  # the replicas' last stages add up the step
        assert summed == pytest.approx(lasts[0]["ref_losses"], rel=1e-5)
    replicas = ["-c", "cpu-4", "-n", "4", "-d", "2", "-s", "async-1f1b"]
    summary = _run_digits(tmp_path, "replicas", replicas, 6, 3)
    assert summary["world_size"] == 4 and summary["schedule"] == "async-1f1b" and len(summary["losses"]) == 6
    assert summary["async"]["updates"] == 6 and summary["sync"]["degree"] == 2
    assert [e["step"] for e in summary["eval"]] == [0, 3, 6]
    # seed 001's adaptive mode between the replica pipelines: the plan is made and run as the flushing ones are
    summary = _run_digits(tmp_path, "adaptive", [*replicas, "--sync", "adaptive", "--sync-period", "2"], 6, 3)
    assert summary["async"]["updates"] == 6 and summary["sync"]["mode"] == "adaptive"
    assert summary["sync"]["aggregations"] >= 1 and summary["sync"]["periods"][0] == 2, summary["sync"]
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"]


def test_async_replicas_refuse_the_server_modes_and_are_simulated_at_the_slowest_replica() -> None:
    from _partition_cases import FREE, cluster

    from planner.partition.sim.hybrid import simulate_async_replicas
    from planner.partition.sim.simulate import SimStage, simulate

    net = cluster(4, bandwidth_Bps=FREE)
    fast = [SimStage("d0", 1.0, 2.0, 0, 0, 0, 1, update_s=0.5), SimStage("d1", 1.0, 2.0, 0, 0, 0, 1, update_s=0.5)]
    slow = [SimStage("d2", 2.0, 4.0, 0, 0, 0, 1, update_s=0.5), SimStage("d3", 1.0, 2.0, 0, 0, 0, 1, update_s=0.5)]
    both = simulate_async_replicas([fast, slow], [2, 2], [0.25, 0.25], net, "async-1f1b", drain_every=3)
    from dataclasses import replace

    alone = simulate([replace(st, update_s=0.75) for st in slow], net, "async-1f1b", 2, drain_every=3)
    assert both.step_time_s == pytest.approx(alone.step_time_s)  # the slow replica sets the pace
    assert both.devices["d0"].sync_s == 0.25 and both.devices["d0"].update_s == pytest.approx(0.5)
    assert both.devices["d0"].idle_s > both.devices["d2"].idle_s
    done = _cli("partition", "-c", "cpu-4", "-n", "4", "-d", "2", "-s", "async-1f1b", "--sync", "ssp",
                str(Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json"))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode != 0 and len(lines) == 1 and "parameter server" in lines[0], done.stderr
    from planner.partition.sim.schedules import async_violation

    assert async_violation("async-1f1b", 2, 2, 2, 2, "local-sgd") is None
    assert async_violation("2bw", 2, 2, 2, 2, "adaptive") is None
    assert "parameter server" in (async_violation("async-1f1b", 2, 2, 2, 2, "dasp") or "")


def test_the_reference_rule_equals_a_loop_written_from_the_docs_alone(tmp_path: Path) -> None:
    """An independent check of what ``train_async_reference`` (and so the engine) does, written from docs/async.md
    and not from the version rule: on two stages, async-1f1b runs the first micro-batch of every step but a round's
    first on the first stage's weights one update old, and nothing else is late. A whole-model loop that does just
    that, with Adam, ends on the reference's weights; one that is never late (or late on every micro-batch) does not.
    What the reference shows at each round's end (``observe``, where the bench evaluates it) is that loop's weights
    after as many steps."""
    import dataclasses

    import torch
    import torch.nn.functional as F

    from planner.data.digits import batches
    from planner.examples.digits import digits_mlp
    from planner.formats.plan import load_plan
    from planner.profile.capture import capture
    from planner.runtime.pipeline.asynchronous import _stage_names, train_async_reference
    from planner.runtime.pipeline.graph_split import canonical_param_names
    from planner.runtime.pipeline.stages import stage_graphs
    from planner.runtime.pipeline.training import make_optimizer

    plan = dataclasses.replace(load_plan(digits_plan(tmp_path)), schedule="async-1f1b")
    m, steps, rounds, lr = plan.microbatches, 7, 3, 1e-2
    torch.manual_seed(0)
    model, example = digits_mlp()
    init = {k: v.detach().clone() for k, v in model.named_parameters()}
    graphs = stage_graphs(capture(model, example, "auto"), model, plan)
    first_stage = {c for _, c in _stage_names(graphs[0], canonical_param_names(model))}
    rows = m * example[0].shape[0]

    def batch(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        x, y = batches(seed=0, step=step, batch_size=rows)
        return (x,), y

    seen: dict[int, dict[str, torch.Tensor]] = {}

    def observe(done: int, weights: dict[str, torch.Tensor]) -> None:
        seen[done] = {c: w.detach().clone() for c, w in weights.items()}

    _, reference = train_async_reference(graphs, model, init, F.cross_entropy, "adam", lr, plan.schedule, m, batch,
                                         steps, rounds, "none", observe=observe)
    expected = {c: w for stage in reference[0] for c, w in stage.items()}

    def written(late: Callable[[int, int], bool]) -> list[dict[str, torch.Tensor]]:
        live = {c: torch.nn.Parameter(w.clone()) for c, w in init.items()}
        optimizer = make_optimizer(live, "adam", lr)
        versions = [{c: w.detach().clone() for c, w in live.items()}]
        for step in range(steps):
            (x,), y = batch(step)
            grads = {c: torch.zeros_like(w) for c, w in live.items()}
            for j, (xs, ys) in enumerate(zip(x.chunk(m), y.chunk(m))):
                weights = dict(live)
                if late(step, j):
                    weights.update({c: versions[step - 1][c].clone().requires_grad_(True) for c in first_stage})
                loss = F.cross_entropy(torch.func.functional_call(model, weights, (xs,)), ys)
                for c, g in zip(weights, torch.autograd.grad(loss, list(weights.values()))):
                    grads[c] += g
            for c, w in live.items():
                w.grad = grads[c] / m
            optimizer.step()
            versions.append({c: w.detach().clone() for c, w in live.items()})
        return versions

    def gap(weights: dict[str, torch.Tensor], to: dict[str, torch.Tensor] = expected) -> float:
        return max(float((weights[c] - to[c]).abs().max()) for c in to)

    documented = written(lambda step, j: j == 0 and step % rounds != 0)
    assert gap(documented[-1]) < 1e-6
    assert gap(written(lambda step, j: False)[-1]) > 1e-4
    assert gap(written(lambda step, j: step % rounds != 0)[-1]) > 1e-4
    assert sorted(seen) == [3, 6, 7]  # every round's end, the last one short
    assert all(gap(documented[done], weights) < 1e-6 for done, weights in seen.items())
