"""One feasibility rule (``planner.partition.model.feasibility``) for placers, ``plan check`` and the runtime.

The bug this guards against: ``plan check`` printing PASS for a plan that ``plan run`` then refuses (1F1B
with fewer micro-batches than stages), because the rule lived only in the runtime.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _plan_cases import toy_cluster, toy_profile
from typer.testing import CliRunner

from planner.cli import app
from planner.errors import InfeasibleError, PlanMismatchError
from planner.formats.catalog import load_catalog
from planner.formats.plan import Plan, Stage, load_plan
from planner.partition import partition
from planner.partition.model.feasibility import max_stages, shape_violations
from planner.partition.validate import validate_plan
from planner.runtime.pipeline.stages import rank_of_stages

PROFILE = toy_profile(6)
CLUSTER = toy_cluster(4)

# (schedule, micro-batches, device of each stage): shapes the runtime must refuse and plan check too.
REFUSED = [
    ("1f1b", 2, ["d0", "d1", "d2"]),                    # fewer micro-batches than stages
    ("1f1b", 1, ["d0", "d1"]),
    ("gpipe", 4, ["d0", "d1", "d0"]),                   # a device holds two stages outside interleaved
    ("1f1b", 4, ["d0", "d0"]),
    ("interleaved-1f1b", 4, ["d0", "d1", "d1", "d0"]),  # not round-robin
    ("interleaved-1f1b", 5, ["d0", "d1", "d0", "d1"]),  # 5 micro-batches do not split into 2 rounds
    ("interleaved-1f1b", 4, ["d0", "d1", "d2", "d0", "d1"]),  # unequal stages per device
]
ACCEPTED = [
    ("1f1b", 3, ["d0", "d1", "d2"]),
    ("gpipe", 1, ["d0", "d1", "d2"]),
    ("interleaved-1f1b", 4, ["d0", "d1", "d0", "d1"]),
    ("interleaved-1f1b", 1, ["d0", "d1", "d0", "d1"]),
]


def _plan(schedule: str, microbatches: int, devices: list[str]) -> Plan:
    """A plan of the toy profile with one stage per entry of ``devices`` (contiguous runs of its nodes)."""
    names = [n.name for n in PROFILE.nodes]
    k = len(devices)
    bounds = [round(i * len(names) / k) for i in range(k + 1)]
    stages = tuple(Stage(i, d, tuple(names[bounds[i]:bounds[i + 1]])) for i, d in enumerate(devices))
    return Plan(method="hand", schedule=schedule, microbatches=microbatches, stages=stages,
                predicted={"step_time_s": 1.0, "devices": {}}, extra={"cluster": CLUSTER.to_dict(), "optimizer": "sgd"})


@pytest.mark.parametrize("schedule, microbatches, devices", REFUSED)
def test_every_shape_the_runtime_refuses_plan_check_refuses_with_the_same_words(schedule: str, microbatches: int,
                                                                               devices: list[str]) -> None:
    plan = _plan(schedule, microbatches, devices)
    with pytest.raises(PlanMismatchError) as refused:
        rank_of_stages(plan)
    words = str(refused.value).removeprefix("the plan cannot run: ")
    assert words in validate_plan(plan, PROFILE, CLUSTER, load_catalog())
    assert words == shape_violations(schedule, microbatches, devices)[0]


@pytest.mark.parametrize("schedule, microbatches, devices", ACCEPTED)
def test_shapes_the_rule_accepts_run_and_pass_plan_check(schedule: str, microbatches: int, devices: list[str]) -> None:
    plan = _plan(schedule, microbatches, devices)
    assert shape_violations(schedule, microbatches, devices) == []
    rank_of_stages(plan)
    assert validate_plan(plan, PROFILE, CLUSTER, load_catalog()) == []


@pytest.mark.parametrize("method", ["greedy", "dp", "ilp", "uniform", "params", "time-balance"])
def test_placers_keep_1f1b_plans_within_the_micro_batch_count(method: str) -> None:
    """The issue's example: 2 micro-batches on 8 devices under 1F1B gave 7-8 stages that could not run."""
    from planner.clusters import load_cluster_spec
    from planner.formats.profile import load_profile

    profile = load_profile(Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json")
    cluster = load_cluster_spec("dgx-h100-8")
    plan = partition(profile, cluster, method=method, microbatches=2, schedule="1f1b", catalog=load_catalog())
    assert len(plan.stages) <= max_stages("1f1b", 2, 8) == 2
    assert validate_plan(plan, profile, cluster, load_catalog()) == []
    rank_of_stages(plan)


def test_plan_check_refuses_the_m2_1f1b_plan_with_the_runtimes_words(tmp_path: Path) -> None:
    """A plan partitioned at 16 micro-batches and relabelled 2 (what a hand edit or an older planner gives)."""
    runner = CliRunner()
    profile = Path(__file__).parent / "golden" / "profiles" / "gpt_tiny.json"
    made = runner.invoke(app, ["partition", str(profile), "--cluster", "dgx-h100-8", "-m", "greedy", "-d", "1", "-n", "16",
                               "-s", "1f1b", "-o", str(tmp_path / "m16.json")])
    assert made.exit_code == 0, made.output
    doc = json.loads((tmp_path / "m16.json").read_text())
    assert len(doc["stages"]) > 2
    doc["microbatches"] = 2
    (tmp_path / "edited.json").write_text(json.dumps(doc))
    checked = runner.invoke(app, ["check", str(tmp_path / "edited.json")])
    assert checked.exit_code != 0
    assert "1f1b needs at least as many micro-batches as stages" in checked.output
    with pytest.raises(PlanMismatchError, match="1f1b needs at least as many micro-batches as stages"):
        rank_of_stages(load_plan(tmp_path / "edited.json"))


def test_build_plan_refuses_an_infeasible_shape_with_the_same_words() -> None:
    from planner.partition.model.convert import build_plan
    from planner.partition.model.problem import StageSpec, build_problem

    problem = build_problem(PROFILE, CLUSTER, microbatches=2, schedule="1f1b", optimizer="sgd")
    spec = (StageSpec(0, 2, "d0"), StageSpec(2, 4, "d1"), StageSpec(4, 7, "d2"))
    with pytest.raises(InfeasibleError) as refused:
        build_plan(problem, spec, method="hand")
    assert str(refused.value) == shape_violations("1f1b", 2, ["d0", "d1", "d2"])[0]
