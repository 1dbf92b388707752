"""Seed 002 (issue 25): bsp, asp, ssp and dasp through a parameter server rank (docs/sync.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from planner.cli import app
from planner.errors import UsageError
from planner.runtime.parameter_server.rule import (ASYNC, SYNC, DaspRule, WorkerState, async_scale, may_proceed,
                                                   next_states)
from planner.runtime.slowdown import SlowdownPattern, parse_slowdown_patterns, parse_slowdowns

from _gloo import run_ranks

# ---------------------------------------------------------------- the rule, on recorded traces


def _run_trace(trace: list[list[float | None]], rule: DaspRule = DaspRule()) -> list[list[str]]:
    states = tuple(WorkerState() for _ in trace[0])
    seen = []
    for measured in trace:
        states = next_states(states, measured, rule)
        seen.append([s.state for s in states])
    return seen


def test_equal_speeds_never_leave_the_group() -> None:
    # iteration times of 3 workers over 8 rounds, recorded with equal speeds (jitter within 20%)
    trace = [[0.021, 0.019, 0.020], [0.020, 0.024, 0.021], [0.019, 0.020, 0.023], [0.022, 0.021, 0.020]] * 2
    assert all(row == [SYNC] * 3 for row in _run_trace(trace))


def test_a_straggler_leaves_after_patience_rounds_and_rejoins_when_it_recovers() -> None:
    # worker 2 turns 3x slower at round 2 and recovers at round 6 (a trace of --emulate-slowdown 2=3@..)
    fast, slow = 0.020, 0.060
    trace = [[fast, fast, fast]] * 2 + [[fast, fast, slow]] * 4 + [[fast, fast, fast]] * 6
    seen = _run_trace(trace, DaspRule(patience=2, smoothing=1.0))
    assert [row[2] for row in seen] == [SYNC, SYNC, SYNC, ASYNC, ASYNC, ASYNC, ASYNC, SYNC, SYNC, SYNC, SYNC, SYNC]
    assert all(row[:2] == [SYNC, SYNC] for row in seen)  # the fast ones never move


def test_hysteresis_keeps_a_worker_between_the_factors_where_it_is() -> None:
    rule = DaspRule(slow_factor=1.5, rejoin_factor=1.2, patience=1, smoothing=1.0)
    states = (WorkerState(SYNC), WorkerState(ASYNC))
    after = next_states(states, [0.020, 0.027], rule)  # 1.35x: neither leaves nor rejoins
    assert [s.state for s in after] == [SYNC, ASYNC]
    after = next_states((WorkerState(SYNC), WorkerState(SYNC)), [0.020, 0.027], rule)
    assert [s.state for s in after] == [SYNC, SYNC]


def test_the_fastest_worker_always_stays_and_a_silent_worker_keeps_its_average() -> None:
    rule = DaspRule(patience=1, smoothing=0.5)
    states = next_states((WorkerState(), WorkerState()), [0.1, 0.4], rule)
    assert [s.state for s in states] == [SYNC, ASYNC]
    again = next_states(states, [None, 0.4], rule)
    assert again[0].iteration_s == pytest.approx(0.1) and again[1].iteration_s == pytest.approx(0.4)
    assert again[0].state == SYNC


def test_ssp_bound_and_staleness_scale() -> None:
    assert may_proceed(5, [5, 3, 2], 3) and not may_proceed(6, [6, 3, 2], 3) and may_proceed(2, [2, 2], 0)
    assert async_scale(0) == 1.0 and async_scale(1) == 1.0 and async_scale(4) == 0.25


@pytest.mark.parametrize("kwargs,words", [({"slow_factor": 1.1, "rejoin_factor": 1.2}, "rejoin factor"),
                                          ({"patience": 0}, "--dasp-patience"), ({"smoothing": 0.0}, "smoothing"),
                                          ({"async_update": "later"}, "--dasp-async-update")])
def test_bad_rule_knobs_are_refused(kwargs, words) -> None:
    with pytest.raises(UsageError, match=words):
        DaspRule(**kwargs)


def test_time_varying_slowdowns() -> None:
    mid = parse_slowdown_patterns("1=3@100")[1]
    assert [mid.factor_at(s) for s in (0, 99, 100, 500)] == [1.0, 1.0, 3.0, 3.0]
    burst = parse_slowdown_patterns(["2=4@10/5"])[2]
    assert [burst.factor_at(s) for s in (9, 10, 14, 15, 19, 20)] == [1.0, 4.0, 4.0, 1.0, 1.0, 4.0]
    assert parse_slowdown_patterns("0=2")[0] == SlowdownPattern(2.0)
    with pytest.raises(UsageError, match="varies over the run"):
        parse_slowdowns("1=3@100")
    for bad in ("1=3@-1", "1=3@0/0", "1=x"):
        with pytest.raises(UsageError, match="RANK=FACTOR"):
            parse_slowdown_patterns(bad)


# ---------------------------------------------------------------- the server and its workers, on gloo ranks


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _rows(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(8, 6, generator=g),), torch.randint(0, 3, (8,), generator=g)


def _serve_job(rank: int, world: int, runs: list[tuple], out: str) -> None:
    """Each of ``runs`` (name, mode, steps, staleness, slowdowns, rule) in turn on the same ranks."""
    from planner.runtime.parameter_server.server import Server, ServerSetup
    from planner.runtime.parameter_server.wire import ModelTensors
    from planner.runtime.parameter_server.worker import WorkerSetup, work

    server, workers = world - 1, tuple(range(world - 1))
    m = 2 * len(workers)  # two micro-batches per worker per step
    for name, mode, steps, staleness, slow, rule in runs:
        model = _model()
        if rank == server:
            setup = ServerSetup(mode, workers, (2,) * len(workers), m, steps, 2, staleness, rule)
            s = Server(setup, ModelTensors(model), torch.optim.SGD(model.parameters(), lr=0.1))
            s.run(lambda step: False)
            torch.save({"params": [p.detach() for p in model.parameters()], "losses": s.losses,
                        "report": s.report(), "rounds": s.rounds}, Path(out) / f"{name}-server.pt")
            continue

        def rows(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            (x,), y = _rows(step)
            size = 8 // m
            cut = slice(rank * 2 * size, (rank + 1) * 2 * size)
            return (x[cut],), y[cut]

        report = work(WorkerSetup(server, 2, slow.get(rank)), model, rows, nn.functional.cross_entropy)
        torch.save(report, Path(out) / f"{name}-worker{rank}.pt")


def _served(tmp_path: Path, workers: int, *runs: tuple) -> dict[str, dict]:
    """``runs`` as ``(name, mode, steps, staleness, slowdowns, rule)`` on ``workers`` workers and a server, in one
    job; each run's server record with its workers' reports."""
    run_ranks(_serve_job, workers + 1, list(runs), str(tmp_path), timeout_s=120)
    results = {}
    for name, *_ in runs:
        results[name] = torch.load(tmp_path / f"{name}-server.pt")
        results[name]["workers"] = [torch.load(tmp_path / f"{name}-worker{w}.pt") for w in range(workers)]
    return results


def _plain(steps: int) -> tuple[list[torch.Tensor], list[float]]:
    """Single-process SGD on the same batches, with the gradient as a worker computes it."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        (x,), y = _rows(step)
        total = 0.0
        for xs, ys in zip(x.chunk(2), y.chunk(2)):
            loss = nn.functional.cross_entropy(model(xs), ys) / 2
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return [p.detach() for p in model.parameters()], losses


