"""Speed factors that separate a device's speed from the cost model's error about the ops it holds (pure).

Each round, device ``d`` measures ``M`` seconds of compute for the work it held: node ranges ``[i, j)`` of the
op-granularity profile, each run ``n`` times (micro-batches x steps x row scale). The cost model predicts
``P_d(i, j)`` seconds for one run. The estimator explains every measurement as

    M = s_d * sum_a c_a * P_d(a) * n_a

where ``s_d`` is the device's speed factor (what the device does differently) and ``c_a`` a correction of the
cost model on *atom* ``a``: the node ranges between any two cuts seen so far, so a stage that moves keeps its
correction and a device keeps its speed. With one plan only, a device's own speed and its ops' error cannot be
told apart; each re-plan that moves a cut (or the same ops measured on two devices) adds the equations that
separate them.

The fit is a regularised least squares in log space over the last rounds (Gauss-Newton, a fixed number of
iterations, so it is deterministic):

    min  sum_obs w_obs (log M - log s_d - log sum_a c_a P_d(a) n_a)^2
         + lambda_s sum_d (log s_d)^2 + lambda_c sum_a (log c_a - log m)^2,   subject to  sum_d log s_d = 0

- The gauge ``sum_d log s_d = 0`` (geometric mean of the speed factors 1) puts the error all devices share into
  the corrections: two devices of equal speed get factor 1 whatever the ops cost.
- ``lambda_s << lambda_c``: where the data cannot tell, a difference between devices is taken as speed (the
  rebalancer's signal, the rebalancing patent), not as op error; ``speed_factors`` then equals the ratio of measured over
  predicted compute between devices, as the per-device estimate before it did.
- The corrections are pulled towards their common level ``m`` (a free parameter), not towards 1: the profile
  may be off by the same factor everywhere (the host, co-location), and every new cut adds an atom, so a
  prior towards 1 would let a small atom absorb the noise of the round in which it appeared.
- ``w_obs = decay ** age``: recent rounds count more, so a device that changes speed is followed.

This is the alternating speed/work decomposition that heterogeneity-aware schedulers fit from throughput
observations (Gavel, Narayanan et al., OSDI 2020, fits job x accelerator throughputs; Cannikin, Zhang et al.,
EuroSys 2024, fits per-node compute models from measured iterations), reduced here to one factor per device
and one per op range, with the cut points as the only structure. docs/rebalancing.md explains its use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

__all__ = ["Held", "SpeedFit", "fit_speeds", "SPEED_PRIOR", "CORRECTION_PRIOR", "DECAY", "ITERATIONS"]

SPEED_PRIOR = 1e-6
"""``lambda_s``: how strongly a speed factor is pulled to 1 (weak: differences between devices are speed)."""
CORRECTION_PRIOR = 0.03
"""``lambda_c``: how strongly a correction is pulled to the corrections' common level (the profile's shape is
trusted until the data insists: one op range is not made cheap to explain a few percent of noise)."""
DECAY = 0.85
"""Weight of a round relative to the next one (``RebalanceConfig.speed_decay``)."""
ITERATIONS = 30
"""Gauss-Newton iterations (fixed, so the fit is deterministic)."""
_GAUGE = 1e3
"""Weight of the row that holds the speed factors' geometric mean at 1."""


@dataclass(frozen=True)
class Held:
    """What one device computed in one round and how long it took."""

    device: str
    measured_s: float
    ranges: tuple[tuple[int, int, float], ...]
    """``(start, stop, runs)``: node indices ``[start, stop)`` of the profile, run ``runs`` times."""

    def to_list(self) -> list[object]:
        return [self.device, self.measured_s, [list(r) for r in self.ranges]]

    @staticmethod
    def from_list(data: Sequence[object]) -> "Held":
        device, measured, ranges = data
        return Held(str(device), float(measured),  # type: ignore[arg-type]
                    tuple((int(a), int(b), float(n)) for a, b, n in ranges))  # type: ignore[union-attr, misc]


@dataclass(frozen=True)
class SpeedFit:
    speed: dict[str, float]
    """Per device that held work: its speed factor (geometric mean 1)."""
    corrections: tuple[tuple[int, int, float], ...]
    """``(start, stop, factor)`` per atom: the cost model's correction on nodes ``[start, stop)``."""


def _atoms(rounds: Sequence[Sequence[Held]]) -> list[tuple[int, int]]:
    cuts = sorted({x for held in rounds for h in held for a, b, _ in h.ranges for x in (a, b)})
    return list(zip(cuts, cuts[1:]))


def fit_speeds(rounds: Sequence[Sequence[Held]], predict: Callable[[str, int, int], float],
               decay: float = DECAY) -> SpeedFit:
    """Fit speed factors and op-range corrections to ``rounds`` (oldest first); ``predict(device, start, stop)``
    is the cost model's seconds for one run of nodes ``[start, stop)`` on ``device`` (no speed factor)."""
    atoms = _atoms(rounds)
    devices = sorted({h.device for held in rounds for h in held})
    if not atoms or not devices:
        return SpeedFit({}, ())
    first_atom = {a: k for k, (a, _) in enumerate(atoms)}
    rows, logs, weights, owner = [], [], [], []
    for age, held in enumerate(reversed(rounds)):
        for h in held:
            coeff = np.zeros(len(atoms))
            for start, stop, runs in h.ranges:
                for k in range(first_atom[start], len(atoms)):
                    a, b = atoms[k]
                    if a >= stop:
                        break
                    coeff[k] += runs * predict(h.device, a, b)
            if h.measured_s > 0 and coeff.sum() > 0:
                rows.append(coeff)
                logs.append(math.log(h.measured_s))
                weights.append(decay ** age)
                owner.append(devices.index(h.device))
    if not rows:
        return SpeedFit({}, ())
    P, y, w, dev = np.array(rows), np.array(logs), np.sqrt(np.array(weights)), np.array(owner)
    nd, na = len(devices), len(atoms)
    theta = np.zeros(nd + na + 1)  # log s per device, log c per atom, and the corrections' common level log m
    prior = np.zeros((nd + na, nd + na + 1))  # rows: sqrt(lambda_s) log s_d; sqrt(lambda_c) (log c_a - log m)
    prior[:nd, :nd] = math.sqrt(SPEED_PRIOR) * np.eye(nd)
    prior[nd:, nd:nd + na] = math.sqrt(CORRECTION_PRIOR) * np.eye(na)
    prior[nd:, -1] = -math.sqrt(CORRECTION_PRIOR)
    gauge = _GAUGE * np.r_[np.ones(nd), np.zeros(na + 1)][None, :]
    for _ in range(ITERATIONS):
        c = np.exp(theta[nd:nd + na])
        q = P @ c
        residual = y - theta[dev] - np.log(q)
        jac = np.zeros((len(y), nd + na + 1))
        jac[np.arange(len(y)), dev] = 1.0
        jac[:, nd:nd + na] = P * c[None, :] / q[:, None]
        # one linear least squares per iteration: the weighted data, the priors and the gauge
        A = np.vstack([jac * w[:, None], prior, gauge])
        b = np.r_[residual * w, -prior @ theta, -gauge @ theta]
        step = np.linalg.lstsq(A, b, rcond=None)[0]
        theta = theta + step
        if float(np.abs(step).max()) < 1e-12:
            break
    speed = {d: float(math.exp(theta[i])) for i, d in enumerate(devices)}
    corrections = tuple((a, b, float(math.exp(theta[nd + k]))) for k, (a, b) in enumerate(atoms))
    return SpeedFit(speed, corrections)
