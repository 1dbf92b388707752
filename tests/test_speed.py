"""The speed fit separates a device's speed from the cost model's error about the ops it holds (issue 22, point 1).

The bug these catch: a per-device "measured over predicted" estimate takes the op-level error of the stage a
device happens to hold as that device's speed, so the factor jumps when a re-plan moves a mis-profiled tail
to another device (the slow rank read 2.38-2.45 for a true 2.0). The truth here is the simulator under known
device speeds and known op corrections; the emulated slowdowns are used to make the trace, never by the fit.
"""

from __future__ import annotations

import pytest

from planner.partition.model.convert import partition_of
from planner.partition.model.cost import evaluate
from planner.partition.model.problem import build_problem
from planner.partition.search.rebalance import (DeviceRound, RebalanceConfig, RoundStats, decide, initial_state,
                                                observe, settle)
from planner.partition.search.speed import Held, fit_speeds
from planner.runtime.rebalancing.replan import RoundModel, propose
from tests._partition_cases import FREE, chain, cluster

MS = 1e-3


def _predict(device: str, start: int, stop: int) -> float:
    return (stop - start) * MS


def _measure(device: str, start: int, stop: int, slow: float, error: dict[int, float]) -> float:
    """What the device measures for one run of nodes [start, stop): the true op costs times its true speed."""
    return sum(error.get(i, 1.0) * MS for i in range(start, stop)) * slow


def _round(cuts: int, holders: tuple[str, str], speeds: dict[str, float], error: dict[int, float]) -> tuple[Held, ...]:
    first, second = holders
    return (Held(first, 8 * _measure(first, 0, cuts, speeds[first], error), ((0, cuts, 8.0),)),
            Held(second, 8 * _measure(second, cuts, 10, speeds[second], error), ((cuts, 10, 8.0),)))


def test_a_stage_with_a_known_error_moved_between_equal_devices_leaves_both_at_one() -> None:
    """The issue's trace: nodes 5-9 cost 1.3x their profile; the stage holding them moves from b to a."""
    error = {i: 1.3 for i in range(5, 10)}
    speeds = {"a": 1.0, "b": 1.0}
    rounds = [_round(5, ("a", "b"), speeds, error), _round(5, ("b", "a"), speeds, error)]
    fit = fit_speeds(rounds, _predict)
    assert fit.speed == pytest.approx({"a": 1.0, "b": 1.0}, rel=0.05)
    assert fit.corrections == ((0, 5, pytest.approx(1.0, rel=0.05)), (5, 10, pytest.approx(1.3, rel=0.05)))


def test_one_round_reads_the_difference_between_devices_as_speed() -> None:
    """Before any cut moves nothing separates speed from op error: the fit then keeps the rebalancer's signal,
    the ratio of measured over predicted compute between the devices."""
    fit = fit_speeds([_round(5, ("a", "b"), {"a": 1.0, "b": 2.0}, {})], _predict)
    assert fit.speed["b"] / fit.speed["a"] == pytest.approx(2.0, rel=1e-3)
    assert fit.speed["a"] * fit.speed["b"] == pytest.approx(1.0)  # the gauge: geometric mean 1


@pytest.mark.parametrize("slowdown", [1.5, 2.0, 3.0])
def test_the_slow_factor_settles_at_the_true_slowdown_once_a_cut_moves(slowdown: float) -> None:
    """b is slow and holds a tail the profile underestimates by 1.2x; re-plans move the cut towards a."""
    error = {i: 1.2 for i in range(5, 10)}
    speeds = {"a": 1.0, "b": slowdown}
    rounds = []
    for cut in (5, 6, 7, 7):
        rounds.append(_round(cut, ("a", "b"), speeds, error))
    first = fit_speeds(rounds[:1], _predict)
    settled = fit_speeds(rounds, _predict)
    assert first.speed["b"] / first.speed["a"] == pytest.approx(slowdown * 1.2, rel=1e-3)  # error read as speed ...
    assert settled.speed["b"] / settled.speed["a"] == pytest.approx(slowdown, rel=0.10)  # ... until the cut moves


def test_the_fit_is_deterministic_and_round_trips_through_the_state() -> None:
    rounds = [_round(c, ("a", "b"), {"a": 1.0, "b": 2.0}, {7: 1.5}) for c in (5, 6, 8)]
    assert fit_speeds(rounds, _predict) == fit_speeds(list(rounds), _predict)
    state = initial_state(["a", "b"])
    for held in rounds:
        state = observe(state, held, _predict, RebalanceConfig())
    from planner.partition.search.rebalance import RebalanceState

    assert RebalanceState.from_dict(state.to_dict()) == state
    assert len(observe(state, rounds[0], _predict, RebalanceConfig(speed_window=2)).history) == 2


