"""``plan partition | show | check | diff`` through typer's CliRunner: exit codes, output, files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _plan_cases import edit_plan, toy_cluster, write_case
from typer.testing import CliRunner

from planner.cli import app
from planner.formats.cluster import save_cluster
from planner.formats.plan import load_plan

runner = CliRunner()


def run(*args: str | Path) -> tuple[int, str, str]:
    result = runner.invoke(app, [str(a) for a in args])
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def one_error_line(stderr: str) -> str:
    """The stderr of a refused command: exactly one ``error: ...`` line, no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.fixture
def case(tmp_path: Path):  # noqa: ANN201 - the Case dataclass
    return write_case(tmp_path)


def partition_args(case, out: Path, **opts: str) -> list[str | Path]:  # noqa: ANN001
    options = {"--cluster": str(case.cluster_path), "--method": "dp", "--microbatches": "4", "--schedule": "1f1b"}
    options.update(opts)
    return ["partition", case.profile_path, *[x for kv in options.items() for x in kv], "-o", out]


# --- partition ------------------------------------------------------------------------------------

def test_partition_writes_a_plan_and_prints_the_stage_table(case, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "new.json"
    code, stdout, _ = run(*partition_args(case, out))
    assert code == 0, stdout
    plan = load_plan(out)
    assert sorted(n for s in plan.stages for n in s.nodes) == sorted(n.name for n in case.profile.nodes)
    assert plan.extra["profile"]["path"] == str(case.profile_path)
    for stage in plan.stages:
        assert f"{stage.device} (cpu)" in stdout
    assert "step" in stdout and "bubble" in stdout and f"wrote {out}" in stdout


def test_partition_json_prints_the_summary(case, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "new.json"
    code, stdout, _ = run(*partition_args(case, out), "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["output"] == str(out) and summary["method"] == "dp"
    assert summary["step_time_s"] == pytest.approx(load_plan(out).step_time_s)


def test_partition_accepts_a_bundled_cluster_name(case, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "new.json"
    code, stdout, stderr = run(*partition_args(case, out, **{"--cluster": "cpu-2"}))
    assert code == 0, stderr
    assert load_plan(out).extra["cluster"]["name"]


def test_partition_records_the_estimate_precision(case, tmp_path: Path) -> None:  # noqa: ANN001
    steps = {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / f"{precision}.json"
        code, _, stderr = run(*partition_args(case, out, **{"--cluster": "a100-4", "--estimate-precision": precision}))
        assert code == 0, stderr
        plan = load_plan(out)
        assert plan.extra["estimate_precision"] == precision
        steps[precision] = plan.step_time_s
    assert steps["bf16"] < steps["fp32"]  # the a100 times are estimates: half the bytes, tensor-core matmuls


@pytest.mark.parametrize(("opts", "needle"), [
    ({"--microbatches": "0"}, "--microbatches"),
    ({"--method": "magic"}, "unknown partition method 'magic'"),
    ({"--schedule": "zigzag"}, "unknown schedule 'zigzag'"),
    ({"--optimizer": "lion"}, "unknown optimizer 'lion'"),
    ({"--estimate-precision": "fp8"}, "unknown estimate precision 'fp8'"),
])
def test_partition_bad_option_values_are_usage_errors(case, tmp_path: Path, opts: dict, needle: str) -> None:  # noqa: ANN001
    out = tmp_path / "new.json"
    args = partition_args(case, out, **{k: v for k, v in opts.items() if k != "--optimizer"})
    if "--optimizer" in opts:
        args += ["--optimizer", opts["--optimizer"]]
    code, _, stderr = run(*args)
    assert code == 2
    assert needle in one_error_line(stderr)
    assert not out.exists()


def _bad_files(tmp: Path) -> dict[str, tuple[str, Path]]:
    """Name -> (which argument it replaces, the bad file)."""
    files = {}
    (tmp / "garbled.json").write_text("{not json")
    files["malformed profile"] = ("profile", tmp / "garbled.json")
    (tmp / "v9-profile.json").write_text(json.dumps({"schema_version": 9, "model": {}, "nodes": []}))
    files["profile schema_version"] = ("profile", tmp / "v9-profile.json")
    files["missing profile"] = ("profile", tmp / "nowhere.json")
    files["malformed cluster"] = ("cluster", tmp / "garbled.json")
    (tmp / "v2-cluster.json").write_text(json.dumps({"schema_version": 2, "name": "x", "devices": [], "links": {}}))
    files["cluster schema_version"] = ("cluster", tmp / "v2-cluster.json")
    doc = toy_cluster().to_dict()
    doc["devices"] = []
    (tmp / "empty-cluster.json").write_text(json.dumps(doc))
    files["cluster with no devices"] = ("cluster", tmp / "empty-cluster.json")
    return files


@pytest.mark.parametrize("bad", ["malformed profile", "profile schema_version", "missing profile", "malformed cluster",
                                 "cluster schema_version", "cluster with no devices"])
def test_partition_bad_files_fail_in_one_line(case, tmp_path: Path, bad: str) -> None:  # noqa: ANN001
    which, path = _bad_files(tmp_path)[bad]
    out = tmp_path / "new.json"
    args = partition_args(case, out, **({"--cluster": str(path)} if which == "cluster" else {}))
    if which == "profile":
        args[1] = path
    code, _, stderr = run(*args)
    assert code == 1
    line = one_error_line(stderr)
    assert str(path) in line
    assert not out.exists()


def test_partition_unknown_cluster_name(case, tmp_path: Path) -> None:  # noqa: ANN001
    code, _, stderr = run(*partition_args(case, tmp_path / "new.json", **{"--cluster": "no-such-cluster"}))
    assert code == 1
    assert "bundled" in one_error_line(stderr)


def test_partition_infeasible_memory(case, tmp_path: Path) -> None:  # noqa: ANN001
    save_cluster(toy_cluster(memory_bytes=300), tmp_path / "tiny.json")
    out = tmp_path / "new.json"
    code, _, stderr = run(*partition_args(case, out, **{"--cluster": str(tmp_path / "tiny.json")}))
    assert code == 1
    assert "memory" in one_error_line(stderr)
    assert not out.exists()


def test_partition_output_not_writable(case, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "no-such-dir" / "plan.json"
    code, _, stderr = run(*partition_args(case, out))
    assert code == 1
    assert "does not exist" in one_error_line(stderr)
    assert not out.parent.exists()


def test_partition_output_is_a_directory(case, tmp_path: Path) -> None:  # noqa: ANN001
    code, _, stderr = run(*partition_args(case, tmp_path))
    assert code == 1
    assert "is a directory" in one_error_line(stderr)


# --- show -----------------------------------------------------------------------------------------

def test_show_writes_timeline_and_trace_next_to_the_plan(case) -> None:  # noqa: ANN001
    code, stdout, stderr = run("show", case.plan_path)
    assert code == 0, stderr
    base = case.plan_path.with_suffix("")
    png, svg, trace = (Path(f"{base}.timeline.png"), Path(f"{base}.timeline.svg"), Path(f"{base}.trace.json"))
    assert png.stat().st_size > 0 and svg.stat().st_size > 0
    doc = json.loads(trace.read_text())
    threads = [e for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1]
    assert sorted(e["args"]["name"] for e in threads) == [f"{s.device} (cpu)" for s in case.plan.stages]
    complete = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert complete and all(e["dur"] >= 0 for e in complete)
    # one forward and one backward per stage and micro-batch
    assert sum(e["cat"] in ("fwd", "bwd") for e in complete) == 2 * len(case.plan.stages) * case.plan.microbatches
    assert "d0 (cpu)" in stdout and str(png) in stdout


def test_show_paths_can_be_chosen_and_json_lists_them(case, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, _ = run("show", case.plan_path, "--timeline", out / "t.png", "--svg", out / "t.svg",
                          "--trace", out / "t.json", "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["files"] == {"png": str(out / "t.png"), "svg": str(out / "t.svg"), "trace": str(out / "t.json")}
    assert summary["simulated_step_time_s"] == pytest.approx(case.plan.step_time_s)
    assert all((out / name).stat().st_size > 0 for name in ("t.png", "t.svg", "t.json"))


def test_show_no_files_only_prints(case) -> None:  # noqa: ANN001
    code, stdout, _ = run("show", case.plan_path, "--no-files")
    assert code == 0 and "d1 (cpu)" in stdout
    assert sorted(p.name for p in case.plan_path.parent.iterdir()) == ["cluster.json", "plan.json", "profile.json"]


def test_show_output_not_writable_leaves_no_file(case, tmp_path: Path) -> None:  # noqa: ANN001
    code, _, stderr = run("show", case.plan_path, "--trace", tmp_path / "missing" / "t.json")
    assert code == 1
    one_error_line(stderr)
    assert not list(tmp_path.glob("plan.timeline.*"))


def test_show_plan_without_simulator_figures(case, tmp_path: Path) -> None:  # noqa: ANN001
    bare = edit_plan(case.plan_path, tmp_path / "bare.json", lambda d: d["stages"][1].pop("bwd_s"))
    code, _, stderr = run("show", bare, "--no-files")
    assert code == 0  # the table needs no simulation
    code, _, stderr = run("show", bare)
    assert code == 1 and "'bwd_s'" in one_error_line(stderr)


@pytest.mark.parametrize("command", ["show", "check", "diff"])
@pytest.mark.parametrize("content", ["{broken", json.dumps({"schema_version": 7})])
def test_malformed_or_wrong_version_plans(case, tmp_path: Path, command: str, content: str) -> None:  # noqa: ANN001
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    args = [command, bad] + ([case.plan_path] if command == "diff" else [])
    code, _, stderr = run(*args)
    assert code == 1
    line = one_error_line(stderr)
    assert "bad.json" in line and ("schema_version" in line or "not valid JSON" in line)


# --- check ----------------------------------------------------------------------------------------

def test_check_passes_a_valid_plan_against_itself(case) -> None:  # noqa: ANN001
    code, stdout, _ = run("check", case.plan_path, "--baseline", case.plan_path)
    assert code == 0 and "PASS" in stdout and "step_time_s" in stdout


def test_check_fails_a_five_percent_regression(case, tmp_path: Path) -> None:  # noqa: ANN001
    slow = edit_plan(case.plan_path, tmp_path / "slow.json",
                     lambda d: d["predicted"].update(step_time_s=d["predicted"]["step_time_s"] * 1.05))
    code, stdout, _ = run("check", slow, "--baseline", case.plan_path, "--tolerance", "2%")
    assert code == 1 and "regressed" in stdout and "+5.00%" in stdout
    code, stdout, _ = run("check", slow, "--baseline", case.plan_path, "--tolerance", "0.06", "--json")
    assert code == 0 and json.loads(stdout)["passed"] is True


def test_check_json_lists_problems(case, tmp_path: Path) -> None:  # noqa: ANN001
    dropped = edit_plan(case.plan_path, tmp_path / "dropped.json", lambda d: d["stages"][0]["nodes"].remove("op0"))
    code, stdout, _ = run("check", dropped, "--json")
    assert code == 1
    result = json.loads(stdout)
    assert result["valid"] is False and any("op0" in p for p in result["problems"])


def test_check_plan_that_does_not_match_its_profile(case, tmp_path: Path) -> None:  # noqa: ANN001
    renamed = edit_plan(case.plan_path, tmp_path / "renamed.json",
                        lambda d: d["stages"][2]["nodes"].__setitem__(0, "not_a_node"))
    code, stdout, _ = run("check", renamed)
    assert code == 1 and "not_a_node" in stdout and "FAIL" in stdout


@pytest.mark.parametrize("option", ["--tolerance", "--memory-tolerance"])
@pytest.mark.parametrize("tolerance", ["abc", "-2%", "5"])
def test_check_bad_tolerance_is_a_usage_error(case, option: str, tolerance: str) -> None:  # noqa: ANN001
    code, _, stderr = run("check", case.plan_path, option, tolerance)
    assert code == 2
    assert option in one_error_line(stderr)


def test_check_missing_baseline_file(case, tmp_path: Path) -> None:  # noqa: ANN001
    code, _, stderr = run("check", case.plan_path, "--baseline", tmp_path / "gone.json")
    assert code == 1 and "gone.json" in one_error_line(stderr)


# --- diff -----------------------------------------------------------------------------------------

def test_diff_shows_moved_nodes(case, tmp_path: Path) -> None:  # noqa: ANN001
    (tmp_path / "b").mkdir()
    other = write_case(tmp_path / "b", (2, 5))
    code, stdout, _ = run("diff", case.plan_path, other.plan_path)
    assert code == 0 and "moved nodes: 1" in " ".join(stdout.split()) and "op1" in stdout
    code, stdout, _ = run("diff", case.plan_path, other.plan_path, "--json")
    assert code == 0 and json.loads(stdout)["moved_nodes"] == 1


def test_diff_of_identical_plans(case) -> None:  # noqa: ANN001
    code, stdout, _ = run("diff", case.plan_path, case.plan_path)
    assert code == 0 and "identically" in stdout


@pytest.mark.parametrize("command", ["partition", "show", "check", "diff"])
def test_help_has_examples(command: str) -> None:
    code, stdout, _ = run(command, "--help")
    assert code == 0 and "Example" in stdout


def test_brackets_in_paths_are_printed_not_read_as_markup(tmp_path: Path) -> None:
    folder = tmp_path / "run[red]"
    folder.mkdir()
    case = write_case(folder)
    code, stdout, _ = run("check", case.plan_path, "--baseline", case.plan_path)
    assert code == 0 and "[red]" in stdout
    code, stdout, _ = run("show", case.plan_path, "--no-files")
    assert code == 0 and "[red]" in stdout.replace("\n", "")  # the title wraps where the temporary path makes it


def test_show_notes_a_prediction_the_simulation_does_not_reproduce(case, tmp_path: Path) -> None:  # noqa: ANN001
    edited = edit_plan(case.plan_path, tmp_path / "edited.json", lambda d: d["predicted"].update(step_time_s=1.0))
    code, stdout, _ = run("show", edited, "--no-files")
    assert code == 0 and "re-simulated" not in stdout  # nothing simulated, nothing to compare
    code, stdout, _ = run("show", edited)
    assert code == 0 and "re-simulated step time" in " ".join(stdout.split())
    code, stdout, _ = run("show", case.plan_path)
    assert code == 0 and "re-simulated" not in stdout
