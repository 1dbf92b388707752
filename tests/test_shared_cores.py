"""Ranks that share a host's cores (``runtime.host_cores``): the step stretches until their work fits."""

from __future__ import annotations

import pytest

from planner.errors import InputFileError
from planner.formats.cluster import cluster_from_dict
from planner.partition.sim.simulate import SimStage, simulate
from planner.partition.sim.step import host_work, simulate_step


def _cluster(hosts: dict[str, int], cores: int | None) -> dict:
    devices = [{"id": f"{host}-{i}", "type": "cpu", "host": host, "memory_bytes": 2**30}
               for host, n in hosts.items() for i in range(n)]
    data = {"schema_version": 1, "name": "t", "devices": devices,
            "links": {"intra_host": {"bandwidth_Bps": 1e9, "latency_s": 1e-5},
                      "inter_host": {"bandwidth_Bps": 1e8, "latency_s": 1e-4}}}
    if cores is not None:
        data["runtime"] = {"pass_overhead_s": 0.0, "host_cores": cores}
    return data


def _stage(device: str, fwd: float = 0.01) -> SimStage:
    return SimStage(device=device, fwd_s=fwd, bwd_s=2 * fwd, send_fwd_bytes=1000, send_bwd_bytes=1000,
                    static_bytes=0, activation_bytes=0, update_s=0.002)


def _hybrid(cluster_data: dict) -> tuple:
    """2 stages x 2 replicas on the cluster's first four devices, 8 micro-batches."""
    cluster = cluster_from_dict(cluster_data)
    ids = cluster.device_ids
    pipelines = [[_stage(ids[0]), _stage(ids[1])], [_stage(ids[2]), _stage(ids[3])]]
    return pipelines, [4, 4], [0.003, 0.003], cluster


def test_four_ranks_on_two_cores_take_at_least_their_work_over_two():
    pipelines, shares, sync, cluster = _hybrid(_cluster({"h": 4}, cores=2))
    free = simulate_step(pipelines, shares, sync, cluster_from_dict(_cluster({"h": 4}, cores=None)), "1f1b")
    shared = simulate_step(pipelines, shares, sync, cluster, "1f1b")
    work = host_work(free, cluster)["h"]
    assert work > 2 * free.step_time_s  # the case is over-subscribed
    assert shared.step_time_s >= work / 2 * 0.999  # the processor-sharing bound holds
    # and the shares see the bubbles: a pass that overlaps 4 busy ranks runs at half speed, one in another rank's
    # bubble faster, so the step sits above the bound (which lets every rank give its core away perfectly) and
    # below every rank at half speed throughout
    assert work / 2 * 1.02 < shared.step_time_s < 2 * free.step_time_s
    assert all(1.2 < f < 2.0 for f in shared.core_stretch.values()) and len(shared.core_stretch) == 4
    # the stretch keeps the schedule: every pass takes longer, none is dropped
    assert len(shared.events) == len(free.events)


def test_a_devices_share_of_the_cores_is_its_mean_company_while_busy():
    """Two ranks of one 1-core host overlap half their busy time: each gets the core alone for one second and half
    of it for another, so its work takes 1.5x as long; a rank alone on its host takes its own core."""
    from planner.partition.sim.simulate import Event, SimResult
    from planner.partition.sim.step import shared_stretch

    cluster = cluster_from_dict(_cluster({"a": 2, "b": 1}, cores=1))
    events = (Event("a-0", "fwd", 0, 0, 0.0, 2.0), Event("a-1", "fwd", 1, 0, 1.0, 3.0),
              Event("a-0->a-1", "send_fwd", 0, 0, 2.0, 2.5), Event("b-0", "fwd", 0, 0, 0.0, 3.0))
    result = SimResult(step_time_s=3.0, devices={}, bubble_fraction=0.0, events=events)
    assert shared_stretch(result, cluster) == pytest.approx({"a-0": 1.5, "a-1": 1.5, "b-0": 1.0})


def test_enough_cores_or_none_declared_change_nothing():
    pipelines, shares, sync, _ = _hybrid(_cluster({"h": 4}, cores=None))
    base = simulate_step(pipelines, shares, sync, cluster_from_dict(_cluster({"h": 4}, cores=None)), "1f1b")
    for cores in (4, 16):
        roomy = simulate_step(pipelines, shares, sync, cluster_from_dict(_cluster({"h": 4}, cores=cores)), "1f1b")
        assert roomy.step_time_s == base.step_time_s


