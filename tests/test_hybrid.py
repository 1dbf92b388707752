"""Hybrid plans (pipeline x data parallel): the sync cost, the simulator, the shape search and bad input."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from _partition_cases import chain
from typer.testing import CliRunner

from planner.cli import app
from planner.errors import InfeasibleError, PlannerError, UsageError
from planner.formats.cluster import Cluster, Device, Link
from planner.formats.plan import SCHEDULES, save_plan
from planner.formats.profile import save_profile
from planner.partition import partition
from planner.partition.model.allreduce import allreduce_s
from planner.partition.model.cost import evaluate, stage_sims, stage_sync_s, step_time_s
from planner.partition.model.feasibility import violations
from planner.partition.model.problem import Placed, StageSpec, build_problem, replica_of, shares_of
from planner.partition.search.groups import pipelines_of
from planner.partition.search.hybrid import proportional_shares
from planner.partition.validate import validate_plan

FAST = Link(bandwidth_Bps=1e9, latency_s=1e-6)
SLOW = Link(bandwidth_Bps=1e8, latency_s=1e-5)


def hosts(*counts: int, memory_bytes: int = 10**9) -> Cluster:
    devices = tuple(Device(f"h{h}d{i}", "cpu", f"host{h}", memory_bytes) for h, n in enumerate(counts) for i in range(n))
    return Cluster("hosts", devices, intra_host=FAST, inter_host=SLOW)


# --- the sync cost ---------------------------------------------------------------------------------

def test_a_ring_within_one_host_moves_2_d_minus_1_chunks_of_n_over_d() -> None:
    cl = hosts(4)
    host = {d.id: d.host for d in cl.devices}
    n = 4e6
    expected = 2 * 3 * (FAST.latency_s + (n / 4) / FAST.bandwidth_Bps)
    assert allreduce_s(cl.device_ids, n, cl.link, host) == pytest.approx(expected)
    assert allreduce_s(cl.device_ids[:1], n, cl.link, host) == 0.0
    assert allreduce_s(cl.device_ids, 0, cl.link, host) == 0.0


def test_every_ring_step_pays_the_runtimes_cost_per_byte_sent_and_received() -> None:
    """On CPU ranks gloo's copies run on the ranks' cores: each ring step sends one chunk and receives one, and both
    cost ``Cluster.pass_byte_overhead_s`` per byte, as point-to-point sends do in the simulator."""
    from dataclasses import replace

    per_byte = 3e-10
    n = 4e6
    cl = hosts(4)
    host = {d.id: d.host for d in cl.devices}
    step = FAST.latency_s + (n / 4) / FAST.bandwidth_Bps + 2 * (n / 4) * per_byte
    assert allreduce_s(cl.device_ids, n, cl.link, host, byte_overhead_s=per_byte) == pytest.approx(2 * 3 * step)
    two = hosts(2, 2)
    host = {d.id: d.host for d in two.devices}
    inside = FAST.latency_s + (n / 2) / FAST.bandwidth_Bps + 2 * (n / 2) * per_byte
    across = 2 * (SLOW.latency_s + (n / 4) / SLOW.bandwidth_Bps + 2 * (n / 4) * per_byte)
    assert allreduce_s(two.device_ids, n, two.link, host, byte_overhead_s=per_byte) == pytest.approx(2 * inside + across)
    # the cost model takes the figure from the cluster file
    profile = chain(4, params=10**6)
    stage = StageSpec(0, 4, "h0d0", ("h0d0", "h0d1"))
    plain = build_problem(profile, hosts(2), microbatches=4, schedule="1f1b", optimizer="sgd")
    probed = build_problem(profile, replace(hosts(2), pass_byte_overhead_s=per_byte), microbatches=4, schedule="1f1b",
                           optimizer="sgd")
    nbytes = plain.tables.param_prefix[4] - plain.tables.param_prefix[0]  # the gradients all-reduced
    assert nbytes > 0
    assert stage_sync_s(probed, stage) - stage_sync_s(plain, stage) == pytest.approx(2 * 2 * (nbytes / 2) * per_byte,
                                                                                      rel=1e-6)
    # through a parameter server: each worker's push and pull pay it once each
    from planner.partition.model.problem import with_sync

    served, plain_served = with_sync(probed, "bsp", None), with_sync(plain, "bsp", None)
    assert stage_sync_s(served, stage) - stage_sync_s(plain_served, stage) == pytest.approx(2 * 2 * nbytes * per_byte,
                                                                                            rel=1e-6)


def test_sub_tensors_pay_every_latency_once_per_piece_and_are_sized_from_the_slowest_link() -> None:
    """adaptive's aggregation travels as ``k`` all-reduces of at most ``c`` bytes: the bytes cost what one all-reduce's
    do, every latency is paid ``k`` times; ``c`` keeps a ring step's latency at most a fifth of the step."""
    from planner.partition.model.allreduce import CHUNK_FLOOR_BYTES, chunk_bytes_for, sync_chunk_bytes

    cl = hosts(4)
    host = {d.id: d.host for d in cl.devices}
    n = 4e6
    whole = allreduce_s(cl.device_ids, n, cl.link, host)
    assert allreduce_s(cl.device_ids, n, cl.link, host, chunk_bytes=1e6) == pytest.approx(
        whole + 3 * 2 * 3 * FAST.latency_s)  # 4 pieces: 3 more latencies on each of the 2 (d - 1) ring steps
    assert allreduce_s(cl.device_ids, n, cl.link, host, chunk_bytes=1e9) == pytest.approx(whole)
    two = hosts(2, 2)
    host = {d.id: d.host for d in two.devices}
    latencies = 2 * FAST.latency_s + 2 * SLOW.latency_s  # reduce-scatter, gather inside; the shard ring across
    assert allreduce_s(two.device_ids, n, two.link, host, chunk_bytes=n / 3) == pytest.approx(
        allreduce_s(two.device_ids, n, two.link, host) + 2 * latencies)
    # the size: a ring step of c / d bytes takes at least 4 latencies of the link's time on the wire
    c = chunk_bytes_for(5e-3, 1e8, 2)
    assert c == 4 * 2 * 1e8 * 5e-3
    assert 5e-3 / (5e-3 + (c / 2) / 1e8) == pytest.approx(0.2)
    assert chunk_bytes_for(1e-6, 1e9, 2) == CHUNK_FLOOR_BYTES  # fast links: the floor
    assert sync_chunk_bytes(two.device_ids, two.link) == chunk_bytes_for(SLOW.latency_s, SLOW.bandwidth_Bps, 4)


def test_across_hosts_it_is_hierarchical_reduce_scatter_all_reduce_all_gather() -> None:
    cl = hosts(2, 2)
    host = {d.id: d.host for d in cl.devices}
    n = 4e6
    inside = (2 - 1) * (FAST.latency_s + (n / 2) / FAST.bandwidth_Bps)
    across = 2 * (2 - 1) * (SLOW.latency_s + (n / 4) / SLOW.bandwidth_Bps)
    assert allreduce_s(cl.device_ids, n, cl.link, host) == pytest.approx(2 * inside + across)
    # One replica per host: a plain ring over the slow links.
    one_each = [cl.device_ids[0], cl.device_ids[2]]
    assert allreduce_s(one_each, n, cl.link, host) == pytest.approx(2 * (SLOW.latency_s + (n / 2) / SLOW.bandwidth_Bps))


