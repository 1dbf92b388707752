"""The optimizers are built in one place (``planner.optim``) for the runs and for the profile that times their step:
if the two drifted apart, the cost model would charge a step the runs do not take."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.errors import UsageError
from planner.optim import OPTIMIZERS, build_optimizer
from planner.profile.whole_model import UPDATE_OPTIMIZERS
from planner.runtime.pipeline.training import make_optimizer


def _named() -> dict[str, nn.Parameter]:
    torch.manual_seed(0)
    return {"w": nn.Parameter(torch.randn(16, 8)), "b": nn.Parameter(torch.randn(8))}


def _implementation(opt: torch.optim.Optimizer) -> tuple[bool, bool]:
    group = opt.param_groups[0]
    return bool(group.get("fused")), bool(group.get("foreach"))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_profile_times_the_optimizer_the_runs_step(name):
    run = make_optimizer(_named(), name, 1e-3)
    timed = UPDATE_OPTIMIZERS[name](list(_named().values()))
    assert _implementation(run) == _implementation(timed)
    assert type(run) is type(timed)


def test_adam_is_fused_on_cpu_and_sgd_is_foreach():
    assert _implementation(make_optimizer(_named(), "adam", 1e-3)) == (True, False)
    assert _implementation(make_optimizer(_named(), "sgd", 1e-2)) == (False, True)


def test_fused_adam_follows_the_foreach_adam():
    """The fused kernel is a faster route to the same update, not another optimizer."""
    fused, foreach = _named(), _named()
    opt_fused = build_optimizer("adam", fused.values(), 1e-2)
    opt_foreach = torch.optim.Adam(foreach.values(), lr=1e-2, foreach=True)
    for _ in range(10):
        for params, opt in ((fused, opt_fused), (foreach, opt_foreach)):
            opt.zero_grad()
            (params["w"].sum(0) * params["b"]).square().sum().backward()
            opt.step()
    for key in fused:
        torch.testing.assert_close(fused[key], foreach[key], rtol=1e-5, atol=1e-6)
        assert not torch.equal(fused[key], _named()[key])  # the steps moved them


def test_a_stage_without_parameters_still_gets_an_optimizer():
    assert make_optimizer({}, "adam", 1e-3).param_groups[0]["params"][0].numel() == 0


def test_an_unknown_optimizer_is_a_usage_error():
    with pytest.raises(UsageError, match="--optimizer must be one of sgd, adam"):
        make_optimizer(_named(), "lamb", 1e-3)
    with pytest.raises(ValueError, match="no optimizer 'lamb'"):
        build_optimizer("lamb", _named().values(), 1e-3)
