"""Golden tests of the pipeline simulator: textbook bubbles, transfers on links, contention, memory."""

from __future__ import annotations

from dataclasses import replace

import pytest

from _partition_cases import FREE, cluster
from planner.errors import PlannerError
from planner.formats.cluster import cluster_from_dict
from planner.partition.model.cost import inflight_microbatches
from planner.partition.sim.schedules import BWD, FWD, device_orders, inflight_counts
from planner.partition.sim.simulate import SimStage, simulate

TEXTBOOK = [(2, 1, 1.0, 2.0), (2, 4, 1.0, 1.0), (3, 5, 0.3, 0.7), (4, 8, 1.0, 2.0), (5, 2, 1.0, 3.0),
            (8, 8, 0.25, 0.5), (4, 3, 0.1, 0.1), (1, 4, 1.0, 1.0)]


def uniform(p: int, fwd: float, bwd: float, *, sends: int = 0, static: int = 0, act: int = 0,
            devices: list[str] | None = None) -> list[SimStage]:
    devices = devices or [f"d{i}" for i in range(p)]
    return [SimStage(devices[i], fwd, bwd, sends if i < p - 1 else 0, sends if i > 0 else 0, static, act)
            for i in range(p)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m,fwd,bwd", TEXTBOOK)
def test_textbook_bubble(schedule: str, p: int, m: int, fwd: float, bwd: float) -> None:
    result = simulate(uniform(p, fwd, bwd), cluster(p, bandwidth_Bps=FREE), schedule, m)
    assert result.step_time_s == pytest.approx((m + p - 1) * (fwd + bwd), rel=1e-12)
    for stats in result.devices.values():
        assert stats.busy_s == pytest.approx(m * (fwd + bwd), rel=1e-12)
        assert stats.idle_s == pytest.approx((p - 1) * (fwd + bwd), rel=1e-12, abs=1e-12)
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (3, 2), (4, 4), (4, 9), (6, 3)])
def test_observed_inflight_matches_cost_model(schedule: str, p: int, m: int) -> None:
    result = simulate(uniform(p, 1.0, 2.0, static=1000, act=10), cluster(p, bandwidth_Bps=FREE), schedule, m)
    expected = [inflight_microbatches(schedule, s, p, m) for s in range(p)]
    assert list(result.stage_inflight) == expected
    assert expected == ([m] * p if schedule == "gpipe" else [min(m, p - s) for s in range(p)])
    for s, stats in enumerate(result.devices.values()):
        assert stats.peak_memory_bytes == 1000 + 10 * expected[s]


def test_events_cover_every_pass_in_dependency_order() -> None:
    p, m = 3, 4
    result = simulate(uniform(p, 1.0, 2.0, sends=10**9), cluster(p, bandwidth_Bps=1e9), "1f1b", m)
    ends = {(e.kind, e.stage, e.microbatch): e for e in result.events}
    assert sum(e.kind == "fwd" for e in result.events) == p * m
    assert sum(e.kind == "bwd" for e in result.events) == p * m
    for s in range(p):
        for j in range(m):
            if s > 0:
                assert ends[("fwd", s, j)].start_s >= ends[("send_fwd", s - 1, j)].end_s
                assert ends[("send_fwd", s - 1, j)].start_s >= ends[("fwd", s - 1, j)].end_s
            if s < p - 1:
                assert ends[("bwd", s, j)].start_s >= ends[("send_bwd", s + 1, j)].end_s
            assert ends[("bwd", s, j)].start_s >= ends[("fwd", s, j)].end_s
    for device in result.devices:
        busy = sorted((e.start_s, e.end_s) for e in result.events if e.resource == device)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(busy, busy[1:])), "a device ran two passes at once"