def test_hosts_that_share_nics_divide_the_cross_host_bandwidth_among_their_streams() -> None:
    """Issue 22, point 7: 2 hosts of 4 replicas; with one NIC per host the 4 shard rings of a host share it."""
    from dataclasses import replace as dc_replace

    from planner.formats.cluster import cluster_from_dict

    cl = hosts(4, 4)
    host = {d.id: d.host for d in cl.devices}
    n = 8e6
    inside = (4 - 1) * (FAST.latency_s + (n / 4) / FAST.bandwidth_Bps)
    per_device = 2 * inside + 2 * (2 - 1) * (SLOW.latency_s + (n / 8) / SLOW.bandwidth_Bps)
    shared = 2 * inside + 2 * (2 - 1) * (SLOW.latency_s + (n / 8) / (SLOW.bandwidth_Bps / 4))
    assert allreduce_s(cl.device_ids, n, cl.link, host) == pytest.approx(per_device)
    assert allreduce_s(cl.device_ids, n, cl.link, host, nics_per_host=1) == pytest.approx(shared)
    assert allreduce_s(cl.device_ids, n, cl.link, host, nics_per_host=4) == pytest.approx(per_device)
    # the cluster file says it, the cost model reads it, and it survives a round trip
    doc = dc_replace(cl, nics_per_host=2).to_dict()
    assert doc["links"]["inter_host"]["nics_per_host"] == 2
    assert cluster_from_dict(doc).nics_per_host == 2
    doc["links"]["inter_host"]["nics_per_host"] = 0
    with pytest.raises(PlannerError, match="nics_per_host' must be a whole number of network interfaces"):
        cluster_from_dict(doc)
    problem_slow = build_problem(toy_problem(cl, microbatches=4, schedule="gpipe")[0], dc_replace(cl, nics_per_host=1),
                                 microbatches=4, schedule="gpipe", optimizer="sgd")
    problem_fast = build_problem(toy_problem(cl, microbatches=4, schedule="gpipe")[0], cl, microbatches=4,
                                 schedule="gpipe", optimizer="sgd")
    stage = StageSpec(0, len(problem_fast.blocks), cl.device_ids[0], tuple(cl.device_ids))
    assert stage_sync_s(problem_slow, stage) > stage_sync_s(problem_fast, stage)
    # The hierarchy beats a flat ring whose slowest hop is the slow link.
    flat = 2 * 3 * (SLOW.latency_s + (n / 4) / SLOW.bandwidth_Bps)
    assert allreduce_s(cl.device_ids, n, cl.link, host) < flat


# --- the simulator ------------------------------------------------------------------------------------

def toy_problem(cl: Cluster, microbatches: int = 4, schedule: str = "gpipe", n: int = 6):
    profile = chain(n, fwd=1e-3, bwd=2e-3, out=1000, params=10**5, saved=50)
    return profile, build_problem(profile, cl, microbatches=microbatches, schedule=schedule, optimizer="sgd")


def test_replicas_run_their_shares_then_sync_then_update() -> None:
    cl = hosts(4)
    _, problem = toy_problem(cl)
    ids = cl.device_ids
    hybrid = Placed((StageSpec(0, 3, ids[0], (ids[0], ids[2])), StageSpec(3, 7, ids[1], (ids[1], ids[3]))),
                    shares=[3, 1])
    result = evaluate(problem, hybrid)
    assert set(result.devices) == set(ids)
    assert len(result.sync_s) == 2 and all(s > 0 for s in result.sync_s)
    fwd = {d: sum(1 for e in result.events if e.resource == d and e.kind == "fwd") for d in ids}
    assert fwd == {ids[0]: 3, ids[1]: 3, ids[2]: 1, ids[3]: 1}  # each replica its own share
    syncs = [e for e in result.events if e.kind == "sync" and e.resource in ids]
    assert {e.resource for e in syncs} == set(ids)
    for stage in (0, 1):  # a stage syncs once both of its replicas have finished their backward passes
        start = min(e.start_s for e in syncs if e.stage == stage)
        holders = [hybrid[stage].devices[r] for r in range(2)]
        last_bwd = max(e.end_s for e in result.events if e.kind == "bwd" and e.resource in holders)
        assert start == pytest.approx(last_bwd)
    # The uneven split is slower than the even one on identical devices.
    even = Placed(tuple(hybrid), shares=[2, 2])
    assert step_time_s(problem, even) < result.step_time_s


def test_adaptive_is_charged_what_the_steps_of_its_period_do_not_hide() -> None:
    """adaptive's aggregation travels under as many of the next steps as it needs, up to the next launch: an
    all-reduce of ``a`` seconds over steps of ``c`` costs the period H ``max(a - H c, 0) / H`` a step, so the step is
    ``max(a / H, c)``: link-bound or compute-bound (it was charged what one step did not hide, ``(a - c) / H``)."""
    from planner.partition.model.problem import with_sync

    cl = hosts(1, 1)  # two devices across the slow link
    profile = chain(6, fwd=1e-3, bwd=2e-3, out=1000, params=5 * 10**6, saved=50)
    problem = build_problem(profile, cl, microbatches=4, schedule="gpipe", optimizer="sgd")
    placed = Placed((StageSpec(0, 7, cl.device_ids[0], tuple(cl.device_ids)),), shares=[2, 2])
    step = {h: step_time_s(with_sync(problem, "adaptive", h), placed) for h in (1, 2, 3, 4, 8, 16, 32)}
    compute = step[32]
    assert step[1] > 4 * compute  # the aggregation outlasts four steps
    for h in (2, 3, 4, 8):
        assert step[h] == pytest.approx(max(step[1] / h, compute), rel=1e-9), h
    assert step[16] == pytest.approx(compute)  # compute-bound


def test_the_feasibility_rule_covers_replicas() -> None:
    cl = hosts(4)
    _, problem = toy_problem(cl, schedule="1f1b")
    ids = cl.device_ids
    ok = (StageSpec(0, 3, ids[0], (ids[0], ids[2])), StageSpec(3, 7, ids[1], (ids[1], ids[3])))
    assert violations(problem, Placed(ok, shares=[2, 2])) == []
    overlap = (StageSpec(0, 3, ids[0], (ids[0], ids[1])), StageSpec(3, 7, ids[1], (ids[1], ids[3])))
    assert "a device may serve one replica only" in violations(problem, overlap)[0]
    unequal = (StageSpec(0, 3, ids[0], (ids[0], ids[2])), StageSpec(3, 7, ids[1]))
    assert "same number of replicas" in violations(problem, unequal)[0]
    bad_sum = Placed(ok, shares=[2, 1])
    assert "sum to the step's 4 micro-batches" in violations(problem, bad_sum)[0]
    short = Placed(ok, shares=[3, 1])  # 1f1b: a replica needs >= stages
    assert "replica 1 (share 1): 1f1b needs" in violations(problem, short)[0]


# --- the shape search ---------------------------------------------------------------------------------

def test_pipelines_are_dealt_two_ways() -> None:
    devices = ["a", "b", "c", "d", "e", "f"]
    assert pipelines_of(devices, 2, "pipeline-local") == [["a", "b", "c"], ["d", "e", "f"]]
    assert pipelines_of(devices, 2, "stage-local") == [["a", "c", "e"], ["b", "d", "f"]]
    assert pipelines_of(devices, 4, "pipeline-local") == [["a"], ["b"], ["c"], ["d"]]  # e, f unused