def test_the_loop_learns_speed_and_op_error_and_replans_to_the_oracle() -> None:
    """Closed over the simulator: d1 is 2x slow and the last four blocks cost 1.5x their profile. The loop
    (observe, decide, propose) ends with d1's factor 2x d0's and the plan made with the true speeds and costs."""
    prof, clus = chain(12), cluster(2, bandwidth_Bps=FREE)
    speeds, error = {"d1": 2.0}, ((9, 13, 1.5),)  # nodes 9..12 (node 0 is the input)
    truth = build_problem(prof, clus, microbatches=4, schedule="1f1b", optimizer="sgd", speed_factors=speeds,
                          corrections=error)
    from planner.partition import partition

    plan = partition(prof, clus, method="dp", microbatches=4, schedule="1f1b", optimizer="sgd")
    oracle = partition(prof, clus, method="dp", microbatches=4, schedule="1f1b", optimizer="sgd", speed_factors=speeds,
                       corrections=error)
    model = RoundModel.build(prof, clus, plan)
    config = RebalanceConfig(patience=2)
    state = initial_state(["d0", "d1"])
    for _ in range(10):
        sim = evaluate(truth, partition_of(truth, plan), record_events=False)
        stats = RoundStats(0, 0, 2, sim.step_time_s * 2,
                           tuple(DeviceRound(d, s.busy_s * 2, s.idle_s * 2) for d, s in sorted(sim.devices.items())))
        state = observe(state, model.held(plan, 2, stats.computes()), model.predict_s, config)
        decision = decide(state, stats, model.predicted_compute_s(plan, 2), config)
        if decision.replan:
            new = propose(model, plan, decision.state, method="dp", min_improvement=config.min_improvement,
                          ranks=("d0", "d1"), fixed_order=False).plan
            plan = new if new is not None else plan
        state = settle(decision.state, [(s.device, s.nodes) for s in plan.stages], config)
        if state.converged:
            break
    assert state.converged
    assert [(s.device, s.nodes) for s in plan.stages] == [(s.device, s.nodes) for s in oracle.stages]
    assert state.speed_factors["d1"] / state.speed_factors["d0"] == pytest.approx(2.0, rel=0.10)


def _recorded(day: str = "2026-11-25") -> dict:
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "golden" / "traces" / f"rebalance-{day}.json").read_text())


def _errors(data: dict) -> dict[tuple[str, float, int], float]:
    return {(r["model"], r["slowdown"], r["run"]): _fitted_ratio(data["node_s"][r["model"]], r["rounds"]) /
            r["slowdown"] - 1 for r in data["runs"]}


def _fitted_ratio(node_s: list[float], rounds: list[list[list[object]]]) -> float:
    prefix = [0.0]
    for t in node_s:
        prefix.append(prefix[-1] + t)
    fit = fit_speeds([tuple(Held.from_list(h) for h in held) for held in rounds],
                     lambda device, start, stop: prefix[stop] - prefix[start])
    return fit.speed["cpu1"] / fit.speed["cpu0"]


def test_a_host_that_drifts_between_rounds_is_not_read_as_a_device_or_an_op() -> None:
    """27 recorded runs of the rebalancing bench (3 models x 1.5/2/3 x 3; cpu1 slowed) on a host whose speed
    drifted 10-25% between rounds seconds apart: the rounds' common factor keeps that drift out of the speed
    factors. Without it 8 of 27 final ratios were within 10% of the slowdown, the worst 82% off, and a round in
    which both ranks ran faster took gpt_small's ratio from 2.0 to 3.1 (run 1 at 2x). Here the straggler slept out
    its stretch and the fast rank sped up meanwhile, so the slowdown to be read was more than asked: the count
    within 10% of the asked one is a floor, not the fit's accuracy (9 with the priors of 2026-11-27, 10 before)."""
    errors = _errors(_recorded())
    assert len(errors) == 27
    assert sum(abs(e) <= 0.10 for e in errors.values()) >= 9, errors
    assert max(abs(e) for e in errors.values()) <= 0.65, errors
    assert abs(errors[("gpt_small", 2.0, 1)]) <= 0.25 and abs(errors[("gpt_small", 1.5, 1)]) <= 0.10, errors


def test_a_slowed_rank_that_holds_its_core_is_read_at_its_slowdown() -> None:
    """27 recorded runs of the same bench after the emulated straggler waited out its stretch busy on its core
    (docs/rebalancing.md): asleep, it freed the core and the fast rank sped up, so the slowdown to be read was more
    than asked. The fit reads 22 of 27 final ratios within 10% of the slowdown, none more than 22% off (21 and 35%
    with a constant noise in the drift prior and the correction prior at 0.03)."""
    errors = _errors(_recorded("2026-11-27"))
    assert len(errors) == 27
    assert sum(abs(e) <= 0.10 for e in errors.values()) >= 22, errors
    assert max(abs(e) for e in errors.values()) <= 0.22, errors