def test_transfer_is_latency_plus_bytes_over_link_bandwidth() -> None:
    # Two hosts: d0 on h0, d1 on h1, so the inter-host link carries the cut.
    stages = [SimStage("d0", 1.0, 2.0, 500, 0, 0, 0), SimStage("d1", 1.0, 2.0, 0, 300, 0, 0)]
    net = cluster(2, hosts=2, bandwidth_Bps=FREE, inter_bandwidth_Bps=100.0, inter_latency_s=0.5)
    result = simulate(stages, net, "gpipe", 1)
    # fwd d0 [0,1]; send 0.5 + 500/100 = 5.5 -> [1, 6.5]; fwd d1 [6.5, 7.5]; bwd d1 [7.5, 9.5];
    # send back 0.5 + 300/100 = 3.5 -> [9.5, 13]; bwd d0 [13, 15].
    assert result.step_time_s == pytest.approx(15.0)
    sends = [(e.resource, e.kind, e.start_s, e.end_s) for e in result.events if e.kind.startswith("send")]
    assert sends == [("d0->d1", "send_fwd", 1.0, 6.5), ("d1->d0", "send_bwd", 9.5, 13.0)]


def test_host_copy_link_charges_both_passes_and_adds_only_latency() -> None:
    # gloo between CPU ranks: each end copies 500 / 100 = 5 s of bytes itself; the link adds 0.5 s.
    stages = [SimStage("d0", 1.0, 2.0, 500, 0, 0, 0), SimStage("d1", 1.0, 2.0, 0, 300, 0, 0)]
    net = cluster(2, hosts=2, bandwidth_Bps=FREE, inter_bandwidth_Bps=100.0, inter_latency_s=0.5)
    copied = cluster_from_dict({**net.to_dict(), "links": {
        **net.to_dict()["links"], "inter_host": {"bandwidth_Bps": 100.0, "latency_s": 0.5, "host_copy": True}}})
    result = simulate(stages, copied, "gpipe", 1)
    # fwd d0 [0, 1 + 5]; latency -> 6.5; fwd d1 [6.5, 6.5 + 1 + 5]; bwd d1 [12.5, 12.5 + 2 + 3];
    # latency -> 18; bwd d0 [18, 18 + 2 + 3] = 23.
    assert result.step_time_s == pytest.approx(23.0)
    assert result.devices["d0"].busy_s == pytest.approx(1 + 5 + 2 + 3)
    sends = [e for e in result.events if e.kind.startswith("send")]
    assert [e.kind for e in sends] == ["send_fwd", "send_bwd"]
    assert [t for e in sends for t in (e.start_s, e.end_s)] == pytest.approx([6.0, 6.5, 17.5, 18.0])
    # the same link without host_copy overlaps the copy with compute: 15 s (see the test above)
    assert simulate(stages, net, "gpipe", 1).step_time_s == pytest.approx(15.0)


def test_runtime_pass_overhead_lengthens_every_pass() -> None:
    stages = [SimStage("d0", 1.0, 2.0, 0, 0, 0, 0), SimStage("d1", 1.0, 2.0, 0, 0, 0, 0)]
    net = cluster(2, bandwidth_Bps=FREE)
    slow = cluster_from_dict({**net.to_dict(), "runtime": {"pass_overhead_s": 0.25}})
    base, result = simulate(stages, net, "gpipe", 3), simulate(stages, slow, "gpipe", 3)
    assert result.devices["d0"].busy_s == pytest.approx(base.devices["d0"].busy_s + 6 * 0.25)
    # GPipe, 2 stages, 3 micro-batches: (3 + 1) forwards and (3 + 1) backwards on the critical path
    assert result.step_time_s == pytest.approx(base.step_time_s + 8 * 0.25)


