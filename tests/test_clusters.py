"""The bundled cluster catalog (profiles/clusters/*.json) is valid; bad cluster files fail in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.errors import InputFileError
from planner.formats.cluster import load_cluster
from planner.formats.catalog import load_catalog

CLUSTERS = Path(__file__).resolve().parents[1] / "profiles" / "clusters"
EXPECTED = {"cpu-2", "dgx-h100-8", "a100-2x8-ib", "mixed-a100-v100-pcie", "t4-4-pcie", "mixed-3type-2host",
            "a100-4", "a100-8", "t4-2x4-eth"}


def bundled() -> list[Path]:
    return sorted(CLUSTERS.glob("*.json"))


def test_the_catalog_has_the_expected_clusters() -> None:
    assert EXPECTED <= {p.stem for p in bundled()}


@pytest.mark.parametrize("path", bundled(), ids=lambda p: p.stem)
def test_bundled_cluster_is_valid_and_cites_its_links(path: Path) -> None:
    cluster = load_cluster(path)
    catalog = load_catalog()
    assert cluster.name == path.stem
    for device in cluster.devices:
        assert device.type in catalog, f"{device.id}: type {device.type!r} is not in profiles/devices.json"
        assert 0 < device.memory_bytes <= catalog[device.type].memory_bytes
    links = [cluster.intra_host, cluster.inter_host, *cluster.pairs.values()]
    for link in links:
        assert link.source, "every link figure cites where it comes from"
        assert 1e8 <= link.bandwidth_Bps <= 1e12 and 0 <= link.latency_s < 1e-3
    assert load_cluster(path).to_dict() == cluster.to_dict()  # round trip keeps every field


def test_gpu_memory_comes_from_the_device_catalog() -> None:
    catalog = load_catalog()
    for path in bundled():
        for device in load_cluster(path).devices:
            if device.type != "cpu":
                assert device.memory_bytes == catalog[device.type].memory_bytes


def test_mixed_clusters_mix_types_and_links() -> None:
    mixed = load_cluster(CLUSTERS / "mixed-3type-2host.json")
    assert len({d.type for d in mixed.devices}) >= 3 and len({d.host for d in mixed.devices}) == 2
    assert mixed.link("a-h100-0", "b-v100-0") is mixed.inter_host
    assert mixed.link("b-l4-1", "b-v100-0").bandwidth_Bps < mixed.link("a-h100-0", "a-a100-1").bandwidth_Bps
    pcie = load_cluster(CLUSTERS / "mixed-a100-v100-pcie.json")
    assert pcie.link("a100-1", "a100-0").bandwidth_Bps == 2 * pcie.link("a100-0", "v100-0").bandwidth_Bps
    ib = load_cluster(CLUSTERS / "a100-2x8-ib.json")
    assert ib.link("n0-gpu0", "n1-gpu0").bandwidth_Bps < ib.link("n0-gpu0", "n0-gpu7").bandwidth_Bps


def _write(tmp_path: Path, data: object, name: str = "bad.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _valid() -> dict:
    return json.loads((CLUSTERS / "t4-4-pcie.json").read_text())


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(devices=[]), "'devices' must be a non-empty list"),
    (lambda d: d.update(schema_version=2), "schema_version must be 1, found 2"),
    (lambda d: d.pop("links"), "'links' must be present"),
    (lambda d: d["devices"][1].update(id="gpu0"), "must be unique"),
    (lambda d: d["devices"][0].update(memory_bytes=-1), "must be positive"),
    (lambda d: d["links"]["intra_host"].update(bandwidth_Bps="fast"), "must be a number"),
    (lambda d: d["links"].update(pairs=[{"a": "gpu0", "b": "gpu9", "bandwidth_Bps": 1.0, "latency_s": 0.0}]),
     "known device ids"),
])
def test_bad_clusters_raise_one_line(tmp_path: Path, mutate, match) -> None:
    data = _valid()
    mutate(data)
    with pytest.raises(InputFileError, match=match) as info:
        load_cluster(_write(tmp_path, data))
    assert "\n" not in str(info.value)


def test_malformed_json_raises_one_line(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="is not valid JSON") as info:
        load_cluster(_write(tmp_path, '{"schema_version": 1, "devices": ['))
    assert "\n" not in str(info.value)
