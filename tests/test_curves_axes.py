"""`plan curves` never draws one run's loss on another run's accuracy axis (issue 23, item 4)."""

from __future__ import annotations

import json
from pathlib import Path

from planner.app.curves import RunCurves, load_run
from planner.report.curves import draw, plotted_series
from planner.runtime.options import Target


def _run(name: str, accuracy: float | None) -> RunCurves:
    evals = ({"step": 4, "wall_s": 1.0, "loss": 2.2, "accuracy": accuracy},) if accuracy is not None else ()
    return RunCurves(name, ((2, 0.5, 2.3), (4, 1.0, 2.2)), evals, None, None, {})


def test_a_run_without_accuracy_goes_to_the_training_loss_axis(tmp_path: Path) -> None:
    metric, series = plotted_series([_run("with", 0.9), _run("without", None)])
    assert metric == "accuracy"
    by_name = {s.run.name: s for s in series}
    assert not by_name["with"].secondary and [p[2] for p in by_name["with"].points] == [0.9]
    assert by_name["without"].secondary and by_name["without"].label == "without (training loss)"
    assert [p[2] for p in by_name["without"].points] == [2.3, 2.2]  # losses, on their own axis
    assert all(Path(p).is_file() for p in draw([_run("with", 0.9), _run("without", None)], tmp_path / "c.png"))


def test_losses_only_share_the_main_axis() -> None:
    metric, series = plotted_series([_run("a", None), _run("b", None)])
    assert metric == "loss" and not any(s.secondary for s in series)


def test_a_summary_keeps_its_own_time_to_target(tmp_path: Path) -> None:
    """The table's time to target is the run's own figure for its own target."""
    summary = {"losses": [2.3, 2.2], "rounds": [{"wall_s": 2.0, "steps": 2}], "target": {"metric": "accuracy",
               "value": 0.5}, "time_to_target_s": 1.82,
               "eval": [{"step": 2, "wall_s": 1.74, "loss": 2.2, "accuracy": 0.6}]}
    (tmp_path / "run.json").write_text(json.dumps(summary))
    assert load_run(tmp_path / "run.json").time_to_target_s == 1.82
    assert load_run(tmp_path / "run.json", Target("accuracy", 0.55)).time_to_target_s == 1.74  # another target


def test_an_accuracy_target_given_in_percent_is_refused_with_the_fraction() -> None:
    import pytest

    from planner.errors import UsageError
    from planner.runtime.options import parse_target

    with pytest.raises(UsageError, match=r"fraction in \(0, 1\].*did you mean accuracy=0.95"):
        parse_target("accuracy=95")
    assert parse_target("accuracy=0.95") == Target("accuracy", 0.95)


def test_option_mistakes_name_the_part_that_is_wrong() -> None:
    """Issue 23, item 5: a negative latency was reported as a bad bandwidth; the --schedule error left out auto."""
    import pytest

    from planner.app.partition import check_settings
    from planner.errors import UsageError
    from planner.runtime.options import parse_link

    with pytest.raises(UsageError, match="latency must be 0 or more seconds.*'-0.5'"):
        parse_link("1e8,-0.5")
    with pytest.raises(UsageError, match="bandwidth must be positive"):
        parse_link("0,0.005")
    with pytest.raises(UsageError, match="expected auto or one of gpipe"):
        check_settings("dp", 8, "zb", "adam")
