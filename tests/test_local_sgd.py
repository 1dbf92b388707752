"""Seed 001 (issue 24): local-sgd and adaptive, as sync modes of the data-parallel layer (docs/sync.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from planner.cli import app
from planner.partition.search.sync_period import AdaptiveRule, cost_period, initial_period, next_period
from planner.runtime.data_parallel.local import (Adaptive, AdaptiveOptions, assign_flat, chunk_bounds, flat_of,
                                                 needed_delay)


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("numel,size,chunk", [(37, 4, 12), (37, 4, 4), (37, 4, 1000), (100, 4, 40), (5, 8, 3)])
def test_chunks_cover_the_tensor_once_in_forward_order(numel: int, size: int, chunk: int) -> None:
    bounds = chunk_bounds(numel, size, chunk)
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    assert all((b - a) * size <= max(chunk, size) for a, b in bounds)


def test_the_cost_rule_keeps_aggregations_under_their_share_of_the_time() -> None:
    rule = AdaptiveRule(overhead=0.1, min_period=1, max_period=64)
    for compute, sync in [(0.01, 0.05), (0.002, 0.001), (0.05, 0.2)]:
        h = next_period(compute, sync, None, None, rule)
        assert sync / (h * compute + sync) <= 0.1 + 1e-9  # the share is met ...
        if h > 1:
            assert sync / ((h - 1) * compute + sync) > 0.1  # ... by the least interval that meets it
    assert cost_period(0.01, 0.0, rule) == 1.0 and next_period(0.01, 0.0, None, None, rule) == 1
    assert initial_period(0.01, 0.0) == 2  # the default floor: every other step runs with nothing in flight
    assert next_period(1e-6, 10.0, None, None, rule) == 64  # clamped


def test_the_adaptive_interval_on_a_recorded_trace() -> None:
    """Rounds recorded from a run (step compute, aggregation cost, mean loss): the interval follows the cost and
    shrinks as sqrt(loss / first loss) (AdaComm)."""
    trace = [(0.010, 0.020, 2.30), (0.010, 0.020, 1.80), (0.011, 0.022, 0.90), (0.010, 0.020, 0.40),
             (0.010, 0.060, 0.40), (0.010, 0.020, 2.50)]
    rule = AdaptiveRule()
    first = trace[0][2]
    periods = [next_period(c, s, first, loss, rule) for c, s, loss in trace]
    assert periods == [18, 16, 12, 8, 23, 18]
    # loss above the first one never lengthens the interval beyond the cost rule's
    assert periods[-1] == next_period(0.010, 0.020, None, None, rule)


def test_bad_rule_knobs_are_one_line() -> None:
    from planner.errors import UsageError

    with pytest.raises(UsageError, match="overhead must be between 0 and 1"):
        AdaptiveRule(overhead=1.5)
    with pytest.raises(UsageError, match="min_period <= max_period"):
        AdaptiveRule(min_period=4, max_period=2)


def test_the_elastic_correction_bounds_each_replicas_drift() -> None:
    """Two replicas whose local updates deviate from the shared global progress by at most B per step: with the
    correction each stays within (1 - a) / a * B of where the global model is expected (docs/sync.md); without
    it, the drift grows with the steps."""
    torch.manual_seed(0)
    alpha, bound, steps = 0.25, 0.01, 40
    velocity = torch.full((16,), 0.003)
    distances = {}
    for elastic in (alpha, 0.0):
        replicas = [Adaptive(None, 1, 2, steps + 1, options=AdaptiveOptions(elastic=elastic)) for _ in range(2)]
        params = [torch.zeros(16) for _ in range(2)]
        worst = 0.0
        for sync, p, sign in zip(replicas, params, (1.0, -1.0)):
            sync.anchor, sync.velocity = torch.zeros(16), velocity.clone()
            for step in range(1, steps + 1):
                deviation = sign * bound * torch.rand(16).sign().abs()  # |u - v| <= bound, biased: the worst case
                p.add_(velocity + deviation / 16 ** 0.5)
                sync.since = step
                sync._pull([p])
                worst = max(worst, float((p - velocity * step).norm()))
        distances[elastic] = worst
    assert distances[alpha] <= (1 - alpha) / alpha * bound + 1e-6
    assert distances[0.0] > 3 * distances[alpha]


def test_the_outer_momentum_moves_the_global_model_by_its_running_sum() -> None:
    """SlowMo with outer learning rate 1 (``--sync-momentum``): the k-th aggregation moves the parameters of the global
    model by ``u_k = beta u_(k-1) + d_k``, the float buffers by the plain averaged delta, and a local model that made
    no progress since its snapshot lands on the new global model."""
    beta = 0.5
    buffer = torch.zeros(2)
    sync = Adaptive(None, 1, 1, 2, buffers=[buffer], options=AdaptiveOptions(momentum=beta))
    params = {"w": torch.nn.Parameter(torch.zeros(3))}
    sync.anchor = flat_of(sync.state(params))
    expected, outer = torch.zeros(5), torch.zeros(3)
    for delta in (torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([1.0, -1.0, 0.5, 2.0, 2.0])):
        sync.snapshot, sync.sent, sync.pending = flat_of(sync.state(params)), delta.clone(), []
        sync.periods.append(2)
        sync._land(sync.state(params))
        outer = beta * outer + delta[:3]
        expected[:3] += outer
        expected[3:] += delta[3:]
        assert torch.allclose(sync.anchor, expected)
        assert torch.allclose(flat_of(sync.state(params)), expected)
    assert torch.allclose(sync.velocity[:3], outer / 2)  # the elastic pull's expected progress: the step taken


def test_a_late_landing_asks_for_as_many_more_steps_as_it_waited() -> None:
    """An aggregation that made training wait travels under more steps next time: the steps its wait would have
    covered; a wait under a tenth of a step (the collectives' own completion, the timer) changes nothing."""
    assert needed_delay(1, 0.0, 0.01) == 1
    assert needed_delay(1, 0.0009, 0.01) == 1
    assert needed_delay(1, 0.006, 0.0085) == 2  # digits on the slow link: 16 ms of link under 8.5 ms steps
    assert needed_delay(1, 0.025, 0.01) == 4
    assert needed_delay(2, 0.0001, 0.01) == 2
    assert needed_delay(3, 0.05, 0.0) == 3  # no step measured yet


def test_flat_copies_round_trip() -> None:
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.zeros(2, 2, dtype=torch.float64)]
    flat = flat_of(tensors)
    assert flat.numel() == 11
    assign_flat(tensors, flat * 2)
    assert tensors[0].tolist() == [[0, 2, 4], [6, 8, 10]] and tensors[1].item() == 14


