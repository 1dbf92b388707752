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
