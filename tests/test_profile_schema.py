"""The published JSON Schemas accept what planner writes (and the bundled clusters) and reject broken files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.profile import profile_model
from planner.runtime.links import PairFit, build_cluster

jsonschema = pytest.importorskip("jsonschema")
REPO = Path(__file__).resolve().parents[1]


def validator(name: str):
    schema = json.loads((REPO / "docs" / "schema" / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.fixture(scope="module")
def profile_doc():
    return profile_model("planner.examples.gpt:gpt_tiny", repeats=1, warmup=0, estimate=("t4",)).to_dict()


def test_generated_profile_validates(profile_doc):
    validator("profile.schema.json").validate(profile_doc)


def test_broken_profile_is_rejected(profile_doc):
    broken = json.loads(json.dumps(profile_doc))
    del broken["nodes"][3]["time_s"]
    assert not validator("profile.schema.json").is_valid(broken)
    broken = json.loads(json.dumps(profile_doc))
    broken["nodes"][3]["time_s"]["cpu"]["source"] = "guessed"
    assert not validator("profile.schema.json").is_valid(broken)


def test_probed_cluster_validates():
    infos = [{"rank": r, "host": "h", "type": "cpu", "memory_bytes": 2**30} for r in range(2)]
    fit = PairFit(0, 1, 1e9, 1e-5, ((1024, 1e-5), (2048, 2e-5)))
    validator("cluster.schema.json").validate(build_cluster("probed", infos, [fit]).to_dict())


@pytest.mark.parametrize("path", sorted((REPO / "profiles" / "clusters").glob("*.json")), ids=lambda p: p.name)
def test_bundled_clusters_validate(path):
    validator("cluster.schema.json").validate(json.loads(path.read_text()))


@pytest.mark.parametrize("path", sorted((REPO / "profiles" / "h200").glob("*.json")), ids=lambda p: p.name)
def test_profiles_measured_on_a_gpu_validate_and_load(path):
    """The profiles scripts/gpu_check.sh measured on an H200: contract-valid, and loaded as measured h200 times."""
    from planner.formats.profile import load_profile

    validator("profile.schema.json").validate(json.loads(path.read_text()))
    profile = load_profile(path)
    assert profile.extra["device_type"] == "h200" and profile.extra["measurement"]["clock"] == "cuda_events"
    assert all(n.time_s["h200"].source == "measured" for n in profile.nodes)


def test_cluster_without_links_is_rejected():
    doc = {"schema_version": 1, "name": "x", "devices": [{"id": "a", "type": "cpu", "host": "h", "memory_bytes": 1}]}
    assert not validator("cluster.schema.json").is_valid(doc)
