"""``planner.app.check``: validity against profile and cluster, regressions against a baseline, plan diffs."""

from __future__ import annotations

from pathlib import Path

import pytest
from _plan_cases import edit_plan, make_plan, toy_cluster, toy_profile, write_case

from planner.app.check import Metric, check_files, check_plan, compare, diff_plans, parse_tolerance
from planner.errors import InputFileError, UsageError
from planner.formats.plan import load_plan


@pytest.mark.parametrize(("text", "value"), [("2%", 0.02), ("0.02", 0.02), (" 5 % ".replace(" ", ""), 0.05),
                                             ("0", 0.0), ("0%", 0.0), ("150%", 1.5), ("1", 1.0)])
def test_parse_tolerance(text: str, value: float) -> None:
    assert parse_tolerance(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["", "abc", "-1%", "-0.1", "5", "nan", "inf%", "2%%"])
def test_parse_tolerance_refuses_bad_values_as_usage_errors(text: str) -> None:
    with pytest.raises(UsageError, match="--tolerance"):
        parse_tolerance(text)


def test_metric_regresses_only_beyond_the_tolerance() -> None:
    assert not Metric("step_time_s", "s", 1.0, 1.02, 0.02).regressed
    assert Metric("step_time_s", "s", 1.0, 1.0201, 0.02).regressed
    assert not Metric("step_time_s", "s", 1.0, 0.5, 0.0).regressed
    assert Metric("x", "B", 0.0, 1.0, 0.5).change == float("inf")
    assert Metric("x", "B", 0.0, 1.0, 0.5).to_dict()["change"] is None  # strict JSON has no Infinity


def test_identical_plan_is_valid_and_does_not_regress() -> None:
    profile, cl = toy_profile(), toy_cluster()
    plan = make_plan(profile, cl, (3, 5))
    result = check_plan(plan, profile, cl, baseline=plan, tolerance=0.0)
    assert result.passed and result.problems == ()
    assert [m.name for m in result.metrics] == ["step_time_s", "peak_memory_bytes"]
    assert all(m.change == 0 for m in result.metrics)


def test_five_percent_slower_fails_a_two_percent_tolerance(tmp_path: Path) -> None:
    case = write_case(tmp_path)

    def slower(doc: dict) -> None:
        doc["predicted"]["step_time_s"] *= 1.05

    slow = edit_plan(case.plan_path, tmp_path / "slow.json", slower)
    result = check_files(slow, baseline_path=case.plan_path, tolerance=0.02)
    assert not result.passed and result.problems == ()
    assert [m.name for m in result.regressions] == ["step_time_s"]
    assert result.regressions[0].change == pytest.approx(0.05)
    assert check_files(slow, baseline_path=case.plan_path, tolerance=0.06).passed
    # The faster plan against the slower baseline is an improvement, not a regression.
    assert check_files(case.plan_path, baseline_path=slow, tolerance=0.0).passed


def test_more_peak_memory_is_a_regression() -> None:
    profile, cl = toy_profile(), toy_cluster()
    balanced = make_plan(profile, cl, (3, 5))
    lopsided = make_plan(profile, cl, (5, 6))
    metrics = {m.name: m for m in compare(lopsided, balanced, 0.02)}
    assert metrics["peak_memory_bytes"].regressed
    assert metrics["step_time_s"].regressed
    relaxed = {m.name: m for m in compare(lopsided, balanced, 0.02, memory_tolerance=10.0)}
    assert not relaxed["peak_memory_bytes"].regressed and relaxed["step_time_s"].regressed


def test_a_dropped_node_is_caught(tmp_path: Path) -> None:
    case = write_case(tmp_path)
    dropped = edit_plan(case.plan_path, tmp_path / "dropped.json", lambda d: d["stages"][1]["nodes"].remove("op3"))
    result = check_files(dropped)
    assert not result.passed
    assert any("op3" in p for p in result.problems), result.problems


def test_a_backwards_edge_is_caught(tmp_path: Path) -> None:
    case = write_case(tmp_path)

    def swap(doc: dict) -> None:  # op1 (stage 0) and op2 (stage 1) trade places: op1 -> op2 now runs backwards
        s0, s1 = doc["stages"][0]["nodes"], doc["stages"][1]["nodes"]
        s0[s0.index("op1")], s1[s1.index("op2")] = "op2", "op1"

    swapped = edit_plan(case.plan_path, tmp_path / "swapped.json", swap)
    result = check_files(swapped)
    assert not result.passed
    assert any("op1" in p and "op2" in p for p in result.problems), result.problems


def test_an_over_memory_stage_is_caught(tmp_path: Path) -> None:
    case = write_case(tmp_path)

    def shrink(doc: dict) -> None:
        doc["cluster"]["devices"][0]["memory_bytes"] = 500  # stage 0 needs 1100 bytes

    small = edit_plan(case.plan_path, tmp_path / "small.json", shrink)
    result = check_files(small)
    assert not result.passed
    assert any("d0" in p for p in result.problems), result.problems