def test_compute_read_on_the_cpu_clock_is_read_at_its_slowdown() -> None:
    """27 further runs of the same bench (session of 2026-11-27, night), the ranks' compute on the thread's CPU clock
    (``compute_cpu_s``, what the fit reads on one-thread CPU ranks): 26 final ratios within 10% of the slowdown, none
    more than 11% off. The fit as it was before this trace read 18 of them within 10%, the worst 27% off."""
    errors = _errors(_recorded("2026-11-27-cpu-clock"))
    assert len(errors) == 27
    assert sum(abs(e) <= 0.10 for e in errors.values()) >= 26, errors
    assert max(abs(e) for e in errors.values()) <= 0.11, errors


def test_an_excess_that_never_leaves_the_slowed_rank_is_read_as_speed() -> None:
    """27 runs of the bench the next night (2026-11-28, CPU clock), the same code. resnet_small's re-plans only move
    its cut later, so the slowed rank keeps resnet_small's last stage, which with no slowdown at all computes 6-12%
    more against its prediction than the first stage (docs/rebalancing.md: a stage's speed on this CPU depends on
    what runs around it); that excess never runs on the other rank and is read as speed, 7-13% above the slowdown in
    all 9 runs. gpt_small and unet_small stay within 8% but for one run (unet_small at 3x, 11%). 21 of 27 within
    10%."""
    errors = _errors(_recorded("2026-11-28"))
    assert len(errors) == 27
    assert sum(abs(e) <= 0.10 for e in errors.values()) >= 21, errors
    assert max(abs(e) for e in errors.values()) <= 0.13, errors
    resnet = [e for (model, _, _), e in errors.items() if model == "resnet_small"]
    others = [e for (model, _, _), e in errors.items() if model != "resnet_small"]
    assert min(resnet) > max(0.0, sorted(others)[len(others) // 2]), errors  # all above the others' median


def test_the_first_trace_written_from_the_round_logs_holds_its_floor() -> None:
    """27 runs of the bench on 2026-11-29, the round after a switch judged from its second step: the first trace
    written from the round logs' own record of what the fit took (``held``, by ``scripts/speed_trace.py``), so its
    replay is the runs' fit exactly. gpt_small's 9 are within 7% of the slowdown. resnet_small's are 5% below to 34%
    above (4 of 9 within 10%) and its fitted corrections spread more the larger the slowdown (1.02-1.17 at 1.5x,
    1.24-2.16 at 3x): part of the slow rank's stretch is read as op error on the ranges a re-plan moved.
    unet_small's are 12% below to on the mark (5 of 9). 18 of 27 within 10%: a floor for a better fit to raise."""
    errors = _errors(_recorded("2026-11-29"))
    assert len(errors) == 27
    assert sum(abs(e) <= 0.10 for e in errors.values()) >= 18, errors
    assert max(abs(e) for e in errors.values()) <= 0.34, errors
    assert max(abs(e) for (model, _, _), e in errors.items() if model == "gpt_small") <= 0.08, errors


def test_the_drift_prior_trusts_a_steady_host_and_not_a_drifting_one() -> None:
    from planner.partition.search.speed import DRIFT_PRIOR, MAX_DRIFT_PRIOR, drift_prior

    steady = [_round(5, ("a", "b"), {"a": 1.0, "b": 2.0}, {})] * 3
    assert drift_prior(steady) == MAX_DRIFT_PRIOR
    assert drift_prior(steady[:1]) == DRIFT_PRIOR  # one round of a plan: nothing to measure the drift from
    drifting = [tuple(Held(h.device, h.measured_s * scale, h.ranges) for h in steady[0]) for scale in (1.0, 1.2, 0.9)]
    assert drift_prior(drifting) < 0.1
    # the devices scatter about a steady level (one 5% up while the other is 5% down): noise, not drift
    noisy = [tuple(Held(h.device, h.measured_s * (1 + sign * (-1) ** k * 0.05), h.ranges) for k, h in enumerate(held))
             for sign, held in zip((1, -1, 1), steady)]
    assert drift_prior(noisy) == MAX_DRIFT_PRIOR
    # both at once: the prior weighs the drift against the scatter that comes with it
    both = [tuple(Held(h.device, h.measured_s * scale, h.ranges) for h in held)
            for scale, held in zip((1.0, 1.2, 0.9), noisy)]
    assert drift_prior(drifting) < drift_prior(both) < 1.0


def _probed(held: tuple[Held, ...], speeds: dict[str, float], drift: float) -> tuple[Held, ...]:
    """``held`` on a host running ``drift`` times its usual time, each device then timing the speed probe (1 ms of
    work at speed 1), the round's drift included."""
    scaled = tuple(Held(h.device, h.measured_s * drift, h.ranges) for h in held)
    return scaled + tuple(Held(h.device, MS * speeds[h.device] * drift, (), "matmul-384:cpu") for h in held)


def test_a_probe_separates_speed_from_op_error_where_the_cuts_alone_cannot() -> None:
    """A host that drifts between rounds leaves the fit only how the devices of a round compare: with K cuts seen,
    K ratios against K + 1 corrections and a speed ratio, less a level, so the priors choose. Op errors that differ
    much between atoms (resnet_small's read 0.6-1.4x, docs/rebalancing.md) then pull the ratio off the slowdown; the
    probe every device of one type times measures the speed ratio in every round, whatever the drift."""
    error = {**{i: 0.6 for i in range(3, 7)}, **{i: 1.4 for i in range(7, 10)}}
    speeds = {"a": 1.0, "b": 3.0}
    cuts, drifts = (3, 7, 7, 7, 8, 8), (1.0, 1.25, 0.85, 1.1, 0.8, 1.2)
    rounds = [_round(cut, ("a", "b"), speeds, error) for cut in cuts]
    scaled = [tuple(Held(h.device, h.measured_s * g, h.ranges) for h in held) for held, g in zip(rounds, drifts)]
    without = fit_speeds(scaled, _predict)
    assert abs(without.speed["b"] / without.speed["a"] / 3.0 - 1) > 0.10, without  # the priors chose wrong
    probed = [_probed(held, speeds, g) for held, g in zip(rounds, drifts)]
    fit = fit_speeds(probed, _predict)
    assert fit.speed["b"] / fit.speed["a"] == pytest.approx(3.0, rel=0.02)
    # a probe row round-trips through the state's history and the round log
    assert [Held.from_list(h.to_list()) for h in probed[0]] == list(probed[0])
    assert probed[0][2].to_list() == ["a", MS, [], "matmul-384:cpu"]


def test_a_probe_window_that_ran_slow_on_one_core_moves_the_ratio_little(monkeypatch) -> None:
    """On this host a whole probe window sometimes runs at half speed on one core: one round whose slowed device's
    probe read 2x, the last of four. Huber weights on the probe rows keep the ratio within 6% of the slowdown (+5%);
    plain least squares lets that round pull it 24% off."""
    import planner.partition.search.speed as speed

    error = {i: 1.2 for i in range(5, 10)}
    speeds = {"a": 1.0, "b": 2.0}
    rounds = [_probed(_round(cut, ("a", "b"), speeds, error), speeds, 1.0) for cut in (5, 6, 6, 6)]
    slow = tuple(Held(h.device, h.measured_s * (2.0 if h.probe and h.device == "b" else 1.0), h.ranges, h.probe)
                 for h in rounds[-1])
    rounds[-1] = slow
    robust = fit_speeds(rounds, _predict)
    assert robust.speed["b"] / robust.speed["a"] == pytest.approx(2.0, rel=0.06)
    monkeypatch.setattr(speed, "PROBE_HUBER", float("inf"))
    plain = fit_speeds(rounds, _predict)
    assert plain.speed["b"] / plain.speed["a"] > 2.0 * 1.2


def test_the_drift_prior_reads_the_work_not_the_probes() -> None:
    from planner.partition.search.speed import drift_prior

    rounds = [_round(5, ("a", "b"), {"a": 1.0, "b": 2.0}, {})] * 3
    probed = [held + (Held("a", 5 * MS * (1 + k / 10), (), "p:cpu"),) for k, held in enumerate(rounds)]
    assert drift_prior(probed) == drift_prior(rounds)


def test_the_speed_probe_reads_every_model_at_its_slowdown() -> None:
    """27 runs of the bench on 2026-11-29 at noon, every rank timing the speed probe at each round's start (the round
    logs' held lists its rows): 26 final ratios within 10% of the slowdown, the worst 10.7% off, where the same rounds
    without their probe rows read 19 (the worst 19% off), and the trace of the morning, without a probe, 18. The
    probe rows are what separate speed from op error here, and their Huber weights what keeps a round whose probe
    window ran slow on one core from moving the ratio (26 within 10% without them too, the worst 14% off)."""
    data = _recorded("2026-11-29-probe")
    errors = _errors(data)
    assert len(errors) == 27
    assert sum(abs(e) <= 0.10 for e in errors.values()) >= 26, errors
    assert max(abs(e) for e in errors.values()) <= 0.11, errors
    unprobed = {**data, "runs": [{**r, "rounds": [[h for h in held if len(h) == 3] for held in r["rounds"]]}
                                 for r in data["runs"]]}
    assert sum(abs(e) <= 0.10 for e in _errors(unprobed).values()) <= 20  # without the probe, the priors choose
