"""Weight versions of the asynchronous pipeline (``asynchronous.py``): stashing and weight prediction.

A ``Version`` is a snapshot of a stage's weights that micro-batches in flight keep reading while the live weights
step on; ``predict_weights`` extrapolates one by its known delay (docs/async.md). Apart from the engine because
``plan profile`` times one update's worth of this work on the model (``planner.profile.whole_model.measure_versions``)
for the cost model, with the same functions the engine runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

__all__ = ["Version", "predict_weights", "version_work"]


@dataclass
class Version:
    """One version of a stage's weights: detached tensors (by canonical name) and the step that made it."""

    index: int
    weights: dict[str, torch.Tensor]
    delta: dict[str, torch.Tensor] | None
    """``weights - previous version``: the optimizer's last step (None for version 0)."""
    users: int = 0
    """Micro-batches in flight whose forward used this version."""
    predicted: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """``tau -> W + tau * delta``, made once per staleness and kept as long as the version."""

    @classmethod
    def of(cls, index: int, params: Mapping[str, torch.Tensor], previous: Version | None,
           delta: Mapping[str, torch.Tensor] | None = None) -> Version:
        """A snapshot of ``params`` as version ``index``, its delta taken against ``previous`` unless given (the
        optimizer's own step, when something else moved the weights too)."""
        weights = {c: p.detach().clone().requires_grad_(True) for c, p in params.items()}
        if delta is None and previous is not None:
            with torch.no_grad():
                delta = dict(zip(weights, torch._foreach_sub(list(weights.values()), list(previous.weights.values()))))
        return cls(index, weights, dict(delta) if delta is not None else None)


def predict_weights(version: Version, tau: int) -> dict[str, torch.Tensor]:
    """The weights a forward of staleness ``tau`` runs on under weight prediction: ``W + tau * delta``, the version
    extrapolated along the optimizer's last step (docs/async.md, ``asynchronous``'s module docstring)."""
    if tau <= 0 or version.delta is None:
        return version.weights
    if tau not in version.predicted:
        names = list(version.weights)
        with torch.no_grad():  # one fused sweep over the stage's tensors
            moved = torch._foreach_add([version.weights[n] for n in names], [version.delta[n] for n in names],
                                       alpha=tau)
        version.predicted[tau] = {n: w.requires_grad_(version.weights[n].requires_grad) for n, w in zip(names, moved)}
    return version.predicted[tau]


def version_work(params: Mapping[str, torch.Tensor], accumulators: list[torch.Tensor], previous: Version) -> Version:
    """One update's version bookkeeping beside the optimizer's step, as the engine does it under weight
    prediction: the new version's snapshot and delta, its predicted copy for one update of delay, and the gradient
    accumulators zeroed for the next step (``AsyncEngine._update``, ``_fresh_accumulators``, ``_forward``)."""
    version = Version.of(previous.index + 1, params, previous)
    predict_weights(version, 1)
    if accumulators:
        torch._foreach_zero_(accumulators)
    return version