def test_an_unknown_device_is_caught(tmp_path: Path) -> None:
    case = write_case(tmp_path)
    moved = edit_plan(case.plan_path, tmp_path / "moved.json", lambda d: d["stages"][2].update(device="d9"))
    result = check_files(moved)
    assert not result.passed
    assert any("d9" in p for p in result.problems), result.problems


def test_an_empty_stage_is_caught(tmp_path: Path) -> None:
    case = write_case(tmp_path)

    def empty(doc: dict) -> None:
        doc["stages"][1]["nodes"] += doc["stages"][2]["nodes"]
        doc["stages"][2]["nodes"] = []

    emptied = edit_plan(case.plan_path, tmp_path / "empty.json", empty)
    result = check_files(emptied)
    assert not result.passed
    assert any("empty" in p or "no nodes" in p for p in result.problems), result.problems


def test_profile_and_cluster_can_be_given_explicitly(tmp_path: Path) -> None:
    case = write_case(tmp_path)
    assert check_files(case.plan_path, profile_path=case.profile_path, cluster_spec=str(case.cluster_path)).passed
    small = toy_cluster(memory_bytes=500)
    from planner.formats.cluster import save_cluster

    save_cluster(small, tmp_path / "small-cluster.json")
    assert not check_files(case.plan_path, cluster_spec=str(tmp_path / "small-cluster.json")).passed


def test_profile_is_found_next_to_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = write_case(tmp_path)
    edit_plan(case.plan_path, case.plan_path, lambda d: d["profile"].update(path="profile.json"))
    monkeypatch.chdir("/")
    assert check_files(case.plan_path).passed


def test_missing_profile_reference_asks_for_profile(tmp_path: Path) -> None:
    case = write_case(tmp_path)
    edit_plan(case.plan_path, case.plan_path, lambda d: d.pop("profile"))
    with pytest.raises(InputFileError, match="--profile"):
        check_files(case.plan_path)


def test_changed_profile_is_noted_not_failed(tmp_path: Path) -> None:
    case = write_case(tmp_path)
    case.profile_path.write_text(case.profile_path.read_text() + "\n")
    result = check_files(case.plan_path)
    assert result.passed and any("changed" in n for n in result.notes)


def test_diff_reports_moved_nodes_devices_and_deltas() -> None:
    profile, cl = toy_profile(), toy_cluster()
    a, b = make_plan(profile, cl, (3, 5)), make_plan(profile, cl, (2, 5))
    diff = diff_plans(a, b, "a", "b")
    assert not diff.identical and diff.moved_nodes == 1
    assert diff.stages[0].moved_out == ("op1",) and diff.stages[1].moved_in == ("op1",)
    assert (diff.stages[0].nodes_a, diff.stages[0].nodes_b) == (3, 2)
    assert diff.step_time_s == (a.step_time_s, b.step_time_s)
    assert diff.to_dict()["stages"][1]["moved_in"] == ["op1"]


def test_diff_of_a_plan_with_itself_is_identical(tmp_path: Path) -> None:
    case = write_case(tmp_path)
    plan = load_plan(case.plan_path)
    diff = diff_plans(plan, plan)
    assert diff.identical and diff.moved_nodes == 0 and diff.settings == {}


def test_diff_of_different_stage_counts() -> None:
    profile = toy_profile()
    a = make_plan(profile, toy_cluster(3), (3, 5))
    b = make_plan(profile, toy_cluster(2), (4,), schedule="gpipe")
    diff = diff_plans(a, b)
    assert diff.settings["stages"] == (3, 2) and diff.settings["schedule"] == ("1f1b", "gpipe")
    assert diff.stages[2].device_b is None and diff.stages[2].moved_out == ("op4", "op5")


def test_a_different_placement_is_noted_not_failed() -> None:
    profile, cl = toy_profile(), toy_cluster()
    slower = make_plan(profile, cl, (2, 5))
    balanced = make_plan(profile, cl, (3, 5))
    result = check_plan(balanced, profile, cl, baseline=slower, tolerance=0.0)
    assert result.passed
    assert any("1 node(s) moved" in n for n in result.notes), result.notes
    assert check_plan(balanced, profile, cl, baseline=balanced).notes == ()


def test_cluster_specs_resolve_to_files_or_bundled_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from planner.clusters import BUNDLED_DIR, bundled_clusters, resolve_cluster

    assert {"cpu-2", "dgx-h100-8"} <= set(bundled_clusters())
    assert resolve_cluster("dgx-h100-8") == BUNDLED_DIR / "dgx-h100-8.json"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dgx-h100-8").write_text("{}")  # an existing file of that name wins over the bundled one
    assert resolve_cluster("dgx-h100-8") == Path("dgx-h100-8")
    with pytest.raises(InputFileError, match="bundled: .*cpu-2"):
        resolve_cluster("tpu-v9")
    with pytest.raises(InputFileError, match="neither an existing file"):
        resolve_cluster("some/dir/cpu-2")  # a path is never looked up among the bundled names