# ---------------------------------------------------------------- on gloo ranks


def _h1_equals_ssgd(rank: int, world: int) -> None:
    import torch.distributed as dist

    from planner.runtime.data_parallel import LocalSGD, Synchronous

    shares, m = (3, 1), 4
    torch.manual_seed(0)
    start = torch.randn(5, 3)
    data = [torch.randn(m, 5) for _ in range(6)]
    targets = [torch.randn(m, 3) for _ in range(6)]
    first = sum(shares[:rank])
    paths = []
    for sync in (Synchronous(dist.group.WORLD, m), LocalSGD(dist.group.WORLD, shares[rank], m, 1)):
        w = torch.nn.Parameter(start.clone())
        opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
        path = []
        for x, y in zip(data, targets):
            opt.zero_grad(set_to_none=True)
            for i in range(first, first + shares[rank]):  # summed over this replica's micro-batches
                ((x[i] @ w - y[i]) ** 2).sum().backward()
            sync.after_backward({"w": w})
            opt.step()
            sync.after_step({"w": w})
            path.append(w.detach().clone())
        paths.append(path)
    for a, b in zip(*paths):
        assert torch.allclose(a, b, atol=1e-6, rtol=0), float((a - b).abs().max())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_local_sgd_with_one_local_step_equals_ssgd_step_for_step() -> None:
    from _gloo import run_ranks

    run_ranks(_h1_equals_ssgd, 2, timeout_s=90)