def test_only_the_crowded_host_is_stretched():
    cluster = cluster_from_dict(_cluster({"a": 1, "b": 3}, cores=1))  # host b: 3 ranks on 1 core
    ids = cluster.device_ids
    one = [[_stage(ids[0]), _stage(ids[1])]]
    alone = simulate_step(one, [8], [], cluster, "1f1b")  # a-0 and b-0: one rank per host's core, no stretch
    assert alone.step_time_s == simulate(one[0], cluster, "1f1b", 8).step_time_s
    pipelines = [[_stage(ids[0]), _stage(ids[1])], [_stage(ids[2]), _stage(ids[3])]]
    crowded = simulate_step(pipelines, [4, 4], [0.001, 0.001], cluster, "1f1b")
    # a-0 runs one pass as profiled; b's ranks run theirs longer
    fwd = {d: min(e.end_s - e.start_s for e in crowded.events if e.resource == d and e.kind == "fwd") for d in ids}
    assert fwd["b-1"] > fwd["a-0"] * 1.2


def test_the_stretch_lengthens_a_zero_bubble_backwards_halves_alike():
    """A crowded host stretches a zero-bubble stage's weight gradient ``W`` with the rest of its backward: a ``W``
    left as profiled would shrink the held-back share the schedule fills bubbles with."""
    import dataclasses

    pipelines, shares, sync, cluster = _hybrid(_cluster({"h": 4}, cores=2))
    pipelines = [[dataclasses.replace(st, bwd_weight_s=st.bwd_s / 2) for st in p] for p in pipelines]
    free = simulate_step(pipelines, shares, sync, cluster_from_dict(_cluster({"h": 4}, cores=None)), "zb-h1")
    shared = simulate_step(pipelines, shares, sync, cluster, "zb-h1")
    factor = shared.core_stretch[cluster.device_ids[0]]
    assert factor > 1.2
    for kind in ("bwd_input", "bwd_weight"):
        took = {round(e.end_s - e.start_s, 12) for e in shared.events if e.resource == "h-1" and e.kind == kind}
        was = {round(e.end_s - e.start_s, 12) for e in free.events if e.resource == "h-1" and e.kind == kind}
        assert took == {round(w * factor, 12) for w in was}, kind


@pytest.mark.parametrize("cores", [0, -1, 1.5, True])
def test_host_cores_must_be_a_positive_whole_number(cores):
    with pytest.raises(InputFileError, match="runtime.host_cores"):
        cluster_from_dict(_cluster({"h": 2}, cores=cores))


def test_host_cores_round_trips():
    cluster = cluster_from_dict(_cluster({"h": 4}, cores=2))
    assert cluster.host_cores == 2
    assert cluster_from_dict(cluster.to_dict()).host_cores == 2


def test_the_runtime_model_sees_the_stretch_it_predicts():
    """The rebalancer compares a rank's wall-clock compute with the model's: on 4 ranks sharing 2 cores both must
    include the stretch, or the speed fit would read the sharing as slow devices and the simulator would stretch
    again on top."""
    import dataclasses
    from pathlib import Path

    from planner.clusters import load_cluster_spec
    from planner.formats.catalog import load_catalog
    from planner.formats.profile import load_profile
    from planner.partition import partition
    from planner.runtime.rebalancing.replan import RoundModel

    profile = load_profile(Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json")
    for name, shared in (("cpu-4", True), ("cpu-2", False)):
        # without the runtime's cost inside the passes, which adds itself to the compute compared below
        # (tests/test_rebalance.py checks that part); time-balance splits each replica in two even stages, so all
        # four ranks compute (the fastest plan for this tiny model on 2 cores keeps nearly all of it on one stage)
        cluster = dataclasses.replace(load_cluster_spec(name), pass_overhead_s=0.0, pass_compute_overhead_s=0.0)
        plan = partition(profile, cluster, method="time-balance", microbatches=8, schedule="1f1b", data_parallel=2,
                         catalog=load_catalog())
        assert {d for devices in plan.replicas() for d in devices} == set(cluster.device_ids)  # every rank runs
        model = RoundModel.build(profile, cluster, plan, catalog=load_catalog())
        stretch = model.core_stretch(plan)
        assert bool(stretch) == shared
        if shared:
            assert set(stretch) == set(cluster.device_ids) and all(f > 1.2 for f in stretch.values())
            compute = model.predicted_compute_s(plan, 1)
            stats = plan.predicted["devices"]
            for device, seconds in compute.items():  # the plan's own simulated compute, stretched alike
                assert seconds == pytest.approx(stats[device]["compute_s"], rel=1e-6)
            held = {h.device: h.measured_s for h in model.held(plan, 1, compute)}
            assert all(held[d] == pytest.approx(compute[d] / stretch[d]) for d in compute)
        # the speed probe: a row per device named with its type, but none where the host's ranks share its cores
        # (all of them probe at once, which the step's stretch does not describe)
        probed = [h for h in model.held(plan, 1, model.predicted_compute_s(plan, 1),
                                        {d: 1e-3 for d in cluster.device_ids}, "matmul-384") if h.probe]
        assert [(h.device, h.probe, h.ranges) for h in probed] == \
            ([] if shared else [(d, "matmul-384:cpu", ()) for d in sorted(cluster.device_ids)])
