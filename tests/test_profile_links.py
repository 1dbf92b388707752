"""Link probing: the least-squares fit, the cluster built from fits, shared NICs from concurrent streams, a real
2-rank gloo probe and one over two emulated hosts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.errors import DistributedError, InputFileError
from planner.formats.cluster import load_cluster
from planner.runtime.links import (ConcurrentStreams, PairFit, build_cluster, fit_latency_bandwidth, nics_from_streams,
                                   world_from_env)

REPO = Path(__file__).resolve().parents[1]


def test_fit_recovers_an_exact_line():
    samples = [(n, 20e-6 + n / 5e9) for n in (1024, 65536, 1 << 20, 1 << 24)]
    bandwidth, latency = fit_latency_bandwidth(samples)
    assert bandwidth == pytest.approx(5e9) and latency == pytest.approx(20e-6)


def test_fit_clamps_noise():
    bandwidth, latency = fit_latency_bandwidth([(1000, 3e-5), (2000, 2e-5)])  # falling: no positive slope
    assert bandwidth == pytest.approx(2000 / 2e-5) and latency == pytest.approx(2e-5)
    with pytest.raises(ValueError):
        fit_latency_bandwidth([(1000, 1e-5)])


def info(rank: int, host: str) -> dict:
    return {"rank": rank, "host": host, "type": "cpu", "memory_bytes": 2**30}


def fit(a: int, b: int, bandwidth: float, latency: float) -> PairFit:
    return PairFit(a, b, bandwidth, latency, ((1024, latency + 1024 / bandwidth), (2048, latency + 2048 / bandwidth)))


def test_cluster_from_pairs_on_two_hosts():
    infos = [info(0, "h0"), info(1, "h0"), info(2, "h1")]
    fits = [fit(0, 1, 10e9, 5e-6), fit(0, 2, 1e9, 50e-6), fit(1, 2, 2e9, 30e-6)]
    cluster = build_cluster("t", infos, fits)
    assert [d.id for d in cluster.devices] == ["rank0", "rank1", "rank2"]
    assert cluster.intra_host.bandwidth_Bps == 10e9 and "measured" in cluster.intra_host.source
    assert cluster.inter_host.bandwidth_Bps == pytest.approx(1.5e9) and cluster.inter_host.latency_s == pytest.approx(40e-6)
    assert cluster.link("rank0", "rank2").bandwidth_Bps == 1e9  # the measured pair wins over the median
    assert len(cluster.extra["probe_samples"]) == 3


def test_cpu_ranks_copy_their_own_bytes_gpus_do_not():
    cpus = build_cluster("t", [info(0, "h"), info(1, "h")], [fit(0, 1, 3e9, 40e-6)])
    assert cpus.intra_host.host_copy and cpus.inter_host.host_copy and cpus.link("rank0", "rank1").host_copy
    gpus = build_cluster("t", [{**info(0, "h"), "type": "h100-sxm"}, {**info(1, "h"), "type": "h100-sxm"}],
                         [fit(0, 1, 3e11, 5e-6)])
    assert not gpus.intra_host.host_copy and not gpus.link("rank0", "rank1").host_copy


def test_pass_overhead_is_what_makes_the_simulator_match_the_measured_step():
    from planner.formats.cluster import Link
    from planner.runtime.probe import TinyRun, fit_pass_overhead

    link = Link(4e9, 50e-6, host_copy=True)
    base = TinyRun(step_s=0.0, compute_s=(0.0016, 0.0016), message_bytes=256)
    assert fit_pass_overhead(base, link) == 0.0  # measured no slower than simulated: nothing to add
    # a run measured exactly as the simulator predicts with 0.2 ms per pass is fitted back to 0.2 ms
    from planner.formats.cluster import Cluster, Device
    from planner.partition.sim.simulate import SimStage, simulate

    stages = [SimStage("a", 1e-4, 1e-4, 256, 0, 0, 0), SimStage("b", 1e-4, 1e-4, 0, 256, 0, 0)]
    cluster = Cluster("p", (Device("a", "x", "h", 1), Device("b", "x", "h", 1)), link, link, pass_overhead_s=2e-4)
    measured = simulate(stages, cluster, "1f1b", 8, record_events=False).step_time_s
    fitted = fit_pass_overhead(TinyRun(measured, (1e-4 * 16, 1e-4 * 16), 256), link)
    assert fitted == pytest.approx(2e-4, rel=1e-6)


def test_pass_overhead_counts_what_the_runtime_spends_inside_its_passes():
    """The bug this guards: fed the compute the ranks timed inside the runtime's pass methods, the probe left the
    runtime's cost inside them out of the per-pass figure, while the cost model's compute (profiled ops) holds
    none of it either. Fed each stage's pass timed alone, the fitted figure holds it, and the inner part is
    reported apart (what calibration adds to the cost model's compute)."""
    from planner.formats.cluster import Cluster, Device, Link
    from planner.partition.sim.simulate import SimStage, simulate
    from planner.runtime.probe import TinyRun, fit_pass_overhead, inner_overhead

    link = Link(4e9, 50e-6, host_copy=True)
    alone, inside, outside = 3e-5, 1.5e-4, 1e-4  # per pass: the stage alone, within the runtime's methods, beyond them
    stages = [SimStage("a", alone, alone, 256, 0, 0, 0), SimStage("b", alone, alone, 0, 256, 0, 0)]
    cluster = Cluster("p", (Device("a", "x", "h", 1), Device("b", "x", "h", 1)), link, link,
                      pass_overhead_s=inside - alone + outside)
    measured = simulate(stages, cluster, "1f1b", 8, record_events=False).step_time_s
    timed = (inside * 16, inside * 16)  # 8 micro-batches: 16 passes a step
    run = TinyRun(measured, timed, 256, (2 * alone, 2 * alone))
    assert fit_pass_overhead(run, link) == pytest.approx(inside - alone + outside, rel=1e-6)
    assert inner_overhead(run) == pytest.approx(inside - alone)
    assert fit_pass_overhead(TinyRun(measured, timed, 256), link) < outside  # the old way: the inner part lost
    assert inner_overhead(TinyRun(measured, timed, 256)) == 0.0  # nothing timed alone, nothing to tell apart


def test_byte_overhead_is_what_makes_the_simulator_match_a_large_message_step():
    from planner.formats.cluster import Cluster, Device, Link
    from planner.partition.sim.simulate import SimStage, simulate
    from planner.runtime.probe import TinyRun, fit_byte_overhead

    link, mib = Link(5e9, 50e-6, host_copy=True), 1 << 20
    stages = [SimStage("a", 1e-3, 1e-3, mib, 0, 0, 0), SimStage("b", 1e-3, 1e-3, 0, mib, 0, 0)]
    cluster = Cluster("p", (Device("a", "x", "h", 1), Device("b", "x", "h", 1)), link, link, pass_overhead_s=1e-4,
                      pass_byte_overhead_s=3e-10)
    measured = simulate(stages, cluster, "1f1b", 8, record_events=False).step_time_s
    run = TinyRun(measured, (1e-3 * 16, 1e-3 * 16), mib)
    assert fit_byte_overhead(run, link, 1e-4) == pytest.approx(3e-10, rel=1e-6)
    # the per-pass overhead is fixed first: a larger one leaves less for the bytes to explain
    assert fit_byte_overhead(run, link, 2e-4) < 3e-10
    assert fit_byte_overhead(TinyRun(measured, (1e-3 * 16, 1e-3 * 16), 0), link, 1e-4) == 0.0  # no bytes, no figure


def test_schedule_runtime_overhead_is_what_makes_the_simulated_zb_h1_step_match_and_only_its_schedules_pay_it():
    from planner.formats.cluster import Cluster, Device, Link
    from planner.partition.sim.simulate import SimStage, simulate
    from planner.runtime.probe import ZERO_BUBBLE_PROBE, TinyRun, fit_schedule_runtime_overhead

    link = Link(5e9, 50e-6, host_copy=True)
    stages = [SimStage("a", 1e-4, 1e-4, 256, 0, 0, 0, bwd_weight_s=5e-5),
              SimStage("b", 1e-4, 1e-4, 0, 256, 0, 0, bwd_weight_s=5e-5)]
    devices = (Device("a", "x", "h", 1), Device("b", "x", "h", 1))
    cluster = Cluster("p", devices, link, link, pass_overhead_s=1e-4, schedule_runtime_pass_overhead_s=3e-4)
    measured = simulate(stages, cluster, ZERO_BUBBLE_PROBE, 8, record_events=False).step_time_s
    run = TinyRun(measured, (1e-4 * 16, 1e-4 * 16), 256, (2e-4, 2e-4))  # lone F + B: each pass 1e-4
    assert fit_schedule_runtime_overhead(run, link, 0.0) == pytest.approx(3e-4, rel=1e-6)
    # every F, I and W of a zero-bubble schedule pays torch's schedule runtime's figure; 1F1B's passes their own
    for schedule, per_pass, passes in (("zb-h1", 3e-4, 3), ("zb-h2", 3e-4, 3), ("1f1b", 1e-4, 2)):
        result = simulate(stages, cluster, schedule, 8, record_events=False)
        assert result.devices["a"].overhead_s == pytest.approx(passes * 8 * per_pass)
    # a file that does not give it: zero-bubble passes cost what every pass costs, as before it was probed
    assert Cluster("p", devices, link, link, pass_overhead_s=1e-4).pass_overhead_for("zb-h1") == 1e-4


def test_runtime_overhead_round_trips_through_the_cluster_file():
    import dataclasses

    from planner.formats.cluster import cluster_from_dict
    from planner.runtime.probe import RuntimeProbe

    probe = RuntimeProbe(1e-4, 3e-10, 4e-5, 1.5e-4)  # what probe_links adds to the built cluster
    cluster = dataclasses.replace(build_cluster("t", [info(0, "h"), info(1, "h")], [fit(0, 1, 3e9, 40e-6)]),
                                  pass_overhead_s=probe.pass_overhead_s, pass_overhead_source=probe.source,
                                  pass_byte_overhead_s=probe.pass_byte_overhead_s,
                                  pass_compute_overhead_s=probe.pass_compute_overhead_s,
                                  schedule_runtime_pass_overhead_s=probe.schedule_runtime_pass_overhead_s)
    assert "8 micro-batches" in probe.source and "1 MiB and 4 MiB" in probe.source
    assert "timed alone" in probe.source and "pass_compute_overhead_s" in probe.source
    assert cluster.to_dict()["runtime"]["pass_overhead_s"] == 1e-4 and cluster.pass_overhead_source
    assert cluster.to_dict()["runtime"]["pass_byte_overhead_s"] == 3e-10
    assert cluster.to_dict()["runtime"]["pass_compute_overhead_s"] == 4e-5
    assert cluster.to_dict()["runtime"]["schedule_runtime_pass_overhead_s"] == 1.5e-4 and "zb-h1" in probe.source
    assert cluster.pass_overhead_for("zbv") == cluster.pass_overhead_for("interleaved-1f1b") == 1.5e-4  # torch's
    assert cluster.pass_overhead_for("1f1b") == cluster.pass_overhead_for("async-1f1b") == 1e-4  # schedule runtime
    assert cluster_from_dict(cluster.to_dict()) == cluster
    broken = cluster.to_dict()
    broken["runtime"]["pass_compute_overhead_s"] = 2e-4  # more than the whole it is a part of
    with pytest.raises(InputFileError, match="pass_compute_overhead_s.*at most runtime.pass_overhead_s"):
        cluster_from_dict(broken)
    broken = cluster.to_dict()
    broken["runtime"]["schedule_runtime_pass_overhead_s"] = -1e-4
    with pytest.raises(InputFileError, match="schedule_runtime_pass_overhead_s"):
        cluster_from_dict(broken)
    assert "runtime" not in build_cluster("t", [info(0, "h"), info(1, "h")], [fit(0, 1, 3e9, 40e-6)]).to_dict()


def test_streams_that_slow_each_other_name_the_nics_they_shared():
    assert nics_from_streams(4, 1.0, 4.0) == 1  # four streams, each 4x slower: one interface between them
    assert nics_from_streams(4, 1.0, 2.1) == 2
    assert nics_from_streams(4, 1.0, 1.05) == 0  # no slowdown: an interface each (the file leaves it absent)
    assert nics_from_streams(2, 1.0, 0.5) == 0  # faster together than alone (noise): not a shared interface
    with pytest.raises(ValueError):
        nics_from_streams(1, 1.0, 1.0)


def test_two_hosts_of_two_ranks_record_their_shared_nic():
    infos = [info(0, "h0"), info(1, "h0"), info(2, "h1"), info(3, "h1")]
    size = 1 << 24
    fits = [PairFit(a, b, bw, 5e-6, ((1024, 5e-6 + 1024 / bw), (size, 5e-6 + size / bw)))
            for a in range(4) for b in range(a + 1, 4) for bw in [10e9 if (a < 2) == (b < 2) else 1e9]]
    fits[1] = PairFit(0, 2, 1e9, 5e-6, ((1024, 5e-6 + 1024 / 1e9), (size, 0.02)))  # the sweep's own time counts
    alone = (0.02 + 5e-6 + size / 1e9) / 2  # median over the two streaming pairs (0, 2) and (1, 3)
    shared = build_cluster("t", infos, fits, ConcurrentStreams(((0, 2), (1, 3)), size, 2 * alone))
    assert shared.nics_per_host == 1
    assert shared.extra["probe_streams"]["pairs"] == [["rank0", "rank2"], ["rank1", "rank3"]]
    assert shared.extra["probe_streams"]["alone_s"] == pytest.approx(alone)
    own = build_cluster("t", infos, fits, ConcurrentStreams(((0, 2), (1, 3)), size, alone))
    assert own.nics_per_host == 0 and build_cluster("t", infos, fits).nics_per_host == 0


def test_single_host_marks_inter_host_as_assumed():
    cluster = build_cluster("t", [info(0, "h"), info(1, "h")], [fit(0, 1, 3e9, 40e-6)])
    assert cluster.inter_host.source.startswith("assumed")
    assert cluster.inter_host.bandwidth_Bps <= cluster.intra_host.bandwidth_Bps


def test_one_rank_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(DistributedError, match="at least 2 ranks.*torchrun"):
        world_from_env()


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_gloo_ranks_write_a_valid_cluster(tmp_path):
    out = tmp_path / "cluster.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", "localhost:0", "--no-python", sys.executable, "-c",
           "from planner.cli import main; main()", "profile", "--probe-links", "-o", str(out)]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cluster = load_cluster(out)
    assert [d.id for d in cluster.devices] == ["rank0", "rank1"]
    assert all(d.type == "cpu" and d.memory_bytes > 0 for d in cluster.devices)
    pair = cluster.pairs[("rank0", "rank1")]
    assert pair.bandwidth_Bps > 0 and pair.latency_s >= 0
    assert cluster.intra_host == type(cluster.intra_host)(pair.bandwidth_Bps, pair.latency_s, cluster.intra_host.source,
                                                          host_copy=True)
    assert cluster.pass_overhead_s >= 0 and "measured" in cluster.pass_overhead_source  # the runtime probe ran
    assert cluster.pass_byte_overhead_s >= 0
    assert cluster.schedule_runtime_pass_overhead_s >= 0 and "zb-h1" in cluster.pass_overhead_source  # and under zb


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_emulated_hosts_of_two_ranks_probe_their_concurrent_streams(tmp_path):
    """Two torchrun agents on this machine, each 2 ranks under its own PLANNER_HOST: the probe sees 2 hosts, runs the
    2 cross-host streams at once and writes a valid cluster (4 ranks on 2 cores: correctness only; the streams share
    the cores' copies here, not a NIC, so the count itself is not checked)."""
    from tests._runtime_jobs import emulated_hosts, free_port

    port = free_port()
    out = tmp_path / "cluster.json"
    runs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", "emulated-hosts", "--no-python", sys.executable, "-c",
               "from planner.cli import main; main()", "profile", "--probe-links", "-o", str(out)]
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1",
                   PLANNER_HOST=f"host{node}")
        runs.append((cmd, tmp_path, env))
    results = emulated_hosts(runs, timeout_s=240)
    assert all(code == 0 for code, _, _ in results), [err[-2000:] for _, _, err in results]
    cluster = load_cluster(out)
    assert sorted({d.host for d in cluster.devices}) == ["host0", "host1"]
    assert "measured" in cluster.inter_host.source
    streams = cluster.extra["probe_streams"]
    assert len(streams["pairs"]) == 2 and streams["one_way_s"] > 0 and streams["alone_s"] > 0
    assert all({a, b} & {d.id for d in cluster.devices if d.host == "host0"} for a, b in streams["pairs"])
    assert cluster.nics_per_host in (0, 1)  # 0: as fast as one stream alone; 1: the two shared one