SHUFFLED_MIXED = ["b-l4-1", "a-a100-1", "b-v100-0", "a-h100-1", "b-l4-0", "a-h100-0", "b-v100-1", "a-a100-0"]
"""mixed-3type-2host's devices listed with the hosts interleaved and the slowest types first."""


@pytest.mark.parametrize("n, out, params, schedule, m", [(8, 10**5, 10**6, "1f1b", 8), (12, 10**6, 10**5, "gpipe", 16)])
def test_a_file_that_interleaves_hosts_and_lists_slow_types_first_gets_the_bundled_files_shapes(
        n, out, params, schedule, m) -> None:
    """Issue 27, "device groups by type, not by file order": the dealings also start from the devices by host and
    speed (``host_speed_order``), so a file that interleaves mixed-3type-2host's hosts and lists its slowest types
    first gets the shape the bundled file gets (2 x 2 stage-local at 1f1b, and at gpipe 5 one-device replicas on
    the 5 fastest devices). Dealt from that file's order alone, both cases came out slower (0.4357 vs 0.4314 ms,
    0.7677 vs 0.6773 ms)."""
    from dataclasses import replace

    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.partition.model.problem import host_speed_order

    bundled = load_cluster_spec("mixed-3type-2host")
    by_id = {d.id: d for d in bundled.devices}
    shuffled = replace(bundled, devices=tuple(by_id[i] for i in SHUFFLED_MIXED))
    profile = chain(n, fwd=1e-3, bwd=2e-3, out=out, params=params, saved=10**5)
    problem = build_problem(profile, shuffled, microbatches=m, schedule=schedule, catalog=load_catalog())
    kind = {d.id: (d.host, d.type) for d in bundled.devices}
    assert [kind[x] for x in host_speed_order(problem)] == [kind[x] for x in bundled.device_ids]
    kwargs = dict(method="dp", microbatches=m, schedule=schedule, optimizer="adam", data_parallel="auto",
                  catalog=load_catalog())
    listed, interleaved = partition(profile, bundled, **kwargs), partition(profile, shuffled, **kwargs)
    assert interleaved.extra["shape"]["chosen"]["degree"] > 1
    assert interleaved.step_time_s == pytest.approx(listed.step_time_s, rel=1e-9)
    assert validate_plan(interleaved, profile, shuffled, catalog=load_catalog()) == []


def test_shares_follow_speed_with_a_floor() -> None:
    assert proportional_shares([3.0, 1.0], 8, 1) == (6, 2)
    assert proportional_shares([1.0, 1.0], 5, 1) == (3, 2)
    assert proportional_shares([3.0, 1.0], 8, 4) == (4, 4)
    assert proportional_shares([1.0, 1.0], 3, 2) is None


def brute_force_shape(problem) -> float:
    """The least simulated step time over every degree d, every ordered grouping of the devices into d pipelines
    of equal length, every contiguous cut into at most that many stages, and every split of the micro-batches
    into d positive shares; only feasible plans count. A plan is judged once: the permutations that differ only
    in the devices past a pipeline's last stage give the same plan, which is looked up, not simulated again. A plan
    whose bound (``_step_bound_s``) is no shorter than the best step so far cannot beat it and is not
    simulated."""
    ids, n, m = problem.cluster.device_ids, len(problem.blocks), problem.microbatches
    best = float("inf")
    judged: set[tuple[object, ...]] = set()
    for d in range(1, min(len(ids), m) + 1):
        k = len(ids) // d
        for used in itertools.permutations(ids, d * k):
            pipelines = [used[r * k:(r + 1) * k] for r in range(d)]
            for stages in range(1, min(k, n) + 1):
                for cuts in itertools.combinations(range(1, n), stages - 1):
                    bounds = list(zip((0, *cuts), (*cuts, n)))
                    specs = tuple(StageSpec(a, b, pipelines[0][i], tuple(p[i] for p in pipelines) if d > 1 else ())
                                  for i, (a, b) in enumerate(bounds))
                    for shares in _compositions(m, d):
                        if (specs, shares) in judged:
                            continue
                        judged.add((specs, shares))
                        plan = Placed(specs, shares=list(shares))
                        if _step_bound_s(problem, plan) < best and not violations(problem, plan):
                            best = min(best, step_time_s(problem, plan))
    return best


def _step_bound_s(problem, plan) -> float:
    """A step ``plan`` cannot beat, at the times the simulator is given (``stage_sims``; transfers, syncs and
    sharing a host's cores only add to them): a replica pipeline's stage ``i`` with ``s`` micro-batches starts once
    micro-batch 0 has gone forward through the stages before it, runs ``s`` forwards and backwards one after another,
    and after its last backward, its update runs on its device while that gradient goes back through the stages
    before it."""
    bound = 0.0
    for r, share in enumerate(shares_of(plan, problem.microbatches)):
        before_f = before_b = 0.0
        for st in stage_sims(problem, replica_of(plan, r)):
            bound = max(bound, before_f + share * (st.fwd_s + st.bwd_s) + max(st.update_s, before_b))
            before_f, before_b = before_f + st.fwd_s, before_b + st.bwd_s
    return bound


def _compositions(m: int, d: int):
    for cut in itertools.combinations(range(1, m), d - 1):
        bounds = (0, *cut, m)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(d))