def _chunked(rank: int, world: int) -> None:
    import torch.distributed as dist

    shares, m = (3, 1), 4
    base = torch.arange(37, dtype=torch.float32) / 8  # dyadic values: every sum below is exact
    for chunk_bytes in (4, 12, 20, 36, 1000):
        sync = Adaptive(dist.group.WORLD, shares[rank], m, 1, options=AdaptiveOptions(elastic=0.0, chunk_bytes=chunk_bytes))
        w = torch.nn.Parameter(torch.zeros(37))
        sync.after_step({"w": w})  # the anchor: zeros; one local step later the aggregation starts
        with torch.no_grad():
            w.copy_(base * (rank + 1))
        sync.since = 0
        sync._launch(sync.state({"w": w}))
        assert [a for a, _ in sync.order] == sorted(a for a, _ in sync.order)  # first layers first
        assert len(sync.order) == -(-37 * 4 // max(chunk_bytes, 4))
        sync.finish({"w": w})
        reference = (base * (rank + 1) * shares[rank] / m).clone()
        dist.all_reduce(reference)  # one blocking all-reduce of the weighted models
        assert torch.equal(w.detach(), reference), chunk_bytes
        assert torch.equal(sync.anchor, reference)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_chunked_prioritised_aggregation_equals_one_all_reduce() -> None:
    from _gloo import run_ranks

    run_ranks(_chunked, 2, timeout_s=90)


def _delayed(rank: int, world: int) -> None:
    """An aggregation that travels under 3 steps lands before the third's optimizer update: the local model is then
    the global one plus the rank's own progress since the launch, and the steps in between kept the old model."""
    import torch.distributed as dist

    shares, m = (3, 1), 4
    sync = Adaptive(dist.group.WORLD, shares[rank], m, 4, options=AdaptiveOptions(chunk_bytes=8))
    sync.delay = 3
    w = torch.nn.Parameter(torch.zeros(5))
    own = float(rank + 1)  # each local step moves this rank's model by its own amount
    sync.after_step({"w": w})  # the anchor: zeros
    sync.since = 0
    history = []
    for step in range(8):
        w.grad = torch.zeros(5)
        sync.after_backward({"w": w})
        with torch.no_grad():
            w.add_(own)  # the optimizer step
        sync.after_step({"w": w})
        history.append(float(w[0]))
    assert sync.delays == [3] and sync.aggregations == 1 and sync.pending  # the second one still travels
    # launched after step 3 (4 local steps: snapshot 4 x own), landed in step 6's update: anchor = the weighted mean
    # of the snapshots, and the 2 steps since plus this one on top
    anchor = 4 * sum(share * (r + 1) for r, share in enumerate(shares)) / m
    assert history[4:6] == [5 * own, 6 * own]  # still the local model while it travels
    assert history[6] == pytest.approx(anchor + 3 * own)
    assert float(sync.anchor[0]) == pytest.approx(anchor)
    sync.finish({"w": w})  # a landing forced early (evaluation) is recorded as such
    assert sync.delays == [3, 0] and not sync.pending


def _grows(rank: int, world: int) -> None:
    """On a link slower than a step, the first aggregations make training wait; at the round's end every rank
    agrees on a longer delay (and an interval at least as long), and the next landings wait less."""
    import time

    import torch.distributed as dist

    from planner.runtime.launch.worker import exchange_rows
    from planner.runtime.netem import Traffic, instrument
    from planner.runtime.options import EmulatedLink

    sync = Adaptive(dist.group.WORLD, 1, 2, 2, options=AdaptiveOptions(AdaptiveRule(max_period=12), chunk_bytes=1 << 20))
    w = torch.nn.Parameter(torch.zeros(1000))

    def steps(count: int) -> None:
        for _ in range(count):
            time.sleep(0.02)  # a step's compute
            w.grad = torch.zeros_like(w)
            sync.after_backward({"w": w})
            with torch.no_grad():
                w.add_(0.01)
            sync.after_step({"w": w})

    with instrument(Traffic(), EmulatedLink(1e9, 0.1)):  # an aggregation: 2 ring steps of 100 ms, 5 x 2 steps
        sync.after_step({"w": w})
        steps(6)
        first = sync.exposed_s / sync.aggregations
        sync.after_round([1.0], exchange_rows(sync.round_figures(0.02)))
        before = (sync.exposed_s, sync.aggregations)
        steps(24)  # the next launch within 12 steps, its landing within the delay's (at most 12) after it
    later = (sync.exposed_s - before[0]) / (sync.aggregations - before[1])
    delays = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(delays, torch.tensor([float(sync.delay)]))
    assert len({float(d) for d in delays}) == 1 and sync.delay >= 3 and sync.period >= sync.delay
    assert later < first / 2, (first, later)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_aggregation_lands_after_its_delay_with_the_local_progress_on_top() -> None:
    from _gloo import run_ranks

    run_ranks(_delayed, 2, timeout_s=90)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_aggregation_slower_than_a_step_travels_under_more_steps() -> None:
    from _gloo import run_ranks

    run_ranks(_grows, 2, timeout_s=90)


def _one_interval(rank: int, world: int) -> None:
    import torch.distributed as dist

    from planner.runtime.launch.worker import exchange_rows

    sync = Adaptive(dist.group.WORLD, 1, 2, 4)
    sync.last_exposed_s = 0.02 if rank == 0 else 0.05  # ranks measure differently ...
    sync.after_round([2.0, 1.9], exchange_rows(sync.round_figures(0.01 * (rank + 1))))  # as the worker's round end
    periods = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(periods, torch.tensor([float(sync.period)]))
    assert len({float(p) for p in periods}) == 1  # ... and agree on the interval
    assert sync.period == next_period(0.02, 0.05, 1.95, 1.95, AdaptiveRule())


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_rank_chooses_the_same_interval() -> None:
    from _gloo import run_ranks

    run_ranks(_one_interval, 2, timeout_s=90)


# ---------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("sync")
    runner = CliRunner()
    profile = tmp / "profile.json"
    result = runner.invoke(app, ["profile", "planner.examples.digits:digits_mlp", "-o", str(profile)])
    assert result.exit_code == 0, result.output
    out = {"dir": tmp, "profile": profile}
    for name, args in {"pipeline": ["-d", "1"], "ssgd": ["-d", "2"],
                       "local": ["-d", "2", "--sync", "local-sgd", "--sync-period", "8"],
                       "adaptive": ["-d", "2", "--sync", "adaptive"]}.items():
        result = runner.invoke(app, ["partition", str(profile), "-c", "cpu-2", "-o", str(tmp / f"{name}.json"), *args])
        assert result.exit_code == 0, result.output
        out[name] = tmp / f"{name}.json"
    return out


def test_partition_records_the_mode_and_spreads_the_aggregation_over_its_period(files) -> None:
    from planner.formats.plan import load_plan

    ssgd, local, adaptive = (load_plan(files[k]) for k in ("ssgd", "local", "adaptive"))
    assert local.extra["data_parallel"]["sync"] == "local-sgd" and local.shape().period == 8
    assert adaptive.shape().sync == "adaptive" and adaptive.shape().period >= 1
    assert "period" not in ssgd.extra["data_parallel"]
    sync = float(ssgd.predicted["sync_s"]["0"])
    assert local.step_time_s == pytest.approx(ssgd.step_time_s - sync + sync / 8, rel=1e-6)
    assert "local-sgd every 8 steps" in local.shape().describe()
    result = CliRunner().invoke(app, ["check", str(files["local"]), "--profile", str(files["profile"])])
    assert result.exit_code == 0, result.output


def test_a_run_sizes_adaptives_sub_tensors_from_the_links_it_runs_on(files) -> None:
    """Without --sync-chunk-bytes the sub-tensor size is the one the cost model prices: from the plan's embedded
    cluster, and under --emulate-link from the slowed links (a 5 ms, 1e8 B/s link: about 4 MB, not the
    256 KiB floor)."""
    from planner.clusters import embedded_cluster
    from planner.formats.plan import load_plan
    from planner.formats.profile import load_profile
    from planner.partition.model.allreduce import chunk_bytes_for, sync_chunk_bytes
    from planner.runtime.launch.config import RunConfig
    from planner.runtime.launch.prepare import auto_chunk_bytes, sync_options, with_emulated_link

    plan = load_plan(files["adaptive"])
    devices = plan.replicas()[0]
    assert auto_chunk_bytes(plan) == sync_chunk_bytes(devices, embedded_cluster(plan).link)
    config = RunConfig(plan=str(files["adaptive"]), model="planner.examples.digits:digits_mlp", steps=2,
                       emulate_link="1e8,0.005")
    slowed = with_emulated_link(plan, load_profile(files["profile"]), config)
    chunk = sync_options(config, slowed).chunk_bytes
    assert chunk == sync_chunk_bytes(devices, embedded_cluster(slowed).link)  # loopback's figures added: ~3.9 MB
    assert chunk == pytest.approx(chunk_bytes_for(0.005, 1e8, 2), rel=0.03) and chunk > 15 * (1 << 18)
    given = RunConfig(plan=config.plan, model=config.model, steps=2, sync_chunk_bytes=1000)
    assert sync_options(given, slowed).chunk_bytes == 1000
    assert auto_chunk_bytes(load_plan(files["pipeline"])) == chunk_bytes_for(0, 0, 1)  # no replicas: the floor


@pytest.mark.parametrize("args,words", [
    (["--sync", "local-sgd", "-d", "2"], "--sync local-sgd needs --sync-period"),
    (["--sync", "local-sgd", "--sync-period", "0", "-d", "2"], "--sync-period must be a whole number"),
    (["--sync", "easgd", "-d", "2"], "unknown sync mode 'easgd'"),
    (["--sync-period", "4", "-d", "2"], "--sync-period 4 needs local steps"),
    (["--sync", "adaptive", "-d", "1"], "--sync adaptive combines replicas"),
])
def test_bad_sync_options_at_partition_are_one_line(files, args, words) -> None:
    out = files["dir"] / "bad.json"
    result = CliRunner().invoke(app, ["partition", str(files["profile"]), "-c", "cpu-2", "-o", str(out), *args])
    assert result.exit_code != 0 and words in result.output, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("plan,args,words", [
    ("ssgd", ["--sync-period", "0"], "--sync-period must be a whole number"),
    ("ssgd", ["--sync", "easgd"], "unknown --sync 'easgd'"),
    ("pipeline", ["--sync", "local-sgd", "--sync-period", "4"], "is a pure pipeline"),
    ("ssgd", ["--sync", "local-sgd"], "--sync local-sgd needs --sync-period"),
    ("ssgd", ["--sync-elastic", "1.5"], "--sync-elastic must be"),
    ("ssgd", ["--sync-momentum", "1"], "--sync-momentum must be"),
    ("ssgd", ["--sync-chunk-bytes", "2"], "--sync-chunk-bytes must be at least 4"),
])
def test_bad_sync_options_at_run_are_one_line(files, plan, args, words) -> None:
    result = CliRunner().invoke(app, ["run", str(files[plan]), "planner.examples.digits:digits_mlp", "--steps", "2",
                                      *args])
    assert result.exit_code != 0 and words in result.output, result.output
    assert "Traceback" not in result.output


def test_plan_check_refuses_a_bad_period_in_one_line(files) -> None:
    doc = json.loads(files["local"].read_text())
    for value, words in ((0, "a whole number of local steps"), ("4", "a whole number of local steps")):
        doc["data_parallel"]["period"] = value
        bad = files["dir"] / "bad-period.json"
        bad.write_text(json.dumps(doc))
        result = CliRunner().invoke(app, ["check", str(bad), "--profile", str(files["profile"])])
        assert result.exit_code != 0 and "data_parallel.period" in result.output and words in result.output
    doc = json.loads(files["ssgd"].read_text())
    doc["data_parallel"]["period"] = 4
    bad.write_text(json.dumps(doc))
    result = CliRunner().invoke(app, ["check", str(bad), "--profile", str(files["profile"])])
    assert result.exit_code != 0 and "1 for sync 'ssgd'" in result.output


def test_a_run_that_replaced_its_sync_reports_the_whole_run() -> None:
    """A re-plan installs a new sync that counts from zero; the summary adds up both (a re-plan after the last
    aggregation once reported none for a whole adaptive run)."""
    from planner.runtime.data_parallel import whole_run_report
    from planner.runtime.data_parallel.local import aggregation_report

    first = {**aggregation_report(2, 3, 0.3, 0.1), "periods": [2, 2, 4], "copy_s": 0.05, "interference_s": 0.01}
    second = {**aggregation_report(4, 0, 0.0, 0.0), "periods": [], "copy_s": 0.0, "interference_s": 0.02}
    merged = whole_run_report([first, second])
    assert merged["aggregations"] == 3 and merged["periods"] == [2, 2, 4] and merged["period"] == 4
    assert merged["aggregation_s"] == pytest.approx(0.3) and merged["exposed_s"] == pytest.approx(0.1)
    assert merged["hidden_fraction"] == pytest.approx(1 - 0.1 / 0.3) and merged["copy_s"] == pytest.approx(0.05)
    assert merged["interference_s"] == 0.02  # a figure, not a count: the last sync's
    assert whole_run_report([second]) == second
    assert whole_run_report([{}]) == {}


def test_a_replan_carries_the_adaptive_rule_on_where_it_was() -> None:
    """The sync a re-plan installs goes on with the replaced one's interval, starting loss and measured aggregation
    cost (it once started again from the new plan's first interval and took the loss at the re-plan as F_0); the
    step compute is measured again, and a fixed interval carries nothing."""
    from planner.runtime.data_parallel import Synchronous
    from planner.runtime.data_parallel.local import Adaptive, LocalSGD

    old = Adaptive(None, 2, 4, period=4)
    old.after_round([2.0], [(0.1, 0.05, 2.0)])  # F_0 = 2.0; the cost rule's interval from these figures
    assert old.delay == 2 and old.period >= 2
    old.last_exposed_s, old.interference_s, old.clean_s, old.period = 0.05, 0.01, 0.1, 9
    new = Adaptive(None, 2, 4, period=3)
    new.carry(old)
    assert (new.period, new.loss_start, new.last_exposed_s, new.interference_s, new.delay) == (9, 2.0, 0.05, 0.01, 2)
    assert new.clean_s is None and new.anchor is None and new.aggregations == 0
    fixed = LocalSGD(None, 2, 4, period=3)
    fixed.carry(old)
    assert fixed.period == 3
    untouched = Adaptive(None, 2, 4, period=3)
    untouched.carry(Synchronous(None, 4))
    assert (untouched.period, untouched.loss_start) == (3, None)