def test_runtime_byte_overhead_lengthens_the_sending_and_the_receiving_pass() -> None:
    # d0 sends 1000 bytes forward, d1 sends 400 bytes back; 1 ms per 1000 bytes on top of a free link
    stages = [SimStage("d0", 1.0, 2.0, 1000, 0, 0, 0), SimStage("d1", 1.0, 2.0, 0, 400, 0, 0)]
    net = cluster(2, bandwidth_Bps=FREE)
    slow = cluster_from_dict({**net.to_dict(), "runtime": {"pass_byte_overhead_s": 1e-6}})
    assert slow.pass_byte_overhead_s == 1e-6 and slow.to_dict()["runtime"]["pass_byte_overhead_s"] == 1e-6
    base, result = simulate(stages, net, "gpipe", 3), simulate(stages, slow, "gpipe", 3)
    for dev in ("d0", "d1"):  # each micro-batch: 1 ms in the forward pair, 0.4 ms in the backward pair
        assert result.devices[dev].busy_s == pytest.approx(base.devices[dev].busy_s + 3 * (1e-3 + 0.4e-3))
    # GPipe, critical path: F0(d0), then 3 forwards and 3 backwards on d1, then B2(d0)
    assert result.step_time_s == pytest.approx(base.step_time_s + 4 * 1e-3 + 4 * 0.4e-3)

def test_optimizer_update_runs_after_each_devices_last_pass() -> None:
    stages = [SimStage("d0", 1.0, 1.0, 0, 0, 0, 0, update_s=0.5), SimStage("d1", 1.0, 1.0, 0, 0, 0, 0, update_s=4.0)]
    base = simulate([SimStage(*(getattr(st, f) for f in ("device", "fwd_s", "bwd_s", "send_fwd_bytes", "send_bwd_bytes",
                                                          "static_bytes", "activation_bytes"))) for st in stages],
                    cluster(2, bandwidth_Bps=FREE), "1f1b", 2)
    result = simulate(stages, cluster(2, bandwidth_Bps=FREE), "1f1b", 2)
    # d1's last backward ends 1 s before d0's; its 4 s update then ends 3 s after d0's 0.5 s update.
    last = {d: max(e.end_s for e in base.events if e.resource == d) for d in ("d0", "d1")}
    assert result.step_time_s == pytest.approx(max(last["d0"] + 0.5, last["d1"] + 4.0))
    assert result.step_time_s > base.step_time_s
    assert result.devices["d1"].busy_s == pytest.approx(base.devices["d1"].busy_s + 4.0)
    updates = {e.resource: e.end_s - e.start_s for e in result.events if e.kind == "update"}
    assert updates == pytest.approx({"d0": 0.5, "d1": 4.0})


def test_intra_host_pair_uses_its_own_link() -> None:
    stages = [SimStage("d0", 1.0, 1.0, 1000, 0, 0, 0), SimStage("d1", 1.0, 1.0, 0, 0, 0, 0)]
    net = cluster(2, bandwidth_Bps=1000.0, pairs=[{"a": "d1", "b": "d0", "bandwidth_Bps": 100.0, "latency_s": 1.0}])
    result = simulate(stages, net, "gpipe", 1)
    assert result.step_time_s == pytest.approx(1.0 + (1.0 + 10.0) + 1.0 + 1.0 + 1.0)


def test_transfers_on_one_link_serialise_but_overlap_compute() -> None:
    # Stage 0 computes fast (0.1 s) but each activation takes 1 s on the link: the link is the bottleneck,
    # so micro-batch j arrives at 0.1 + (j + 1) * 1.0, and the device never waits for its sends.
    stages = [SimStage("d0", 0.1, 0.0, 100, 0, 0, 0), SimStage("d1", 0.0, 0.0, 0, 0, 0, 0)]
    result = simulate(stages, cluster(2, bandwidth_Bps=100.0), "gpipe", 4)
    sends = [e for e in result.events if e.kind == "send_fwd"]
    assert [t for e in sends for t in (e.start_s, e.end_s)] == pytest.approx([0.1, 1.1, 1.1, 2.1, 2.1, 3.1, 3.1, 4.1])
    stage0 = [e for e in result.events if e.resource == "d0"]
    assert [e.end_s for e in stage0 if e.kind == "fwd"] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert result.step_time_s == pytest.approx(4.1)


