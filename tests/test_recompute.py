"""Activation recomputation chosen per stage: the cost model's figures for a stage that differs from the problem, the
where-needed rule behind ``--recompute auto`` (exact with one stage per device), and the plan's per-stage field."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from _partition_cases import chain, cluster
from planner.errors import InputFileError
from planner.formats.plan import plan_from_dict
from planner.partition import partition as plan_with
from planner.partition.model.convert import build_plan, partition_of
from planner.partition.model.cost import device_memory_bytes, evaluate, stage_fwd_bwd_s, stage_memory_bytes
from planner.partition.model.feasibility import violations
from planner.partition.model.problem import StageSpec, build_problem
from planner.partition.search.recompute import recompute_where_needed

# chain(6): fwd 1 s, bwd 2 s, 10 param bytes, 400 saved bytes and 50 output bytes per op. Adam: 40 static bytes per op.
# 1F1B on 2 stages of 3 ops, 8 micro-batches: stage 0 keeps 2 micro-batches (2400 B), stage 1 one (1200 B); with
# recomputation stage 0 keeps nothing per micro-batch (its input is the data) and 1200 B once.
PROFILE = chain(6, saved=400, out=50)
TIGHT = 3 * 40 + 1200 + 100  # stage 1 fits without recomputation, stage 0 only with it


def problem(recompute: bool, memory_bytes: int = TIGHT):
    return build_problem(PROFILE, cluster(2, memory_bytes=memory_bytes), microbatches=8, schedule="1f1b",
                         recompute=recompute)


def halves(first: bool | None, second: bool | None) -> tuple[StageSpec, ...]:
    return StageSpec(0, 4, "d0", recompute=first), StageSpec(4, 7, "d1", recompute=second)


def test_a_stage_that_differs_from_its_problem_is_priced_as_itself() -> None:
    """The same split, priced from a problem that recomputes everywhere and from one that recomputes nowhere, gives
    the same times and memory once each stage says what it does."""
    for flags in itertools.product((False, True), repeat=2):
        figures = []
        for every in (False, True):
            p = problem(every, memory_bytes=10**9)
            split = halves(*flags)
            figures.append(([stage_fwd_bwd_s(p.tables, st.device, st.start, st.stop, st.recompute) for st in split],
                            [stage_memory_bytes(p, split, i) for i in range(2)], device_memory_bytes(p, split),
                            evaluate(p, split, record_events=False).step_time_s))
        assert figures[0] == figures[1], flags
        times, memory, _, _ = figures[0]
        assert [b for _, b in times] == [6.0 + 3.0 * flags[0], 6.0 + 3.0 * flags[1]]  # the forward again
        assert memory[0] == 120 + (1200 if flags[0] else 2400)
    p = problem(True)
    assert stage_fwd_bwd_s(p.tables, "d0", 1, 4) == (3.0, 9.0)  # None: as the problem prices it


@pytest.mark.parametrize("flags", list(itertools.product((False, True), repeat=4)))
def test_a_device_with_several_recomputing_stages_holds_one_recomputed_forward(flags: tuple[bool, ...]) -> None:
    """Interleaved 1F1B, two stages per device: the simulator's peaks equal the feasibility rule's (a device runs one
    backward at a time, so it holds the largest of its stages' recomputed forwards, not their sum)."""
    p = build_problem(PROFILE, cluster(2, memory_bytes=10**9), microbatches=4, schedule="interleaved-1f1b")
    split = tuple(StageSpec(a, b, f"d{i % 2}", recompute=f) for i, (a, b, f) in
                  enumerate(zip((0, 2, 4, 6), (2, 4, 6, 7), flags)))
    peaks = {d: s.peak_memory_bytes for d, s in evaluate(p, split, record_events=False).devices.items()}
    assert peaks == device_memory_bytes(p, split)


def test_auto_recomputes_only_the_stage_that_needs_it() -> None:
    """Nothing fits without recomputation; with it everywhere everything fits; auto keeps it on stage 0 only, which
    fits and is faster than recomputing both, and the plan records it per stage."""
    tight = cluster(2, memory_bytes=TIGHT)
    with pytest.raises(Exception):
        plan_with(PROFILE, tight, method="dp", microbatches=8, schedule="1f1b")
    every = plan_with(PROFILE, tight, method="dp", microbatches=8, schedule="1f1b", recompute=True)
    auto = plan_with(PROFILE, tight, method="dp", microbatches=8, schedule="1f1b", recompute="auto")
    assert every.recomputed() == (True, True)
    assert auto.recomputed() == (True, False)
    assert [s.to_dict().get("recompute") for s in auto.stages] == ["full", None]
    assert auto.step_time_s < every.step_time_s
    assert auto.peak_memory_bytes <= TIGHT
    again = plan_from_dict(json.loads(json.dumps(auto.to_dict())))
    p = problem(True)
    assert [st.recompute for st in partition_of(p, again)] == [True, False]


@pytest.mark.parametrize("seed", (0, 1, 2, 3, 4, 8, 9, 11))  # draws that fit with recomputation
def test_where_needed_is_the_fastest_subset_that_fits(seed: int) -> None:
    """With one stage per device, no other choice of recomputing stages fits and is faster (all subsets tried), on
    splits and memories drawn at random."""
    import random

    rng = random.Random(seed)
    profile = chain(8, saved=rng.choice((200, 400, 800)), out=50)
    devices = 3
    p = build_problem(profile, cluster(devices, memory_bytes=rng.randrange(1500, 6000)), microbatches=8,
                      schedule=rng.choice(("1f1b", "gpipe")), recompute=True)
    cuts = sorted(rng.sample(range(1, 9), devices - 1))
    split = tuple(StageSpec(a, b, f"d{i}") for i, (a, b) in enumerate(zip([0, *cuts], [*cuts, 9])))
    assert not violations(p, split)  # the draws listed fit with recomputation everywhere
    chosen = recompute_where_needed(p, split)
    best = min(evaluate(p, trial, record_events=False).step_time_s
               for flags in itertools.product((False, True), repeat=devices)
               if not violations(p, trial := tuple(replace(st, recompute=f) for st, f in zip(split, flags))))
    assert not violations(p, chosen)
    assert evaluate(p, chosen, record_events=False).step_time_s == pytest.approx(best, rel=1e-12)


def test_the_plan_field_is_checked_and_earlier_plans_still_read() -> None:
    """A stage's recompute must be "none" or "full" (node lists are refused in one line); the top-level flag of
    earlier versions means every stage."""
    p = problem(True)
    doc = build_plan(p, halves(True, False), method="dp").to_dict()
    assert plan_from_dict(doc).recompute_mode() == "auto"
    legacy = {**doc, "recompute": True, "stages": [{k: v for k, v in s.items() if k != "recompute"}
                                                  for s in doc["stages"]]}
    assert plan_from_dict(legacy).recomputed() == (True, True)
    assert plan_from_dict(legacy).recompute_mode() is True
    for bad in (["op0"], "selective", True):
        broken = json.loads(json.dumps(doc))
        broken["stages"][1]["recompute"] = bad
        with pytest.raises(InputFileError, match=r"stages\[1\]\.recompute"):
            plan_from_dict(broken)
    with pytest.raises(InputFileError, match="'recompute'"):
        plan_from_dict({**doc, "recompute": "yes"})


def test_the_stage_table_marks_the_stages_that_recompute() -> None:
    from rich.console import Console

    from planner.report.table import stage_table

    auto = plan_with(PROFILE, cluster(2, memory_bytes=TIGHT), method="dp", microbatches=8, schedule="1f1b",
                     recompute="auto")
    console = Console(record=True, width=200)
    console.print(stage_table(auto))
    text = console.export_text()
    assert text.count("+AC") == 2  # stage 0's row and the caption's key
    assert "+AC: the stage recomputes its activations" in text


@pytest.mark.parametrize("memory, expect", [(1800, (True, False)), (2400, (True, False)), (2600, (False, False))])
def test_auto_takes_recomputation_where_it_is_faster_than_none(tmp_path, memory: int, expect: tuple[bool, ...]) -> None:
    """A cheap forward (0.2 s against a 2 s backward): without recomputation stage 0 must be short to hold its two
    micro-batches, which slows the pipeline; auto also places with recomputation where needed and keeps the faster,
    up to the memory where the balanced cut fits without it (2600 B) and no recomputation wins again."""
    from planner.app.partition import partition_file
    from planner.formats.profile import save_profile

    save_profile(chain(6, fwd=0.2, bwd=2.0, saved=400, out=50), tmp_path / "profile.json")
    (tmp_path / "cluster.json").write_text(json.dumps(cluster(2, memory_bytes=memory).to_dict()))
    plans = {mode: partition_file(tmp_path / "profile.json", str(tmp_path / "cluster.json"), None, method="dp",
                                  microbatches=8, schedule="1f1b", data_parallel=1, recompute=mode)
             for mode in ("off", "auto")}
    assert plans["auto"].recomputed() == expect
    assert plans["auto"].step_time_s <= plans["off"].step_time_s
    if any(expect):
        assert plans["auto"].step_time_s < 0.9 * plans["off"].step_time_s
        assert plans["auto"].peak_memory_bytes <= memory


@pytest.mark.parametrize("recompute, shown", [(0, "2x1 "), (1, "2x1 +AC1"), (2, "2x1 +AC"), (True, "2x1 +AC")])
def test_the_strategy_table_counts_the_recomputing_stages(recompute, shown: str) -> None:
    """plan train's candidate table: +ACk when k stages of a plan recompute, +AC when all do (and for the every-stage
    flag of earlier versions' summaries)."""
    from rich.console import Console

    from planner.report.render import render_strategy

    row = {"schedule": "1f1b", "microbatches": 8, "stages": 2, "degree": 1, "sync": None, "step_time_s": 1.0,
           "peak_memory_bytes": 1, "memory_fraction": 0.5, "recompute": recompute, "verdict": "chosen"}
    console = Console(record=True, width=200)
    render_strategy(console, {"candidates": [row], "failed": [], "search_s": 0.1}, 1)
    text = console.export_text()
    assert shown.strip() in text and ("+AC" in text) == bool(recompute)


def test_plan_check_recomputes_memory_stage_by_stage() -> None:
    """The check prices each stage as the plan says: the where-needed plan holds; the same plan with its recomputing
    stage edited to keep its activations does not fit, and the check says which device."""
    from planner.partition.validate import validate_plan

    auto = plan_with(PROFILE, cluster(2, memory_bytes=TIGHT), method="dp", microbatches=8, schedule="1f1b",
                     recompute="auto")
    assert auto.recomputed() == (True, False)
    assert validate_plan(auto, PROFILE) == []
    doc = json.loads(json.dumps(auto.to_dict()))
    doc["stages"][0]["recompute"] = "none"
    problems = validate_plan(plan_from_dict(doc), PROFILE)
    assert len(problems) == 1 and "d0" in problems[0], problems
