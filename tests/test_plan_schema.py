"""The published plan JSON Schema accepts every committed golden plan and rejects broken ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

jsonschema = pytest.importorskip("jsonschema")
REPO = Path(__file__).resolve().parents[1]
GOLDEN = sorted((REPO / "tests" / "golden" / "plans").glob("*.json"))


def _validator():
    from referencing import Registry, Resource

    schemas = {name: json.loads((REPO / "docs" / "schema" / name).read_text())
               for name in ("plan.schema.json", "cluster.schema.json")}
    registry = Registry().with_resources(
        (f"https://github.com/planner/planner/docs/schema/{name}", Resource.from_contents(doc))
        for name, doc in schemas.items())
    jsonschema.Draft202012Validator.check_schema(schemas["plan.schema.json"])
    return jsonschema.Draft202012Validator(schemas["plan.schema.json"], registry=registry)


def test_there_are_golden_plans() -> None:
    assert len(GOLDEN) >= 5


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_golden_plans_validate(path: Path) -> None:
    _validator().validate(json.loads(path.read_text()))


@pytest.mark.parametrize("breakage", ["empty-stage", "bad-schedule", "no-step-time", "bad-cluster"])
def test_broken_plans_are_rejected(breakage: str) -> None:
    doc = json.loads(GOLDEN[0].read_text())
    if breakage == "empty-stage":
        doc["stages"][0]["nodes"] = []
    elif breakage == "bad-schedule":
        doc["schedule"] = "zigzag"
    elif breakage == "no-step-time":
        del doc["predicted"]["step_time_s"]
    else:
        doc["cluster"]["devices"] = []
    assert not _validator().is_valid(doc)