def test_opposite_directions_do_not_contend() -> None:
    # 1F1B on two stages: gradients flow d1->d0 while activations flow d0->d1; separate directed links.
    stages = [SimStage("d0", 1.0, 1.0, 100, 0, 0, 0), SimStage("d1", 1.0, 1.0, 0, 100, 0, 0)]
    result = simulate(stages, cluster(2, bandwidth_Bps=100.0), "1f1b", 4)
    for link in ("d0->d1", "d1->d0"):
        busy = sorted((e.start_s, e.end_s) for e in result.events if e.resource == link)
        assert len(busy) == 4 and all(a[1] <= b[0] + 1e-12 for a, b in zip(busy, busy[1:]))
    assert {e.resource for e in result.events} == {"d0", "d1", "d0->d1", "d1->d0"}


def test_interleaving_reduces_the_bubble() -> None:
    p, v, m, fwd, bwd = 4, 2, 8, 1.0, 2.0
    net = cluster(p, bandwidth_Bps=FREE)
    plain = simulate(uniform(p, fwd, bwd), net, "1f1b", m)
    chunks = [SimStage(f"d{s % p}", fwd / v, bwd / v, 0, 0, 0, 0) for s in range(p * v)]
    inter = simulate(chunks, net, "interleaved-1f1b", m)
    # Megatron-LM: the bubble shrinks from (p-1)(F+B) to (p-1)(F+B)/v.
    assert inter.step_time_s == pytest.approx(m * (fwd + bwd) + (p - 1) * (fwd + bwd) / v, rel=1e-12)
    assert plain.step_time_s == pytest.approx((m + p - 1) * (fwd + bwd), rel=1e-12)
    assert inter.bubble_fraction < plain.bubble_fraction
    assert set(inter.devices) == {f"d{i}" for i in range(p)}


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (3, 2, 6), (4, 3, 8), (1, 3, 2), (4, 2, 4), (4, 2, 2), (4, 2, 6)])
def test_interleaved_memory_matches_cost_model(p: int, v: int, m: int) -> None:
    chunks = [SimStage(f"d{s % p}", 1.0, 2.0, 0, 0, 5, 10 + s) for s in range(p * v)]
    result = simulate(chunks, cluster(p, bandwidth_Bps=FREE), "interleaved-1f1b", m)
    assert list(result.stage_inflight) == [inflight_microbatches("interleaved-1f1b", s, p * v, m, p)
                                           for s in range(p * v)]


