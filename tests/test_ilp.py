"""The ILP placer: golden optima, its objective equals the step-time formula, status/bound/gap, warm start."""

from __future__ import annotations

import pytest

from _exact_cases import cluster, fast_and_slow, identical_two, memory_bound, problem, small_device_last, FAST
from planner.errors import InfeasibleError, PlannerError
from planner.partition import partition
from planner.partition.placers import ilp
from tests._bruteforce import random_cluster, random_profile
from planner.partition.placers.ilp import ilp_placer, lp_bound_s, solve_ilp
from planner.partition.placers.registry import facts_of
from planner.partition.model.objective import step_time_formula_s
from planner.partition.model.problem import StageSpec, build_problem
from planner.partition.validate import validate_plan


@pytest.mark.parametrize("case,expected", [(identical_two, 30.0), (fast_and_slow, 45.0), (memory_bound, 111.0)])
def test_golden_optima(case, expected: float) -> None:
    result = solve_ilp(case(), gap_rel=1e-9)
    assert result.status == "optimal"
    assert result.objective_s == pytest.approx(expected)
    assert result.bound_s == pytest.approx(expected, rel=1e-6)


def test_memory_bound_leaves_the_fast_device_under_used_and_1f1b_puts_the_small_device_last() -> None:
    result = solve_ilp(memory_bound(), gap_rel=1e-9)
    assert {st.device: st.stop - st.start for st in result.partition} == {"fast0": 1, "slow0": 3}
    last = solve_ilp(small_device_last(), gap_rel=1e-9).partition[-1]
    assert (last.device, last.stop - last.start) == ("tiny", 1)


@pytest.mark.parametrize("seed", range(6))
def test_ilp_objective_equals_the_step_time_formula_of_its_plan(seed: int) -> None:
    prob = build_problem(random_profile(seed, num_nodes=9, skip_prob=0.4), random_cluster(seed, 4),
                         microbatches=2 + seed, schedule=("gpipe", "1f1b")[seed % 2], optimizer="sgd")
    result = solve_ilp(prob, gap_rel=1e-9)
    assert result.solver["ilp_objective_s"] == pytest.approx(step_time_formula_s(prob, result.partition), rel=1e-6)
    assert result.objective_s == pytest.approx(step_time_formula_s(prob, result.partition), rel=1e-12)
    assert lp_bound_s(prob) <= result.objective_s * (1 + 1e-6)


def test_status_bound_and_gap_are_recorded() -> None:
    result = solve_ilp(fast_and_slow(), gap_rel=1e-3, time_limit_s=30)
    record = result.solver
    assert record["name"] == "HiGHS" and record["threads"] == 1 and record["seed"] == 0
    assert record["result"] == "optimal" and record["status"] == "Optimal"
    assert 0 <= record["gap"] <= 1e-3 and record["bound_s"] <= record["objective_s"]


def test_never_worse_than_its_warm_start(monkeypatch: pytest.MonkeyPatch) -> None:
    prob = fast_and_slow()
    start = (StageSpec(0, 2, "slow0"), StageSpec(2, 4, "fast0"))  # latencies (18, 6): 24 + 3 * 18 = 78

    class NoSolution(ilp.HiGHS):  # a solver that stops at once and never sees the warm start
        def callSolver(self, lp) -> None:
            self.start = None
            lp.solverModel.setOptionValue("time_limit", 0.0)
            super().callSolver(lp)

    monkeypatch.setattr(ilp, "HiGHS", NoSolution)
    result = solve_ilp(prob, warm_start=start)
    assert result.status == "warm-start" and result.partition == start
    assert result.objective_s == pytest.approx(78.0)
    assert 0 <= result.gap <= 1 and result.solver["result"] == "warm-start"


def test_warm_start_that_does_not_fit_is_ignored() -> None:
    prob = memory_bound()
    too_big = (StageSpec(0, 3, "fast0"), StageSpec(3, 4, "slow0"))
    assert solve_ilp(prob, warm_start=too_big, gap_rel=1e-9).objective_s == pytest.approx(111.0)


