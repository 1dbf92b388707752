"""Rebalancing at run time: parameters and optimizer state follow their ops to the new owner."""

from __future__ import annotations

import pytest
import torch

from tests._gloo import run_ranks

NAMES = ["a", "b", "c", "tied"]
BEFORE = [["a", "b", "tied"], ["c", "tied"]]
AFTER = [["a"], ["b", "c", "tied"]]


def _model() -> dict[str, torch.nn.Parameter]:
    torch.manual_seed(0)
    return {n: torch.nn.Parameter(torch.randn(3, 2)) for n in NAMES}


def _migrate(rank: int, world: int) -> None:
    from planner.runtime.migrate import load_optimizer_state, migrate, optimizer_state_by_name

    params = _model()
    name_of = {id(p): n for n, p in params.items()}
    owned = [params[n] for n in BEFORE[rank]]
    opt = torch.optim.Adam(owned, lr=0.1)
    # Train the owned copy a little so its values and Adam moments differ from the fresh model's.
    for k in range(3):
        loss = sum(((p - k) ** 2).sum() for p in owned)
        loss.backward()
        opt.step()
        opt.zero_grad()
    expected = {n: params[n].detach().clone() for n in BEFORE[rank]}
    state = optimizer_state_by_name([opt], name_of)
    new_state, report = migrate(rank, params, BEFORE[rank], AFTER[rank], state)
    new_opt = torch.optim.Adam([params[n] for n in AFTER[rank]], lr=0.1)
    assert load_optimizer_state([new_opt], new_state, name_of) == len(AFTER[rank])
    # Everyone publishes what it owns now; the values must be the previous owners' trained values.
    everyone: list = [None] * world
    mine = {n: (params[n].detach().clone(), {k: v.clone() for k, v in new_state[n].items()}) for n in AFTER[rank]}
    torch.distributed.all_gather_object(everyone, (expected, mine, report.moved, report.sent_bytes))
    if rank == 1:
        trained = {**everyone[1][0], **everyone[0][0]}  # rank 0 is the lowest previous owner of "tied"
        for n, (value, st) in everyone[1][1].items():
            assert torch.equal(value, trained[n]), n
            assert float(st["step"]) == 3.0 and st["exp_avg"].abs().sum() > 0
        assert everyone[0][2] == everyone[1][2] == 1  # only "b" moves (1 -> rank 1 already had "tied")
        assert everyone[0][3] == 3 * 6 * 4 + 4  # b: value, exp_avg, exp_avg_sq (float32) and the step scalar


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_migration_moves_values_and_optimizer_state_to_the_new_owner() -> None:
    run_ranks(_migrate, 2, timeout_s=100)


def _round_end(rank: int, world: int) -> None:
    from planner.runtime import netem
    from planner.runtime.launch.worker import exchange_rows
    from planner.runtime.rebalancing.hooks import _share_decision

    with netem.instrument(netem.Traffic()) as traffic:
        rows = exchange_rows([float(rank), 10.0 + rank, -1.0])
        assert rows == [(0.0, 10.0, -1.0), (1.0, 11.0, -1.0)]  # every rank's row, by rank, on every rank
        after_exchange = traffic.bytes_sent
        assert after_exchange == 3 * 8  # one all-gather of three float64s: what a round's end costs besides the flag
        decision = {"plan": None, "state": {"rounds": 4}, "imbalance": 0.0} if rank == 0 else None
        plan, state = _share_decision(decision, with_state=False)
        assert plan is None and state == ({"rounds": 4} if rank == 0 else None)
        if rank == 0:  # a round that keeps its plan and saves nothing broadcasts one float64, no object
            assert traffic.bytes_sent - after_exchange == 8
        plan, state = _share_decision(decision, with_state=True)  # a checkpoint round: every rank saves the state
        assert plan is None and state == {"rounds": 4}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_round_that_keeps_its_plan_ends_with_one_exchange_and_one_number() -> None:
    run_ranks(_round_end, 2, timeout_s=100)


@pytest.fixture(scope="module")
def plans(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests._runtime_jobs import make_plans

    return make_plans(tmp_path_factory.mktemp("rebalance"))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_slowed_rank_triggers_a_replan_that_migrates_and_keeps_training_exact(plans: dict) -> None:
    import json

    from tests._runtime_jobs import job, reference_losses

    log, final = plans["root"] / "rounds.jsonl", plans["root"] / "final.json"
    # Rank 1 computes 3x slower; the re-plan (a test placer that moves blocks.1.attn to cpu0) relieves it.
    options = {"emulate_slowdown": "1=3.0", "log": str(log), "output": str(final), "replan_method": "test-shift",
               "patience": 1}
    env = {"PLANNER_TEST_HOOKS": "tests._shift_placer:hooks", "PLANNER_TEST_CUT": str(plans["cuts"]["c"])}
    code, summary, _ = job(plans["a"], 8, options, env=env)
    assert code == 0, summary
    rounds = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    assert "warm-up" in rounds[0]["reason"] and not rounds[0]["plan_changed"]
    assert not rounds[1]["balanced"] and rounds[1]["plan_changed"] and rounds[1]["moved_tensors"] > 0
    assert rounds[1]["devices"]["cpu1"]["speed_factor"] > rounds[1]["devices"]["cpu0"]["speed_factor"]
    assert rounds[1]["devices"]["cpu0"]["weight"] > rounds[1]["devices"]["cpu1"]["weight"]
    # The round after the switch (steps 4-5) is judged from its second step: its first built the new stages.
    assert "second step" in rounds[2]["reason"] and (rounds[2]["first_step"], rounds[2]["steps"]) == (5, 1)
    assert not rounds[2]["plan_changed"] and rounds[2]["converged"]  # patience 1: S6 after one stable round
    assert not rounds[3]["plan_changed"] and (rounds[3]["first_step"], rounds[3]["steps"]) == (6, 2)
    # What the speed fit took from each judged round is logged (a bench's log is a trace for tests/test_speed.py).
    # (rounds 1 and 2 follow no judged round on their plan, so neither can be a transient, which the fit skips)
    # Each judged round: both ranks' work, then both ranks' speed probe (timed at the round's start; no ranges).
    assert rounds[0]["held"] is None and all(len(r["held"]) == 4 for r in rounds[1:3])
    for r in rounds[1:3]:
        assert [(h[0], h[2], h[3]) for h in r["held"][2:]] == [("cpu0", [], "matmul-384:cpu"),
                                                                ("cpu1", [], "matmul-384:cpu")]
        assert all(h[1] > 0 for h in r["held"]) and all(d["probe_s"] > 0 for d in r["devices"].values())
    first = {device: ranges for device, _, ranges in rounds[1]["held"][:2]}
    assert first["cpu0"][0][0] == 0 and first["cpu0"][-1][1] == first["cpu1"][0][0]  # the cut, from node 0 on
    for r in rounds:
        assert set(r["devices"]) == {"cpu0", "cpu1"} and r["step_time_s"] > 0
    written = json.loads(final.read_text())
    assert len(written["stages"][0]["nodes"]) == plans["cuts"]["c"]
    assert written["device_ranks"] == ["cpu0", "cpu1"] and written["rebalance"]["converged"]
    # Moving parameters and Adam state mid-run changes nothing in the arithmetic.
    assert summary["losses"] == pytest.approx(reference_losses(plans["a"], 8), rel=1e-5, abs=1e-6)