@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_bsp_with_one_worker_is_plain_training(tmp_path: Path) -> None:
    one = _served(tmp_path, 1, ("one", "bsp", 6, 3, {}, DaspRule()))["one"]
    params, losses = _plain(6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(one["params"], params))
    assert one["losses"] == pytest.approx(losses, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_dasp_at_equal_speeds_is_bsp_ssp_keeps_its_bound_and_asp_applies_every_gradient_once(tmp_path: Path) -> None:
    keep = DaspRule(slow_factor=1e6, rejoin_factor=1e6)  # the rule kept from moving anyone: the group is everyone
    # This model computes in tens of microseconds, less than a round trip to the server on 4 ranks sharing 2 cores:
    # at 4x the straggler applied 8-9 gradients to the others' 13-15 on a quiet machine, and 12 to 11 once in a busy
    # fresh clone (asp's assertion below failed). At 30x it applied 0-2 to 16-18, in the same test time.
    slow = {2: SlowdownPattern(30.0)}
    runs = _served(tmp_path, 3, ("bsp", "bsp", 8, 3, {}, keep), ("dasp", "dasp", 8, 3, {}, keep),
                   ("ssp", "ssp", 12, 1, slow, keep), ("asp", "asp", 12, 3, slow, keep))
    bsp, dasp = runs["bsp"], runs["dasp"]
    assert all(torch.equal(a, b) for a, b in zip(bsp["params"], dasp["params"]))  # step for step, bit for bit
    assert bsp["losses"] == dasp["losses"] and len(bsp["losses"]) == 8
    assert all(w["state"] == SYNC for r in dasp["rounds"] for w in r["workers"])
    replies = runs["ssp"]["report"]["ssp_replies"]
    assert replies and all(clock - slowest <= 1 for _, clock, slowest in replies)  # never more than S ahead
    assert any(clock - slowest == 1 for _, clock, slowest in replies)  # the bound was reached, and held
    asp = runs["asp"]
    report = asp["report"]
    for w in range(3):
        pushed = report["pushes"][str(w)]
        assert report["applied"][str(w)] + report["discarded"][str(w)] == pushed == asp["workers"][w]["iterations"]
    assert sum(report["applied"].values()) == report["version"]  # one update per gradient, none twice
    assert report["applied"]["0"] > report["applied"]["2"]  # nobody waited for the straggler


# ---------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ps")
    runner = CliRunner()
    profile = tmp / "p.json"
    result = runner.invoke(app, ["profile", "planner.examples.digits:digits_mlp", "-o", str(profile), "--repeats", "2",
                                 "--warmup", "1"])
    assert result.exit_code == 0, result.output
    out = {"dir": tmp, "profile": profile}
    for name, args in {"pipeline": ["-d", "1"], "dasp": ["--sync", "dasp"], "ssgd": ["-d", "2"],
                       # uniform layers: two stages per replica whatever this machine measured (the default placer
                       # may keep the small MLP on one device per replica when 4 ranks share 2 cores)
                       "two-stage": ["-c", "cpu-4", "-d", "2", "-m", "uniform"]}.items():
        cluster = [] if "-c" in args else ["-c", "cpu-2"]
        result = runner.invoke(app, ["partition", str(profile), *cluster, "-o", str(tmp / f"{name}.json"), *args])
        assert result.exit_code == 0, result.output
        out[name] = tmp / f"{name}.json"
    assert len(json.loads(out["two-stage"].read_text())["stages"]) == 2  # what the server-on-stages tests refuse
    return out


def test_partition_makes_one_stage_per_device_and_records_the_mode(files) -> None:
    from planner.formats.plan import load_plan

    plan = load_plan(files["dasp"])
    assert len(plan.stages) == 1 and plan.shape().degree == 2 and plan.shape().sync == "dasp"
    assert plan.shape().served and "staleness" not in plan.extra["data_parallel"]
    result = CliRunner().invoke(app, ["partition", str(files["profile"]), "-c", "cpu-2", "--sync", "ssp",
                                      "--staleness", "5", "-o", str(files["dir"] / "ssp.json")])
    assert result.exit_code == 0, result.output
    assert load_plan(files["dir"] / "ssp.json").extra["data_parallel"]["staleness"] == 5


@pytest.mark.parametrize("args,words", [
    (["--sync", "ssp", "--staleness", "-1"], "--staleness must be a whole number of steps, 0 or more"),
    (["--sync", "dasp", "-d", "1"], "--sync dasp combines replicas"),
    (["--sync", "bsp", "--staleness", "2"], "--staleness bounds ssp"),
    (["--sync", "asp", "-c", "cpu-4", "-d", "2"], "one per device: --data-parallel must be 4"),
])
def test_bad_server_options_at_partition_are_one_line(files, args, words) -> None:
    out = files["dir"] / "bad.json"
    cluster = [] if "-c" in args else ["-c", "cpu-2"]
    result = CliRunner().invoke(app, ["partition", str(files["profile"]), *cluster, "-o", str(out), *args])
    assert result.exit_code != 0 and words in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("plan,args,words", [
    ("pipeline", ["--sync", "dasp"], "is a pure pipeline"),
    ("two-stage", ["--sync", "dasp"], "a server rank is not a pipeline stage"),
    ("dasp", ["--staleness", "-1"], "--staleness must be a whole number"),
    ("dasp", ["--dasp-patience", "0"], "--dasp-patience must be at least 1"),
    ("ssgd", ["--emulate-slowdown", "1=3@10"], "varies over the run"),
])
def test_bad_server_options_at_run_are_one_line(files, plan, args, words) -> None:
    result = CliRunner().invoke(app, ["run", str(files[plan]), "planner.examples.digits:digits_mlp", "--steps", "2",
                                      *args])
    assert result.exit_code != 0 and words in result.output, result.output
    assert "Traceback" not in result.output


def test_plan_check_refuses_a_server_mode_on_stages_and_a_bad_staleness(files) -> None:
    doc = json.loads(files["two-stage"].read_text())
    doc["data_parallel"]["sync"] = "dasp"
    bad = files["dir"] / "bad-dasp.json"
    bad.write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["check", str(bad), "--profile", str(files["profile"])])
    assert result.exit_code != 0 and "a server rank is not a pipeline stage" in result.output, result.output
    doc = json.loads(files["ssgd"].read_text())
    doc["data_parallel"]["staleness"] = 2
    bad.write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["check", str(bad), "--profile", str(files["profile"])])
    assert result.exit_code != 0 and "data_parallel.staleness" in result.output, result.output


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("update", ["apply", "fold"])
def test_plan_run_dasp_starts_the_server_and_logs_states_per_round(files, tmp_path: Path, update: str) -> None:
    """Under ``apply`` the straggler's gradients, once it left the group, are updates of their own; under ``fold``
    every update is a combined one, each taking worker 0's gradient once, the straggler's folded in."""
    log = tmp_path / "rounds.jsonl"
    result = CliRunner().invoke(app, [
        "run", str(files["dasp"]), "planner.examples.digits:digits_mlp", "--data", "planner.data.digits:batches",
        "--steps", "24", "--round-steps", "4", "--lr", "0.005", "--eval-every", "12", "--emulate-slowdown", "1=4",
        "--dasp-patience", "1", "--dasp-async-update", update, "--log", str(log), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{"):])
    assert summary["role"] == "server" and summary["steps"] == 24 and summary["sync"]["mode"] == "dasp"
    assert [e["step"] for e in summary["eval"]] == [0, 12, 24]
    rounds = [json.loads(line) for line in log.read_text().splitlines() if '"round"' in line]
    assert len(rounds) == 6 and all(len(r["workers"]) == 2 for r in rounds)
    assert all({"state", "iteration_s", "staleness", "waited_s"} <= set(w) for r in rounds for w in r["workers"])
    assert rounds[-1]["workers"][1]["state"] == ASYNC  # the 4x slower worker left the group
    assert any(t["rank"] == 1 and t["to"] == ASYNC for r in rounds for t in r["transitions"])
    sync = summary["sync"]
    assert (sync["version"] == sync["applied"]["0"]) == (update == "fold"), sync