def test_interleaved_needs_round_robin_and_a_multiple_of_devices() -> None:
    net = cluster(2, bandwidth_Bps=FREE)
    bad_order = [SimStage(d, 1.0, 1.0, 0, 0, 0, 0) for d in ("d0", "d0", "d1", "d1")]
    with pytest.raises(PlannerError, match="round-robin"):
        simulate(bad_order, net, "interleaved-1f1b", 4)
    ok = [SimStage(d, 1.0, 1.0, 0, 0, 0, 0) for d in ("d0", "d1", "d0", "d1")]
    with pytest.raises(PlannerError, match="splits into 2 equal rounds.*found 5; use --microbatches 4"):
        simulate(ok, net, "interleaved-1f1b", 5)
    assert simulate(ok, net, "interleaved-1f1b", 1).step_time_s == pytest.approx(4 * 2.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_repeated_device_needs_interleaving(schedule: str) -> None:
    stages = [SimStage(d, 1.0, 1.0, 0, 0, 0, 0) for d in ("d0", "d1", "d0")]
    with pytest.raises(PlannerError, match="holds stages 0 and 2"):
        simulate(stages, cluster(2), schedule, 2)


def test_unknown_device_and_bad_settings_raise() -> None:
    with pytest.raises(PlannerError, match="not in cluster"):
        simulate([SimStage("gpu9", 1.0, 1.0, 0, 0, 0, 0)], cluster(1), "gpipe", 1)
    with pytest.raises(PlannerError, match="unknown schedule"):
        simulate(uniform(1, 1.0, 1.0), cluster(1), "zb-v", 1)
    with pytest.raises(PlannerError, match="at least 1"):
        simulate(uniform(1, 1.0, 1.0), cluster(1), "gpipe", 0)
    with pytest.raises(PlannerError, match="stage 1 has bwd_s = nan"):
        simulate(uniform(1, 1.0, 1.0) + [SimStage("d1", 1.0, float("nan"), 0, 0, 0, 0)], cluster(2), "gpipe", 1)
    with pytest.raises(PlannerError, match="stage 0 has send_fwd_bytes = -1"):
        simulate([SimStage("d0", 1.0, 1.0, -1, 0, 0, 0), SimStage("d1", 1.0, 1.0, 0, 0, 0, 0)], cluster(2), "1f1b", 1)


def test_record_events_off_gives_the_same_figures() -> None:
    stages = uniform(4, 0.3, 0.6, sends=1000)
    net = cluster(4, bandwidth_Bps=1e4, latency_s=0.01)
    with_events = simulate(stages, net, "1f1b", 6)
    without = simulate(stages, net, "1f1b", 6, record_events=False)
    assert without.events == ()
    assert (without.step_time_s, dict(without.devices)) == (with_events.step_time_s, dict(with_events.devices))


def test_schedule_orders_follow_their_definitions() -> None:
    gpipe = device_orders("gpipe", 2, 1, 2)
    assert gpipe[0] == ((FWD, 0, 0), (FWD, 0, 1), (BWD, 0, 0), (BWD, 0, 1))
    one_f = device_orders("1f1b", 3, 1, 4)
    assert one_f[0] == ((FWD, 0, 0), (FWD, 0, 1), (FWD, 0, 2), (BWD, 0, 0), (FWD, 0, 3), (BWD, 0, 1),
                        (BWD, 0, 2), (BWD, 0, 3))
    assert one_f[2] == tuple(op for j in range(4) for op in ((FWD, 2, j), (BWD, 2, j)))
    inter = device_orders("interleaved-1f1b", 2, 2, 2)
    # rank 0: warm-up 2*(2-1-0) + (2-1)*2 = 4 = all forwards: chunk 0 then chunk 1 for micro-batches 0, 1.
    assert inter[0][:4] == ((FWD, 0, 0), (FWD, 0, 1), (FWD, 2, 0), (FWD, 2, 1))
    assert inflight_counts(inter[0]) == {0: 2, 2: 2}


def _check_invariants(stages: list[SimStage], result, m: int) -> None:
    """Every pass once; no resource runs two things at once; dependencies and transfer durations hold."""
    by_key = {(e.kind, e.stage, e.microbatch): e for e in result.events}
    assert len(by_key) == len(result.events)
    p = len(stages)
    assert sum(e.kind in ("fwd", "bwd") for e in result.events) == 2 * p * m
    for resource in {e.resource for e in result.events}:
        spans = sorted((e.start_s, e.end_s) for e in result.events if e.resource == resource)
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:])), resource
    for s in range(p):
        for j in range(m):
            fwd, bwd = by_key[("fwd", s, j)], by_key[("bwd", s, j)]
            assert fwd.end_s - fwd.start_s == pytest.approx(stages[s].fwd_s)
            assert bwd.start_s >= fwd.end_s - 1e-9
            if s > 0:
                sent = by_key.get(("send_fwd", s - 1, j))
                assert fwd.start_s >= (sent.end_s if sent else by_key[("fwd", s - 1, j)].end_s) - 1e-9
            if s < p - 1:
                sent = by_key.get(("send_bwd", s + 1, j))
                assert bwd.start_s >= (sent.end_s if sent else by_key[("bwd", s + 1, j)].end_s) - 1e-9
    assert result.step_time_s == pytest.approx(max(e.end_s for e in result.events))
    for device, stats in result.devices.items():
        busy = sum(e.end_s - e.start_s for e in result.events if e.resource == device)
        assert stats.busy_s == pytest.approx(busy)