def test_plan_records_the_solver_through_partition() -> None:
    profile, clu = random_profile(1, num_nodes=8), random_cluster(1, 3)
    plan = partition(profile, clu, method="ilp", microbatches=4, schedule="1f1b", optimizer="sgd",
                     time_limit_s=20.0, granularity="layer")
    solver = plan.extra["solver"]
    assert solver["status"] == "Optimal"  # HiGHS proved the formula's optimum ...
    assert solver["result"] == "optimal" or solver["formula_result"] == "optimal"  # ... and the record says so
    assert plan.extra["granularity"] == "layer"
    assert validate_plan(plan, profile) == []


def test_bad_options_and_infeasible_are_one_line_errors() -> None:
    with pytest.raises(PlannerError, match="time-limit"):
        solve_ilp(identical_two(), time_limit_s=0)
    with pytest.raises(PlannerError, match="gap"):
        solve_ilp(identical_two(), gap_rel=1.5)
    with pytest.raises(PlannerError, match="takes time_limit_s"):
        ilp_placer(identical_two(), weights={}, seconds=3)
    with pytest.raises(InfeasibleError) as info:
        solve_ilp(problem([1.0] * 2, cluster(("a", FAST, 1), ("b", FAST, 1)), param_bytes=10))
    assert "\n" not in str(info.value)


def test_model_size_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ilp, "MAX_CANDIDATES", 3)
    with pytest.raises(PlannerError, match="--granularity"):
        solve_ilp(identical_two())


def test_placer_attaches_the_solver_record() -> None:
    placed = ilp_placer(fast_and_slow(), weights={}, warm_start=False, gap_rel=1e-9)
    assert facts_of(placed)["solver"]["result"] == "optimal"
    assert facts_of(placed)["solver"]["objective_s"] == pytest.approx(45.0)


def test_cli_time_limit_and_granularity(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from planner.cli import app
    from planner.formats.profile import save_profile

    profile = save_profile(random_profile(3, num_nodes=10), tmp_path / "p.json")
    out = tmp_path / "plan.json"
    args = ["partition", str(profile), "--cluster", "cpu-2", "--method", "ilp", "--granularity", "layer"]
    result = CliRunner().invoke(app, args + ["--time-limit", "5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    solver = json.loads(out.read_text())["solver"]
    assert solver["time_limit_s"] == 5.0 and solver["result"] == "optimal"
    bad = CliRunner().invoke(app, args + ["--time-limit", "-1"])
    assert bad.exit_code == 2 and "--time-limit must be positive" in bad.output
    wrong = CliRunner().invoke(app, ["partition", str(profile), "--cluster", "cpu-2", "--granularity", "depth:x"])
    assert wrong.exit_code == 2 and "depth:N needs a positive integer" in wrong.output


def test_optimal_means_within_the_tolerances_highs_stopped_by() -> None:
    """A gap_rel below what HiGHS resolves (1e-9) still yields "optimal" when HiGHS proved its optimum:
    the classification uses the tolerances read back from the solver, which the record names."""
    profile = random_profile(4, num_nodes=9, skip_prob=0.4)
    problem = build_problem(profile, random_cluster(4, 4, mem_range=(40, 300)), microbatches=6,
                            schedule="gpipe", optimizer="sgd")
    solved = solve_ilp(problem, gap_rel=1e-9)
    tolerances = solved.solver["tolerances"]
    assert set(tolerances) == {"mip_rel_gap", "mip_abs_gap", "mip_feasibility_tolerance", "abs_gap_s"}
    assert tolerances["mip_rel_gap"] == 1e-9
    assert solved.status == "optimal"
    assert solved.objective_s - solved.bound_s <= tolerances["abs_gap_s"] or solved.gap <= 1e-9