@pytest.mark.parametrize("method", ["dp", "ilp", "greedy"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_search_is_never_better_than_brute_force_and_the_exact_methods_equal_it(method: str, seed: int) -> None:
    """Brute force over (degree, groups, cuts, shares) bounds every placer from below; the exact methods' search
    equals it on these small problems (``search/exhaustive.py``); greedy makes no such claim."""
    import random

    rng = random.Random(seed)
    n = 5
    profile = chain(n, fwd=1e-3, bwd=2e-3, out=rng.choice([1000, 10**5, 10**6]), params=rng.choice([10**4, 10**6]),
                    saved=50)
    cl = hosts(4)
    m = 4
    problem = build_problem(profile, cl, microbatches=m, schedule="gpipe", optimizer="sgd")
    exact = brute_force_shape(problem)
    plan = partition(profile, cl, method=method, microbatches=m, schedule="gpipe", optimizer="sgd",
                     data_parallel="auto")
    assert validate_plan(plan, profile, cl) == []
    assert plan.step_time_s >= exact * (1 - 1e-9)
    if method in ("dp", "ilp"):
        assert plan.step_time_s == pytest.approx(exact, rel=1e-9)
        assert plan.extra["exhaustive"]["chosen"] in ("exhaustive", "heuristic")


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(50))
def test_the_default_search_equals_brute_force_on_random_small_problems(seed: int) -> None:
    """Issue 27, "exact on small cases": 4 to 6 devices of up to two types on up to two hosts, sometimes a pair link of
    their own, memory that may bind, chains and graphs with skip connections, gpipe or 1f1b. ``plan partition``'s
    default search (dp, --data-parallel auto) finds the least simulated step over every (degree, ordered groups,
    cuts, shares) that fits, which the brute force above enumerates without any symmetry or bound; and where nothing
    fits, it says so."""
    import random

    from _bruteforce import random_cluster, random_profile

    rng = random.Random(seed)
    devices = rng.choice([4, 5, 6])
    schedule, m = rng.choice(["gpipe", "1f1b"]), 2 if devices == 6 else 4  # 6 devices: fewer shares keep it quick
    cl = random_cluster(seed, devices, mem_range=(150, 600))
    profile = random_profile(seed, num_nodes=5 if devices == 6 else 6)
    problem = build_problem(profile, cl, microbatches=m, schedule=schedule, optimizer="sgd")
    exact = brute_force_shape(problem)
    if exact == float("inf"):
        with pytest.raises(InfeasibleError):
            partition(profile, cl, method="dp", microbatches=m, schedule=schedule, optimizer="sgd", data_parallel="auto")
        return
    plan = partition(profile, cl, method="dp", microbatches=m, schedule=schedule, optimizer="sgd",
                     data_parallel="auto")
    assert plan.step_time_s == pytest.approx(exact, rel=1e-9)
    assert plan.extra["exhaustive"]["complete"]
    assert validate_plan(plan, profile, cl) == []


def test_auto_is_deterministic_and_never_slower_than_the_pure_pipeline_or_any_candidate() -> None:
    cl = hosts(4, 4)
    profile, _ = toy_problem(cl, microbatches=8, n=8)
    kwargs = dict(method="dp", microbatches=8, schedule="1f1b", optimizer="sgd")
    auto = partition(profile, cl, data_parallel="auto", **kwargs)
    again = partition(profile, cl, data_parallel="auto", **kwargs)
    assert auto.to_dict() == again.to_dict()
    pure = partition(profile, cl, data_parallel=1, **kwargs)
    assert auto.step_time_s <= pure.step_time_s * (1 + 1e-9)
    shape = auto.extra["shape"]
    times = [c["step_time_s"] for c in shape["candidates"] if c["step_time_s"] is not None]
    assert auto.step_time_s <= min(times) * (1 + 1e-9)  # the candidates' steps before the cut polish
    assert shape["chosen"]["degree"] == auto.extra.get("data_parallel", {}).get("degree", 1)
    if shape["chosen"]["degree"] > 1:  # a replicated plan is the cut polish's, placed with or without its sync
        assert auto.step_time_s == pytest.approx(auto.extra["cut_polish"]["step_time_s"])
        assert isinstance(shape["chosen"]["sync_in_view"], bool)
        assert auto.extra["solver"]["applies_to"].startswith("the pure pipeline")
    assert validate_plan(auto, profile, cl) == []


def test_when_pure_data_parallel_does_not_fit_auto_picks_a_shape_that_does() -> None:
    profile = chain(8, fwd=1e-3, bwd=2e-3, out=1000, params=10**6, saved=50)
    # sgd: 2 bytes of state per parameter byte; the whole model needs 16 MB, a device holds 9 MB: at least 2 stages.
    cl = hosts(8, memory_bytes=9 * 10**6)
    plan = partition(profile, cl, method="dp", microbatches=8, schedule="1f1b", optimizer="sgd", data_parallel="auto")
    assert validate_plan(plan, profile, cl) == []
    assert len(plan.stages) >= 2
    rejected = [c for c in plan.extra["shape"]["candidates"] if c["degree"] == 8]
    assert rejected and rejected[0]["step_time_s"] is None  # pure data parallel did not fit
    with pytest.raises(InfeasibleError, match="--data-parallel 8"):
        partition(profile, cl, method="dp", microbatches=8, schedule="1f1b", optimizer="sgd", data_parallel=8)


def test_data_parallel_3_on_8_devices_when_no_shape_fits_is_one_line_at_the_cli(tmp_path: Path) -> None:
    """7 MB devices and a 16 MB model: a pipeline needs 3 devices, and 3 replicas leave each only 2 of the 8."""
    profile = chain(8, fwd=1e-3, bwd=2e-3, out=1000, params=10**6, saved=50)
    save_profile(profile, tmp_path / "profile.json")
    (tmp_path / "cluster.json").write_text(json.dumps(hosts(8, memory_bytes=7 * 10**6).to_dict()))
    args = ["partition", str(tmp_path / "profile.json"), "-c", str(tmp_path / "cluster.json"), "--optimizer", "sgd",
            "-o", str(tmp_path / "plan.json")]
    done = CliRunner().invoke(app, [*args, "--data-parallel", "3"])
    assert done.exit_code == 1 and not (tmp_path / "plan.json").exists()
    assert "no shape with --data-parallel 3 fits on the 8 devices" in " ".join(done.output.split())
    assert "Traceback" not in done.output
    assert CliRunner().invoke(app, [*args, "--data-parallel", "auto"]).exit_code == 0  # 2 x 4 devices fits


def test_a_degree_the_cluster_cannot_hold_is_one_line() -> None:
    profile = chain(4, fwd=1e-3, bwd=2e-3, out=1000, params=100, saved=50)
    cl = hosts(4)
    with pytest.raises(InfeasibleError, match="needs at least 5 devices"):
        partition(profile, cl, method="dp", microbatches=8, schedule="gpipe", data_parallel=5)
    with pytest.raises(UsageError, match="'auto' or a positive whole number"):
        partition(profile, cl, method="dp", microbatches=8, schedule="gpipe", data_parallel="two")


# --- bad hybrid plans at the CLI ----------------------------------------------------------------------

@pytest.fixture()
def hybrid_files(tmp_path: Path) -> dict[str, Path]:
    cl = hosts(4)
    profile, _ = toy_problem(cl, microbatches=4, schedule="gpipe")
    save_profile(profile, tmp_path / "profile.json")
    (tmp_path / "cluster.json").write_text(json.dumps(cl.to_dict()))
    plan = partition(profile, cl, method="dp", microbatches=4, schedule="gpipe", optimizer="sgd", data_parallel=2,
                     profile_ref={"path": str(tmp_path / "profile.json")})
    save_plan(plan, tmp_path / "plan.json")
    return {"dir": tmp_path, "plan": tmp_path / "plan.json", "profile": tmp_path / "profile.json",
            "cluster": tmp_path / "cluster.json"}


def _edited(files: dict[str, Path], edit) -> Path:
    doc = json.loads(files["plan"].read_text())
    edit(doc)
    out = files["dir"] / "edited.json"
    out.write_text(json.dumps(doc))
    return out


def _check(files: dict[str, Path], plan: Path):
    return CliRunner().invoke(app, ["check", str(plan), "--profile", str(files["profile"])])


def _overlap(doc: dict) -> None:
    doc["stages"][-1]["replicas"][-1] = doc["stages"][0]["replicas"][0] if len(doc["stages"]) > 1 else \
        doc["stages"][0]["replicas"][0]
    doc["stages"][0]["replicas"][-1] = doc["stages"][0]["replicas"][0]


@pytest.mark.parametrize("edit, words", [
    (_overlap, "serve one replica only"),
    (lambda doc: doc["stages"][0]["replicas"].pop(), "same number of replicas"),
    (lambda doc: doc["data_parallel"].update(microbatches=[3, 3]), "summing to the plan's 4 micro-batches"),
    (lambda doc: doc["data_parallel"].update(microbatches=[5, -1]), "2 positive whole share(s)"),
    (lambda doc: doc["data_parallel"].update(sync="asgd"), "data_parallel.sync' must be one of ssgd"),
    (lambda doc: doc["data_parallel"].update(degree=3), "data_parallel.degree' must be 2"),
])
def test_plan_check_refuses_bad_replicas_in_one_line(hybrid_files, edit, words) -> None:
    assert _check(hybrid_files, hybrid_files["plan"]).exit_code == 0
    done = _check(hybrid_files, _edited(hybrid_files, edit))
    assert done.exit_code != 0
    assert words in " ".join(done.output.split())
    assert "Traceback" not in done.output


@pytest.mark.parametrize("command", [["show"], ["diff"], ["export", "--to", "pipelining"], ["check"]])
def test_every_command_reads_the_parallel_shape_the_same_way(hybrid_files, command) -> None:
    """Issue 23, item 3: what `plan check` passes, `plan run` runs; `show`, `diff` and `export` refuse the same
    edits (shares that sum to 3 of 4, an unknown sync mode, a degree the replicas do not have) in one line."""
    for edit in (lambda doc: doc["data_parallel"].update(microbatches=[2, 1]),
                 lambda doc: doc["data_parallel"].update(sync="asgd"),
                 lambda doc: doc["data_parallel"].update(degree=3)):
        bad = str(_edited(hybrid_files, edit))
        args = [*command, bad, bad] if command == ["diff"] else [*command, bad]
        done = CliRunner().invoke(app, args)
        assert done.exit_code != 0 and "data_parallel" in done.output and "Traceback" not in done.output, done.output
        assert len([line for line in done.output.splitlines() if line.startswith("error")]) == 1, done.output


def test_the_parallel_shape_is_one_value_read_once(hybrid_files) -> None:
    """Issue 23, item 10: degree, shares, sync and the plan's identity come from ``Plan.shape``; plans that differ
    only in their shares have different keys and different rebalancer identities."""
    from planner.formats.plan import DEFAULT_SYNC, ParallelShape, load_plan, plan_from_dict
    from planner.runtime.rebalancing.replan import stage_keys

    plan = load_plan(hybrid_files["plan"])
    shape = plan.shape()
    assert shape.degree == 2 and shape.replicated and shape.sync == DEFAULT_SYNC
    assert shape.shares == plan.replica_shares() and sum(shape.shares) == plan.microbatches
    assert [list(r) for r in shape.replicas] == plan.replicas()
    other = load_plan(_edited(hybrid_files, lambda doc: doc["data_parallel"].update(microbatches=[3, 1])))
    assert other.shape().key() != shape.key() and stage_keys(other) != stage_keys(plan)
    assert "x 2 replicas (data parallel; micro-batches 3/1, ssgd)" in other.shape().describe()
    doc = json.loads(hybrid_files["plan"].read_text())
    doc.pop("data_parallel")
    for stage in doc["stages"]:
        stage.pop("replicas")
    pipeline = plan_from_dict(doc).shape()
    assert pipeline.degree == 1 and not pipeline.replicated and pipeline.shares == (plan.microbatches,)
    assert pipeline.holders() == [s["device"] for s in doc["stages"]] == list(pipeline.key())
    assert pipeline.describe() == pipeline.stages_text() and pipeline.replicas_text() == ""
    assert shape.describe() == f"{shape.stages_text()} x {shape.replicas_text()}"
    resynced = ParallelShape(shape.replicas, shape.shares, "local-sgd")
    assert resynced.key() != shape.key() and resynced.holders() == shape.holders()


def test_a_world_size_that_is_not_degree_times_stages_is_one_line(hybrid_files) -> None:
    from planner.errors import DistributedError
    from planner.runtime.launch.config import RunConfig
    from planner.runtime.launch.prepare import prepare, world_size_of
    from planner.formats.plan import load_plan
    import torch

    plan = load_plan(hybrid_files["plan"])
    need = world_size_of(plan)
    assert need == 2 * len(plan.stages)
    config = RunConfig(plan=str(hybrid_files["plan"]), model="planner.examples.gpt:gpt_tiny", steps=1)
    with pytest.raises(DistributedError, match=f"2 replicas of {len(plan.stages)} stage.* on {need} devices but "
                                               f"{need + 1} ranks were started"):
        prepare(config, need + 1, torch.device("cpu"))


def test_plan_show_draws_replicas_in_the_table_the_timeline_and_the_trace(hybrid_files) -> None:
    out = hybrid_files["dir"] / "shown"
    done = CliRunner().invoke(app, ["show", str(hybrid_files["plan"]), "--trace", str(out) + ".trace.json",
                                    "--timeline", str(out) + ".png", "--svg", str(out) + ".svg"])
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    plan = json.loads(hybrid_files["plan"].read_text())
    assert "x 2 replicas (data parallel; micro-batches 2/2, ssgd)" in text and "sync" in text
    from rich.console import Console

    from planner.formats.plan import load_plan
    from planner.report.table import device_table, stage_table

    console = Console(width=240, record=True)
    loaded = load_plan(hybrid_files["plan"])
    console.print(stage_table(loaded))
    console.print(device_table(loaded))
    wide = console.export_text()
    for devices in (st["replicas"] for st in plan["stages"]):
        assert f"x2: {devices[0]}, {devices[1]}" in wide
    assert all(d in wide for st in plan["stages"] for d in st["replicas"])
    trace = json.loads(Path(str(out) + ".trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    syncs = [e for e in events if e.get("cat") == "sync"]
    replica_devices = {d for st in plan["stages"] for d in st["replicas"]}
    named = {e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert all(any(d in n for n in named) for d in replica_devices)  # every replica's device has a track
    assert len({e["args"]["stage"] for e in syncs}) == len(plan["stages"])
    assert Path(str(out) + ".png").stat().st_size > 0


# --- --schedule auto, --microbatches auto --------------------------------------------------------------

def test_a_rescaled_profile_scales_times_and_activations_but_not_parameters() -> None:
    from planner.partition.search.settings import rescaled

    profile = chain(3, fwd=1e-3, bwd=2e-3, out=1000, params=100, saved=50)
    profile = replace_model(profile, microbatch_size=4)
    double = rescaled(profile, 8)
    assert double.model["microbatch_size"] == 8
    for a, b in zip(profile.nodes, double.nodes):
        assert b.output_bytes == 2 * a.output_bytes and b.saved_bytes == 2 * a.saved_bytes
        assert b.param_bytes == a.param_bytes
        for t in a.time_s:
            assert b.time_s[t].fwd == pytest.approx(2 * a.time_s[t].fwd)


def test_rescaling_keeps_the_fixed_part_the_profile_measured() -> None:
    """A profile whose doubled micro-batch took 1.5x (``fixed_fraction`` 0.5) rescales measured times by
    0.5 + 0.5 k, composes (8 rows then 16 = 16 directly), and keeps each estimated op's launch overhead. On an
    H200 gpt_small's 32-row micro-batch trained in little more than its 8-row one: in proportion, plan train
    predicted 5x the measured step."""
    from dataclasses import replace

    from planner.formats.catalog import load_catalog
    from planner.formats.profile import OpTime
    from planner.partition.search.settings import rescaled

    profile = replace_model(chain(3, fwd=1e-3, bwd=2e-3, types=("cpu", "h100-sxm")), microbatch_size=4)
    profile = replace(profile, nodes=tuple(
        replace(n, time_s={**n.time_s, "h100-sxm": OpTime(n.time_s["h100-sxm"].fwd, n.time_s["h100-sxm"].bwd,
                                                          "estimated")}) for n in profile.nodes),
        extra={**profile.extra, "whole_model": {"train_s": 9e-3, "rows_scaling": {
            "rows": [4, 8], "train_s": [9e-3, 13.5e-3], "fixed_fraction": 0.5}}})
    catalog = load_catalog()
    launch = catalog["h100-sxm"].launch_overhead_s
    for rows in (2, 8, 16):
        k = rows / 4
        again = rescaled(profile, rows, catalog)
        assert again.extra["whole_model"]["train_s"] == pytest.approx(9e-3 * (0.5 + 0.5 * k))
        for a, b in zip(profile.nodes[1:], again.nodes[1:]):
            assert b.time_s["cpu"].fwd == pytest.approx(a.time_s["cpu"].fwd * (0.5 + 0.5 * k))
            assert b.time_s["h100-sxm"].bwd == pytest.approx(launch + (a.time_s["h100-sxm"].bwd - launch) * k)
    twice = rescaled(rescaled(profile, 8, catalog), 16, catalog)
    direct = rescaled(profile, 16, catalog)
    assert [n.time_s["cpu"].bwd for n in twice.nodes] == pytest.approx([n.time_s["cpu"].bwd for n in direct.nodes])
    assert twice.extra["whole_model"]["rows_scaling"]["fixed_fraction"] == pytest.approx(0.5 / 2.5)


def test_a_gpu_micro_batch_takes_the_longer_of_its_launches_and_the_roofline_work() -> None:
    """On a GPU the host issues kernels while earlier ones run: gpt_small's 8-row micro-batch on an H200 took no
    longer than its 4-row one (f = 1), so rows cost nothing until the roofline's work for them is the longer.
    A CPU profile with the same numbers adds the parts."""
    from dataclasses import replace

    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile
    from planner.partition.search.settings import time_growth
    from planner.roofline import growing_time_s

    profile = load_profile(Path(__file__).resolve().parents[1] / "profiles" / "h200" / "gpt_small.json")
    whole = profile.extra["whole_model"]
    f = whole["rows_scaling"]["fixed_fraction"]
    catalog = load_catalog()
    share = growing_time_s(profile.nodes, "h200", catalog) / whole["train_s"]
    assert f == 1.0 and 0 < share < 0.5
    for k in (0.5, 2, 8, 64):
        assert time_growth(profile, k, catalog) == pytest.approx(max(f + (1 - f) * k, share * k))
    assert share * 64 > 1  # the device's work takes over
    assert time_growth(profile, 64, catalog) == pytest.approx(share * 64)
    on_cpu = replace(profile, extra={**profile.extra, "measurement": {**profile.extra["measurement"],
                                                                      "clock": "thread_cpu"}})
    assert time_growth(on_cpu, 64, catalog) == pytest.approx(f + (1 - f) * 64)


def test_rescaling_keeps_the_calibration_and_colocation_factors_of_the_measurement() -> None:
    """The whole-model measurement scales with the rows too: the calibration factor (training over the sum of the
    ops) stays what was measured. Before, only the ops scaled, so a plan for twice the rows predicted its compute
    at about half (plan train's first run: 0.82 s predicted, 1.67 s measured)."""
    from planner.clusters import load_cluster_spec
    from planner.formats.profile import load_profile
    from planner.partition.model.times import calibration_factors
    from planner.partition.search.settings import rescaled

    from dataclasses import replace

    profile = load_profile(Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json")
    ops = sum(t.fwd + t.bwd for n in profile.nodes for t in n.time_s.values() if t.source == "measured")
    whole = {**profile.extra["whole_model"], "train_s": 1.1 * ops,
             "colocation": {"ranks": 2, "train_s": 1.3 * ops, "factor": 1.3 / 1.1}}
    profile = replace(profile, extra={**profile.extra, "whole_model": whole})
    cluster = load_cluster_spec("cpu-2")
    assert calibration_factors(profile, cluster)["cpu"] == pytest.approx(1.3)
    # the lone and loaded timings of a MEASUREMENT_VERSION 6 profile scale with the rows too
    timed = {**whole["colocation"], "alone_s": [1.0 * ops, 1.2 * ops], "loaded_s": [1.25 * ops, 1.3 * ops, 1.4 * ops]}
    six = replace(profile, extra={**profile.extra, "whole_model": {**whole, "colocation": timed}})
    assert calibration_factors(six)["cpu"] == pytest.approx(1.1)
    assert calibration_factors(six, cluster)["cpu"] == pytest.approx(1.3)
    for rows in (1, 4, 16):
        for measured in (profile, six):
            assert calibration_factors(rescaled(measured, rows), cluster) == pytest.approx(
                calibration_factors(measured, cluster))
            assert calibration_factors(rescaled(measured, rows)) == pytest.approx(calibration_factors(measured))


def test_the_run_time_model_predicts_a_plan_made_for_other_rows_as_the_planner_did(tmp_path: Path) -> None:
    """plan run's cost model (rebalancing, calibration, --sync and --emulate-link re-predictions) prices the rows
    the plan was made for (--microbatches auto), not the profile's."""
    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile
    from planner.runtime.rebalancing.replan import RoundModel

    path = Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json"
    profile, cluster = load_profile(path), load_cluster_spec("cpu-2")
    plan = plan_auto(path, cluster, tmp_path)
    rows = plan.extra["microbatch_size"]
    assert rows != profile.model["microbatch_size"]
    model = RoundModel.build(profile, cluster, plan, rows, load_catalog())
    assert model.step_time_s(plan, {}) == pytest.approx(plan.step_time_s, rel=1e-6)


@pytest.mark.slow  # cpu-2: about 5 s, a100-4: about 8 s
@pytest.mark.parametrize("cluster", ["cpu-2", "a100-4"])
def test_refining_the_finalists_finds_the_plan_refining_every_candidate_finds(cluster: str) -> None:
    """--refine with --schedule/--microbatches auto plans every candidate quickly and refines the fastest few
    (settings.FINALISTS); on these cases that is the plan refining all of them gives, at a fraction of the time."""
    import functools

    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile
    from planner.partition.search.settings import choose

    path = Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json"
    profile, spec = load_profile(path), load_cluster_spec(cluster)

    def plan(source, count, schedule, refine):  # noqa: ANN001, ANN202
        return partition(source, spec, method="greedy", microbatches=count, schedule=schedule, refine=refine,
                         catalog=load_catalog(), data_parallel=1 if schedule in ("async-1f1b", "2bw") else "auto")

    everything = choose(profile, "auto", None, 16, functools.partial(plan, refine=True))
    finalists = choose(profile, "auto", None, 16, functools.partial(plan, refine=False),
                       functools.partial(plan, refine=True))
    assert finalists.step_time_s == pytest.approx(everything.step_time_s, rel=1e-9)
    assert sum(1 for c in finalists.extra["choices"]["candidates"] if c.get("refined")) <= 3


def plan_auto(path: Path, cluster: Cluster, tmp_path: Path):  # noqa: ANN201
    from planner.app.partition import partition_file

    return partition_file(path, "cpu-2", tmp_path / "plan.json", method="greedy", microbatches="auto",
                          schedule="1f1b", global_batch=32, data_parallel=1)


def replace_model(profile, **model):
    from dataclasses import replace

    return replace(profile, model={**profile.model, **model})


def test_auto_settings_pick_the_fastest_candidate_and_record_every_one(tmp_path: Path) -> None:
    cl = hosts(4)
    profile = replace_model(chain(6, fwd=1e-3, bwd=2e-3, out=1000, params=10**5, saved=50), microbatch_size=2)
    save_profile(profile, tmp_path / "profile.json")
    (tmp_path / "cluster.json").write_text(json.dumps(cl.to_dict()))
    run = CliRunner().invoke
    done = run(app, ["partition", str(tmp_path / "profile.json"), "-c", str(tmp_path / "cluster.json"), "-s", "auto",
                     "-n", "auto", "--global-batch", "16", "-o", str(tmp_path / "auto.json"), "--json"])
    assert done.exit_code == 0, done.output
    plan = json.loads((tmp_path / "auto.json").read_text())
    choices = plan["choices"]
    times = [c["step_time_s"] for c in choices["candidates"] if c["step_time_s"] is not None]
    assert plan["predicted"]["step_time_s"] == pytest.approx(min(times))
    assert {c["schedule"] for c in choices["candidates"]} == set(SCHEDULES)
    assert {c["microbatches"] for c in choices["candidates"]} == {1, 2, 4, 8, 16}
    assert plan["microbatch_size"] * plan["microbatches"] == 16
    assert run(app, ["check", str(tmp_path / "auto.json")]).exit_code == 0  # memory rechecked on rescaled rows
    for fixed in ("gpipe", "1f1b"):
        other = run(app, ["partition", str(tmp_path / "profile.json"), "-c", str(tmp_path / "cluster.json"), "-s", fixed,
                          "-n", str(plan["microbatches"]), "--json"])
        assert other.exit_code == 0
    bad = run(app, ["partition", str(tmp_path / "profile.json"), "-c", str(tmp_path / "cluster.json"), "-n", "auto"])
    assert bad.exit_code == 2 and "needs --global-batch" in bad.output
    bad = run(app, ["partition", str(tmp_path / "profile.json"), "-c", str(tmp_path / "cluster.json"), "-n", "8",
                    "--global-batch", "16"])
    assert bad.exit_code == 2 and "goes with --microbatches auto" in bad.output
    # issue 23, item 5: a global batch too small for the degree was told to pass --microbatches 4
    bad = run(app, ["partition", str(tmp_path / "profile.json"), "-c", str(tmp_path / "cluster.json"), "-n", "auto",
                    "--global-batch", "3", "-d", "4", "-o", str(tmp_path / "none.json")])
    assert bad.exit_code == 2 and "--global-batch 3 splits into at most 3" in bad.output, bad.output
    assert "--microbatches" not in bad.output and not (tmp_path / "none.json").exists()


# --- export -----------------------------------------------------------------------------------------------

def test_a_hybrid_plan_exports_its_replica_degree_and_refuses_uneven_shares_for_torchtitan(tmp_path: Path) -> None:
    from planner.app.export import export_file
    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile

    golden = Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json"
    plan = partition(load_profile(golden), load_cluster_spec("dgx-h100-8"), method="dp", microbatches=8,
                     schedule="gpipe", granularity="layer", data_parallel=2, catalog=load_catalog(),
                     profile_ref={"path": str(golden)})
    save_plan(plan, tmp_path / "plan.json")
    degree, stages = len(plan.replicas()[0]), len(plan.stages)
    assert degree == 2
    table = export_file(tmp_path / "plan.json", "torchtitan").data
    assert table["parallelism"]["data_parallel_replicate_degree"] == 2
    assert table["parallelism"]["pipeline_parallel_degree"] == stages
    assert table["device_order"] == [plan.replicas()[s][r] for s in range(stages) for r in range(2)]  # pp outermost
    csv = export_file(tmp_path / "plan.json", "schedule-csv").data
    assert len(csv["rows"]) == 2 * stages and csv["device_order"][:stages] == [s.device for s in plan.stages]
    doc = json.loads((tmp_path / "plan.json").read_text())
    doc["data_parallel"]["microbatches"] = [6, 2]
    (tmp_path / "uneven.json").write_text(json.dumps(doc))
    with pytest.raises(Exception, match="uneven micro-batch shares \\[6, 2\\]") as refused:
        export_file(tmp_path / "uneven.json", "torchtitan")
    assert "one device type" in str(refused.value)


def test_export_advice_on_shares_that_do_not_divide(tmp_path) -> None:
    """Issue 23, item 5: 8 micro-batches over 3 replicas of one GPU type were told to use 'a cluster of one GPU
    type'; the advice is a micro-batch count the degree divides."""
    from planner.app.export import export_file
    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile

    golden = Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json"
    plan = partition(load_profile(golden), load_cluster_spec("a100-4"), method="dp", microbatches=8,
                     schedule="gpipe", granularity="layer", data_parallel=3, catalog=load_catalog(),
                     profile_ref={"path": str(golden)})
    save_plan(plan, tmp_path / "plan.json")
    assert sorted(plan.replica_shares()) == [2, 3, 3]
    with pytest.raises(Exception, match=r"a micro-batch count that 3 divides \(-n 9 or -n 6\)"):
        export_file(tmp_path / "plan.json", "torchtitan")


def test_plan_diff_and_check_see_the_parallel_shape(hybrid_files) -> None:
    """Issue 23, item 2: two plans that differ only in their replicas' shares or devices were 'identical' to
    `plan diff`, and `plan check` noted nothing when the degree changed."""
    shares = _edited(hybrid_files, lambda doc: doc["data_parallel"].update(microbatches=[3, 1]))
    done = CliRunner().invoke(app, ["diff", str(hybrid_files["plan"]), str(shares)])
    assert done.exit_code == 0 and "replica shares: [2, 2] -> [3, 1]" in done.output, done.output
    assert "identically" not in done.output

    def swap(doc: dict) -> None:
        for stage in doc["stages"]:
            stage["replicas"].reverse()
            stage["device"] = stage["replicas"][0]

    swapped = CliRunner().invoke(app, ["diff", str(hybrid_files["plan"]), str(_edited(hybrid_files, swap))])
    assert swapped.exit_code == 0 and "identically" not in swapped.output, swapped.output

    cl = json.loads(hybrid_files["cluster"].read_text())
    from planner.formats.cluster import cluster_from_dict
    from planner.formats.profile import load_profile

    pure = partition(load_profile(hybrid_files["profile"]), cluster_from_dict(cl, "cluster"), method="dp",
                     microbatches=4, schedule="gpipe", optimizer="sgd", data_parallel=1,
                     profile_ref={"path": str(hybrid_files["profile"])})
    save_plan(pure, hybrid_files["dir"] / "pure.json")
    checked = CliRunner().invoke(app, ["check", str(hybrid_files["plan"]), "--baseline", str(hybrid_files["dir"] / "pure.json"),
                                       "--profile", str(hybrid_files["profile"]), "--tolerance", "1000%"])
    assert "data-parallel degree differs from the baseline: 1 -> 2" in " ".join(checked.output.split()), checked.output


def test_a_resume_under_other_shares_says_the_plan_changed(hybrid_files) -> None:
    """Issue 23, item 10: the resume's plan identity ignored replicas and shares, so a checkpoint made under
    2/2 read as 'unchanged' when resumed under 3/1. It is now the rebalancer's identity (stage_keys)."""
    from planner.formats.plan import load_plan
    from planner.runtime.launch.resume import check_resume

    plan = load_plan(hybrid_files["plan"])
    sealed = hybrid_files["dir"] / "ckpt" / "step_00000002"
    sealed.mkdir(parents=True)
    identity = {"model": "m", "plan": "recorded"}
    (sealed / "meta.json").write_text(json.dumps({"schema_version": 1, "step": 2, "world_size": 4,
                                                  "plan": plan.to_dict(), "extra": {"run": identity}}))
    same = check_resume(str(hybrid_files["dir"] / "ckpt"), 4, identity, plan, "plan.json")
    assert same is not None and not same.plan_changed
    other = load_plan(_edited(hybrid_files, lambda doc: doc["data_parallel"].update(microbatches=[3, 1])))
    changed = check_resume(str(hybrid_files["dir"] / "ckpt"), 4, identity, other, "edited.json")
    assert changed is not None and changed.plan_changed


def test_large_clusters_try_only_the_degrees_that_divide_their_devices() -> None:
    from planner.partition.search.hybrid import EVERY_DEGREE_UP_TO, candidate_degrees

    assert candidate_degrees(12, 12, None) == list(range(2, 13))  # small: every degree
    assert candidate_degrees(64, 64, None) == [2, 4, 8, 16, 32, 64]
    assert candidate_degrees(64, 8, None) == [2, 4, 8]  # a micro-batch per replica still bounds it
    assert candidate_degrees(64, 64, 3) == [3]  # a degree asked for is tried whatever it divides
    assert EVERY_DEGREE_UP_TO >= 16  # the bench-hybrid clusters (up to 16 devices) keep the full search


def test_devices_are_of_one_kind_when_swapping_them_maps_the_cluster_onto_itself() -> None:
    """The exact search's symmetry (``exhaustive.device_kinds``): on mixed-3type-2host every pair of host B is linked
    by the same PCIe 3 link, so its two V100s (and its two L4s) can trade places; a pair link that only one device
    has tells it apart."""
    from dataclasses import replace

    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.partition.search.exhaustive import device_kinds

    cl = load_cluster_spec("mixed-3type-2host")
    problem = build_problem(chain(4), cl, microbatches=4, schedule="1f1b", catalog=load_catalog())
    kinds = device_kinds(problem)
    assert kinds["b-v100-0"] == kinds["b-v100-1"] != kinds["b-l4-0"] == kinds["b-l4-1"]
    assert kinds["a-h100-0"] == kinds["a-h100-1"] and len(set(kinds.values())) == 4
    odd = replace(cl, pairs={**cl.pairs, ("a-a100-0", "a-h100-0"): SLOW})  # keys are sorted pairs
    kinds = device_kinds(build_problem(chain(4), odd, microbatches=4, schedule="1f1b", catalog=load_catalog()))
    assert kinds["a-h100-0"] != kinds["a-h100-1"] and kinds["a-a100-0"] != kinds["a-a100-1"]


def test_a_tie_in_the_last_bits_goes_to_the_earlier_candidate() -> None:
    """plan train's main job once chose async-1f1b over gpipe for one stage x 2 replicas: the same plan through the
    asynchronous simulator came out one ulp faster, and the tie rule (earlier schedule wins) did not apply."""
    from types import SimpleNamespace

    from planner.partition.search.settings import _ranked

    step = 0.7583297030344728
    plans = {0: (None, SimpleNamespace(step_time_s=step)), 1: (None, SimpleNamespace(step_time_s=0.9)),
             2: (None, SimpleNamespace(step_time_s=step * (1 - 1e-15))), 3: (None, SimpleNamespace(step_time_s=0.5))}
    assert _ranked(plans) == [3, 2, 0, 1]  # ties matter at the top: that is the choice
    plans[3] = (None, SimpleNamespace(step_time_s=1.0))
    assert _ranked(plans)[:2] == [0, 2]


@pytest.mark.slow  # about 6 s
def test_groupings_by_device_class_counts_find_the_cross_host_pairs_the_dealings_miss() -> None:
    """Issue 27, Metis's per-type counts: on mixed-3type-2host at m = 16, resnet_small is fastest as 4 replicas of 2
    devices that pair one fast and one slow class across the hosts ([H100, L4] and [A100, V100]), a grouping neither
    dealing makes (both keep a pipeline's devices of one kind or one host): 2.861 ms against 3.183 ms with greedy,
    2.907 against 3.160 with dp. The screened groupings the placer tried are recorded with their counts; the
    enumeration covers every multiset of per-class compositions."""
    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile
    from planner.partition.search.groups import _count_groupings

    profile = load_profile(Path(__file__).parent / "golden" / "profiles" / "resnet_small.json")
    cluster = load_cluster_spec("mixed-3type-2host")
    for method in ("greedy", "dp"):
        plan = partition(profile, cluster, method=method, microbatches=16, schedule="1f1b", data_parallel="auto",
                         catalog=load_catalog())
        shape = plan.extra["shape"]
        chosen = shape["chosen"]
        assert chosen["grouping"] == "class-counts" and chosen["degree"] == 4
        assert sorted(map(tuple, chosen["counts"])) == [(0, 1, 1, 0), (0, 1, 1, 0), (1, 0, 0, 1), (1, 0, 0, 1)]
        dealt = [c["step_time_s"] for c in shape["candidates"] if c["grouping"] != "class-counts" and c["step_time_s"]]
        assert plan.step_time_s < 0.95 * min(dealt)
        types = {d.id: d.type for d in cluster.devices}
        pairs = {tuple(sorted(types[x] for x in replica)) for replica in zip(*plan.shape().replicas)}
        assert pairs == {("h100-sxm", "l4"), ("a100-80g", "v100-32g")}
        assert validate_plan(plan, profile, cluster, catalog=load_catalog()) == []
    # 2 classes of 2 into 2 pipelines of 2: {[2,0],[0,2]} and {[1,1],[1,1]}; into 4 of 1: one way
    assert sorted(_count_groupings((2, 2), 2, 2)) == [((0, 2), (2, 0)), ((1, 1), (1, 1))]
    assert _count_groupings((2, 2), 4, 1) == [((0, 1), (0, 1), (1, 0), (1, 0))]
    assert len(_count_groupings((2, 2, 2, 2), 2, 4)) == 10


@pytest.mark.parametrize("counts,grouping", [((4,), "pipeline-local"), ((2, 2), "pipeline-local"),
                                             ((2, 2), "stage-local")])
def test_one_replica_pipeline_with_its_sync_in_view_simulates_as_the_whole_plan(counts, grouping) -> None:
    """What the placer sees with the sync in view (``hybrid._sub_problem``: each device's all-reduce with its
    replicas, ``Problem.replica_sync``) is the whole plan's step: on identical pipelines with even shares, each
    stage's sync and the simulated step of one replica equal the replicated plan's, within a host and across."""
    from planner.partition.model.objective import step_time_formula_s, sync_tail_s
    from planner.partition.search.hybrid import _sub_problem

    cl = hosts(*counts)
    _, problem = toy_problem(cl, microbatches=4, schedule="1f1b")
    pipelines = pipelines_of(list(cl.device_ids), 2, grouping)
    sub = _sub_problem(problem, pipelines, 0, 2, sync_in_view=True)
    blind = _sub_problem(problem, pipelines, 0, 2)
    assert set(sub.replica_sync) == set(pipelines[0]) and not blind.replica_sync
    one = (StageSpec(0, 3, pipelines[0][0]), StageSpec(3, 7, pipelines[0][1]))
    whole = Placed(tuple(StageSpec(st.start, st.stop, st.device, tuple(p[i] for p in pipelines))
                         for i, st in enumerate(one)), shares=[2, 2])
    for mine, theirs in zip(one, whole):
        assert stage_sync_s(problem, theirs) > 0
        assert stage_sync_s(sub, mine) == pytest.approx(stage_sync_s(problem, theirs), rel=1e-9)
    assert step_time_s(sub, one) == pytest.approx(step_time_s(problem, whole), rel=1e-9)
    assert step_time_s(blind, one) < step_time_s(sub, one)
    # the formula charges the first stage's sync whole: no backward runs after it
    assert sync_tail_s(sub, one[0].device, 0, 3) == pytest.approx(stage_sync_s(sub, one[0]))
    assert step_time_formula_s(sub, one) > step_time_formula_s(blind, one)
