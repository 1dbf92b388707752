"""The file contracts: round trips, and one-line errors naming the broken rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.errors import InputFileError
from planner.formats import (
    cluster_from_dict,
    load_cluster,
    load_plan,
    load_profile,
    plan_from_dict,
    profile_from_dict,
    save_plan,
    save_profile,
)


def _profile_doc() -> dict:
    t = {"cpu": {"fwd": 1e-3, "bwd": 2e-3, "source": "measured"}}
    return {
        "schema_version": 1,
        "model": {"name": "toy", "source": "x:y", "microbatch_size": 2},
        "nodes": [
            {"name": "x", "op": "input", "inputs": [], "output_bytes": 64, "param_bytes": 0, "time_s": t},
            {"name": "mm", "op": "aten.mm.default", "inputs": ["x"], "output_bytes": 64, "param_bytes": 256,
             "time_s": t, "custom": [1, 2]},
        ],
        "device_type": "cpu",
    }


def _cluster_doc() -> dict:
    return {
        "schema_version": 1,
        "name": "two",
        "devices": [
            {"id": "d0", "type": "cpu", "host": "h0", "memory_bytes": 10**9},
            {"id": "d1", "type": "cpu", "host": "h1", "memory_bytes": 10**9},
        ],
        "links": {
            "intra_host": {"bandwidth_Bps": 1e10, "latency_s": 1e-6},
            "inter_host": {"bandwidth_Bps": 1e9, "latency_s": 1e-5},
        },
    }


def test_profile_round_trip_keeps_unknown_fields(tmp_path: Path) -> None:
    profile = profile_from_dict(_profile_doc())
    assert [n.name for n in profile.nodes] == ["x", "mm"]
    assert profile.device_types == ("cpu",)
    out = save_profile(profile, tmp_path / "p.json")
    again = load_profile(out)
    assert again.nodes[1].extra["custom"] == [1, 2]
    assert again.extra["device_type"] == "cpu"
    assert again.to_dict() == profile.to_dict()


def test_profile_rejects_input_defined_later() -> None:
    doc = _profile_doc()
    doc["nodes"].reverse()
    with pytest.raises(InputFileError, match="topological order"):
        profile_from_dict(doc)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schema_version=2), "schema_version must be 1, found 2"),
        (lambda d: d.update(nodes=[]), "non-empty"),
        (lambda d: d["nodes"][1].update(output_bytes=-1), "non-negative"),
        (lambda d: d["nodes"][1]["time_s"]["cpu"].update(source="guessed"), "'measured' or 'estimated'"),
        (lambda d: d["nodes"][1].pop("param_bytes"), "param_bytes"),
        (lambda d: d["nodes"].append(dict(d["nodes"][1])), "unique"),
    ],
)
def test_profile_errors_name_the_rule(mutate, message) -> None:
    doc = _profile_doc()
    mutate(doc)
    with pytest.raises(InputFileError, match=message):
        profile_from_dict(doc)


def test_cluster_links_by_host_and_pairs() -> None:
    doc = _cluster_doc()
    doc["devices"].append({"id": "d2", "type": "cpu", "host": "h0", "memory_bytes": 10**9})
    doc["links"]["pairs"] = [{"a": "d1", "b": "d0", "bandwidth_Bps": 5e9, "latency_s": 0.0}]
    cluster = cluster_from_dict(doc)
    assert cluster.link("d0", "d2").bandwidth_Bps == 1e10  # same host
    assert cluster.link("d0", "d1").bandwidth_Bps == 5e9  # explicit pair, either order
    assert cluster.link("d2", "d1").bandwidth_Bps == 1e9  # other host
    assert cluster.transfer_s("d0", "d0", 10**9) == 0.0
    assert cluster.transfer_s("d2", "d1", 1e9) == pytest.approx(1.0 + 1e-5)


def test_host_copy_links_round_trip_and_charge_their_endpoints() -> None:
    doc = _cluster_doc()
    doc["links"]["intra_host"]["host_copy"] = True
    cluster = cluster_from_dict(doc)
    assert cluster.intra_host.host_copy and not cluster.inter_host.host_copy
    assert cluster.intra_host.copy_s(1e10) == pytest.approx(1.0) and cluster.inter_host.copy_s(1e10) == 0.0
    assert cluster_from_dict(cluster.to_dict()) == cluster
    assert "host_copy" not in cluster.to_dict()["links"]["inter_host"]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(devices=[]), "devices.*non-empty"),
        (lambda d: d["devices"][1].update(id="d0"), "unique"),
        (lambda d: d["links"]["intra_host"].update(bandwidth_Bps=0), "positive"),
        (lambda d: d["links"]["intra_host"].update(host_copy="yes"), "host_copy.*true or false"),
        (lambda d: d["links"].update(pairs=[{"a": "d0", "b": "zz", "bandwidth_Bps": 1, "latency_s": 0}]), "known device"),
        (lambda d: d.update(runtime={"pass_overhead_s": -1e-4}), "runtime.pass_overhead_s"),
        (lambda d: d.update(runtime={"pass_byte_overhead_s": -1e-10}), "runtime.pass_byte_overhead_s"),
        (lambda d: d.update(runtime={"pass_byte_overhead_s": "fast"}), "runtime.pass_byte_overhead_s"),
    ],
)
def test_cluster_errors(mutate, message) -> None:
    doc = _cluster_doc()
    mutate(doc)
    with pytest.raises(InputFileError, match=message):
        cluster_from_dict(doc)


def test_yaml_cluster_and_malformed_json(tmp_path: Path) -> None:
    import yaml

    (tmp_path / "c.yaml").write_text(yaml.safe_dump(_cluster_doc()))
    assert load_cluster(tmp_path / "c.yaml").name == "two"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputFileError, match="not valid JSON"):
        load_cluster(tmp_path / "bad.json")
    with pytest.raises(InputFileError, match="does not exist"):
        load_plan(tmp_path / "missing.json")


def test_plan_round_trip_and_rules(tmp_path: Path) -> None:
    doc = {
        "schema_version": 1, "method": "greedy", "schedule": "1f1b", "microbatches": 4,
        "stages": [{"index": 0, "device": "d0", "nodes": ["x"], "compute_s": 1.0},
                   {"index": 1, "device": "d1", "nodes": ["mm"]}],
        "predicted": {"step_time_s": 0.5, "devices": {}},
        "cluster": _cluster_doc(),
    }
    plan = plan_from_dict(doc)
    assert plan.assignment() == {"x": 0, "mm": 1}
    again = load_plan(save_plan(plan, tmp_path / "plan.json"))
    assert json.loads((tmp_path / "plan.json").read_text()) == again.to_dict() == doc
    for bad, message in [({"microbatches": 0}, "at least 1"), ({"schedule": "zigzag"}, "one of"),
                         ({"stages": [dict(doc["stages"][1])]}, "stages listed in order")]:
        with pytest.raises(InputFileError, match=message):
            plan_from_dict({**doc, **bad})