@pytest.mark.parametrize("seed", range(12))
def test_random_pipelines_keep_the_invariants(seed: int) -> None:
    import random

    rng = random.Random(seed)
    schedule = ["gpipe", "1f1b", "interleaved-1f1b"][seed % 3]
    p = rng.randint(1, 5)
    v = rng.randint(2, 3) if schedule == "interleaved-1f1b" else 1
    m = p * rng.randint(1, 3) if v > 1 else rng.randint(1, 7)
    net = cluster(p, hosts=rng.randint(1, 2), bandwidth_Bps=rng.choice([1e3, 1e4]), latency_s=rng.random() * 0.1,
                  inter_bandwidth_Bps=500.0, inter_latency_s=0.2)
    stages = [SimStage(f"d{s % p}", rng.random(), rng.random() * 2, rng.randint(0, 2000), rng.randint(0, 2000),
                       rng.randint(0, 100), rng.randint(0, 50)) for s in range(p * v)]
    stages[-1] = SimStage(stages[-1].device, stages[-1].fwd_s, stages[-1].bwd_s, 0, stages[-1].send_bwd_bytes,
                          stages[-1].static_bytes, stages[-1].activation_bytes)
    result = simulate(stages, net, schedule, m)
    _check_invariants(stages, result, m)
    lower = max(stats.busy_s for stats in result.devices.values())
    assert result.step_time_s >= lower - 1e-9


def test_interleaved_chunks_share_and_queue_on_links() -> None:
    # p = 2, v = 2: d0->d1 carries stage 0->1 and stage 2->3 activations; they must queue.
    stages = [SimStage(d, 0.1, 0.2, 1000, 1000, 0, 0) for d in ("d0", "d1", "d0", "d1")]
    result = simulate(stages, cluster(2, bandwidth_Bps=1000.0), "interleaved-1f1b", 4)
    _check_invariants(stages, result, 4)
    kinds = {(e.resource, e.stage) for e in result.events if e.kind == "send_fwd"}
    assert kinds == {("d0->d1", 0), ("d1->d0", 1), ("d0->d1", 2)}


def test_interleaved_on_one_device_runs_all_chunks_locally() -> None:
    stages = [SimStage("d0", 1.0, 2.0, 10**6, 10**6, 5, 1) for _ in range(3)]
    result = simulate(stages, cluster(1, bandwidth_Bps=1.0), "interleaved-1f1b", 2)
    assert result.step_time_s == pytest.approx(3 * 2 * 3.0)  # no transfers, no idle time
    assert result.bubble_fraction == pytest.approx(0.0)
    assert not [e for e in result.events if e.kind.startswith("send")]


