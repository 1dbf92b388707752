"""The committed golden plans: one per case of tests/golden/cases.txt, each valid against its committed
profile and embedded cluster. (scripts/check_golden.sh re-plans them and checks for regressions.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.app.check import check_files
from planner.formats.plan import load_plan

GOLDEN = Path(__file__).parent / "golden"
REPO = GOLDEN.parent.parent


def _cases() -> list[list[str]]:
    lines = (GOLDEN / "cases.txt").read_text().splitlines()
    return [line.split() for line in lines if line.strip() and not line.lstrip().startswith("#")]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_golden_plan_matches_its_case_and_is_valid(case: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    name, profile, cluster, method, schedule, microbatches = case[:6]
    monkeypatch.chdir(REPO)  # plans record their profile relative to the repository root
    plan = load_plan(GOLDEN / "plans" / f"{name}.json")
    assert (plan.method, plan.schedule, plan.microbatches) == (method, schedule, int(microbatches))
    assert plan.extra["cluster"]["name"] == cluster
    assert plan.extra["profile"]["path"] == f"tests/golden/profiles/{profile}.json"
    result = check_files(GOLDEN / "plans" / f"{name}.json")
    assert result.passed, result.problems
    assert result.notes == (), result.notes  # the profile is the one the plan was made from