def _torch_interleaved_order(p: int, v: int, m: int, rank: int) -> tuple:
    """The compute actions torch's ScheduleInterleaved1F1B plans for ``rank`` (private API; skip if it moved)."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    method = getattr(schedules.ScheduleInterleaved1F1B, "_calculate_single_rank_operations", None)
    if method is None:
        pytest.skip("torch no longer exposes ScheduleInterleaved1F1B._calculate_single_rank_operations")
    rounds = max(1, m // p)
    fake = SimpleNamespace(n_local_stages=v, pp_group_size=p, microbatches_per_round=m // rounds, _n_microbatches=m)
    ops = []
    for action in method(fake, rank):
        if action is not None:
            kind = action.computation_type.name
            assert kind in ("FORWARD", "FULL_BACKWARD"), kind
            ops.append((FWD if kind == "FORWARD" else BWD, action.stage_index, action.microbatch_index))
    return tuple(ops)


@pytest.mark.parametrize("p,v,m", [(2, 2, 4), (2, 2, 3), (3, 2, 6), (4, 2, 2), (4, 2, 6), (4, 3, 8), (5, 2, 10)])
def test_interleaved_orders_match_torch_pipelining(p: int, v: int, m: int) -> None:
    orders = device_orders("interleaved-1f1b", p, v, m)
    for rank in range(p):
        assert orders[rank] == _torch_interleaved_order(p, v, m, rank)


@pytest.mark.parametrize("schedule,cls", [("gpipe", "ScheduleGPipe"), ("1f1b", "Schedule1F1B")])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (2, 5), (3, 3), (4, 8), (5, 7)])
def test_single_stage_orders_match_torch_pipelining(schedule: str, cls: str, p: int, m: int) -> None:
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    method = getattr(getattr(schedules, cls), "_get_pipeline_order", None)
    if method is None:
        pytest.skip(f"torch no longer exposes {cls}._get_pipeline_order")
    theirs = method(SimpleNamespace(_num_stages=p, _n_microbatches=m))
    ours = device_orders(schedule, p, 1, m)
    # torch 2.13's Schedule1F1B IR numbers the last rank's forwards from 1 (it lists micro-batches 1..m, and
    # m does not exist); its executor (_step_microbatches) runs 0..m-1. Compare the ranks its IR gets right.
    ranks = range(p - 1) if schedule == "1f1b" else range(p)
    for rank in ranks:
        compute = [(FWD if a.computation_type.name == "FORWARD" else BWD, a.stage_index, a.microbatch_index)
                   for a in theirs[rank] if a is not None and a.computation_type.name in ("FORWARD", "FULL_BACKWARD")]
        assert ours[rank] == tuple(compute)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_tied_weight_is_all_reduced_after_the_last_pass_and_before_the_updates(schedule: str) -> None:
    """The runtime sums a tied weight's gradient over the ranks holding it (``sync_tied_grads``) once the schedule
    is done, then steps the optimizers: the step grows by that all-reduce, which starts when the later device is
    done, and each update starts after it."""
    from planner.partition.model.allreduce import allreduce_s

    net = cluster(3, bandwidth_Bps=1e9, latency_s=1e-4)
    stages = [SimStage(f"d{i}", 1.0, 2.0, 10**6, 10**6 if i else 0, 0, 0, update_s=0.5) for i in range(3)]
    plain = simulate(stages, net, schedule, 4)
    tied = simulate(stages, net, schedule, 4, tied=[((0, 2), 4 * 10**6)])
    took = allreduce_s(["d0", "d2"], 4 * 10**6, net.link, {d.id: d.host for d in net.devices})
    assert took > 0 and tied.step_time_s == pytest.approx(plain.step_time_s + took)
    syncs = [e for e in tied.events if e.kind == "sync"]
    assert {e.resource for e in syncs} == {"d0", "d2"}
    done = max(e.end_s for e in plain.events if e.resource in ("d0", "d2") and e.kind != "update")
    assert all(e.start_s == pytest.approx(done) and e.end_s == pytest.approx(done + took) for e in syncs)
    updates = {e.resource: e for e in tied.events if e.kind == "update"}
    assert updates["d0"].start_s == updates["d2"].start_s == pytest.approx(done + took)
    assert simulate(stages, net, schedule, 4, tied=[((1,), 4 * 10**6)]).step_time_s == plain.step_time_s  # one holder


def test_a_plan_whose_stages_share_a_tied_weight_records_it_and_replays_its_step() -> None:
    """gpt_tiny's embedding and LM head split over two devices: the plan records the all-reduce (``tied_sync``) and
    ``plan show``'s replay of the saved plan gives its predicted step."""
    from pathlib import Path

    from planner.formats.cluster import load_cluster
    from planner.formats.plan import plan_from_dict
    from planner.formats.profile import load_profile
    from planner.partition.model.convert import build_plan
    from planner.partition.model.problem import StageSpec, build_problem
    from planner.report.replay import simulate_plan

    root = Path(__file__).resolve().parents[1]
    problem = build_problem(load_profile(root / "tests" / "golden" / "profiles" / "gpt_tiny.json"),
                            load_cluster(root / "profiles" / "clusters" / "cpu-2.json"), microbatches=4,
                            schedule="1f1b", optimizer="adam")
    n = len(problem.blocks)
    plan = build_plan(problem, (StageSpec(0, n // 2, "cpu0"), StageSpec(n // 2, n, "cpu1")), method="manual")
    ((nbytes, _),) = problem.tied
    assert plan.extra["tied_sync"] == [{"stages": [0, 1], "bytes": nbytes}]
    saved = plan_from_dict(plan.to_dict())
    assert simulate_plan(saved).step_time_s == pytest.approx(plan.step_time_s, rel=1e-12)
    whole = build_plan(problem, (StageSpec(0, n, "cpu0"),), method="manual")
    assert "tied_sync" not in whole.extra


def _layout(schedule: str, p: int, v: int) -> list[str]:
    """Stage devices of a pipeline on ``p`` devices under ``schedule``: one stage each, ``v`` rounds of them
    (interleaved), or a V (``zbv``, ``dualpipev``, and ``zb-planned`` when ``v`` is 2)."""
    devices = [f"d{r}" for r in range(p)]
    if schedule in ("zbv", "dualpipev") or (schedule == "zb-planned" and v == 2):
        return devices + devices[::-1]
    return devices * (v if schedule == "interleaved-1f1b" else 1)


@pytest.mark.parametrize("seed", range(40))
def test_fixed_orders_time_exactly_as_the_event_loop(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_run_orders`` times fixed orders device by device; the event loop (``_run_events``) is the definition. On
    random pipelines of every schedule, with queued and host-copied transfers, per-pass and per-byte costs, updates,
    split backwards and tied weights, both give the same floats: step, every device's figures, memory, in-flight
    micro-batches, orders and events."""
    import random

    from planner.formats.plan import ASYNC_SCHEDULES, SCHEDULES
    from planner.partition.sim import simulate as sim

    rng = random.Random(seed)
    schedule = SCHEDULES[seed % len(SCHEDULES)]
    p = rng.randint(2, 4) if schedule in ("zbv", "dualpipev") else rng.randint(1, 4)
    v = 2 if schedule in ("zbv", "dualpipev") or (schedule == "zb-planned" and rng.random() < 0.5) else \
        rng.randint(2, 3) if schedule == "interleaved-1f1b" else 1
    m = p * rng.randint(1, 3) if schedule == "interleaved-1f1b" else rng.randint(2 * p, 3 * p + 2)
    net = cluster(p, hosts=rng.randint(1, 2), bandwidth_Bps=rng.choice([1e3, 1e4]), latency_s=rng.random() * 0.01,
                  inter_bandwidth_Bps=500.0, inter_latency_s=0.02,
                  pairs=[{"a": "d0", "b": "d1", "bandwidth_Bps": 2e3, "latency_s": 0.0, "host_copy": True}]
                  if p > 1 and rng.random() < 0.5 else ())
    net = replace(net, pass_overhead_s=rng.choice([0.0, 0.01]), pass_byte_overhead_s=rng.choice([0.0, 1e-6]))
    stages = []
    for s, device in enumerate(_layout(schedule, p, v)):
        bwd = rng.random() * 2
        weight = bwd * rng.random() * 0.5
        stages.append(SimStage(device, rng.random(), bwd, rng.randint(0, 200) if s < p * v - 1 else 0,
                               rng.randint(0, 200) if s else 0, rng.randint(0, 100), rng.randint(1, 50),
                               update_s=rng.random() * 0.3, bwd_weight_s=weight, split_excess_s=weight * 0.2))
    tied = [((0, len(stages) - 1), 400)] if rng.random() < 0.5 and schedule not in ASYNC_SCHEDULES else ()
    drain = rng.choice([None, 2]) if schedule in ASYNC_SCHEDULES else None
    fast = simulate(stages, net, schedule, m, tied=tied, drain_every=drain)
    monkeypatch.setattr(sim, "_run_orders", sim._run_events)
    slow = simulate(stages, net, schedule, m, tied=tied, drain_every=drain)
    key = (lambda e: (e.start_s, e.end_s, e.resource, e.kind, e.stage, e.microbatch))
    assert sorted(fast.events, key=key) == sorted(slow.events, key=key) and fast.events
    assert replace(fast, events=()) == replace(slow, events=())
