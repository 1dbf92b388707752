"""Speed factors that separate a device's speed from the cost model's error about the ops it holds (pure).

Each round, device ``d`` measures ``M`` seconds of compute for the work it held: node ranges ``[i, j)`` of the
op-granularity profile, each run ``n`` times (micro-batches x steps x row scale). The cost model predicts
``P_d(i, j)`` seconds for one run. The estimator explains every measurement as

    M = g_r * s_d * sum_a c_a * P_d(a) * n_a

where ``s_d`` is the device's speed factor (what the device does differently), ``c_a`` a correction of
the cost model on *atom* ``a`` (the node ranges between any two cuts seen so far, so a stage that moves keeps its
correction and a device keeps its speed), and ``g_r`` the common factor of round ``r``: how much faster or
slower every device ran in that round (a shared host's speed drifts by 10-25% between rounds a few seconds
apart, docs/bench-run.md). With one plan only, a device's own speed and its ops' error cannot be
told apart; each re-plan that moves a cut (or the same ops measured on two devices) adds the equations that
separate them.

The fit is a regularised least squares in log space over the last rounds (Gauss-Newton, a fixed number of
iterations, so it is deterministic):

    min  sum_obs w_obs (log M - log g_r - log s_d - log sum_a c_a P_d(a) n_a)^2
         + lambda_s sum_d (log s_d)^2 + lambda_c sum_a (log c_a - log m)^2 + lambda_g sum_r (log g_r)^2,
    subject to  sum_d log s_d = 0

- The gauge ``sum_d log s_d = 0`` (geometric mean of the speed factors 1) puts the error all devices share into
  the corrections: two devices of equal speed get factor 1 whatever the ops cost.
- ``lambda_s << lambda_c``: where the data cannot tell, a difference between devices is taken as speed (the
  rebalancer's signal, the rebalancing patent), not as op error; ``speed_factors`` then equals the ratio of measured over
  predicted compute between devices, as the per-device estimate before it did.
- The corrections are pulled towards their common level ``m`` (a free parameter), not towards 1: the profile
  may be off by the same factor everywhere (the host, co-location), and every new cut adds an atom, so a
  prior towards 1 would let a small atom absorb the noise of the round in which it appeared.
- ``w_obs = decay ** age``: recent rounds count more, so a device that changes speed is followed.
- ``lambda_g`` is measured (``drift_prior``): the rounds that ran the same plan show how far the host's speed
  drifts between rounds (their levels) and how far each device moves about its round's level (the noise the
  drift does not explain); the ratio of the two variances sets how far the rounds' absolute times are trusted.
  On a steady host a moved cut separates speed from op error exactly (the cut's atom was timed on both
  devices); on a drifting one the factors are read from how the devices of one round differ. Without ``g_r`` a
  host that ran 20% faster in the round after a cut moved took the slow rank's factor from 2.0 to 3.1 (a
  recorded gpt_small run, ``tests/test_speed.py``).

*Probes.* From rounds whose absolute times are not trusted (a drifting host) the fit reads only how the devices of a
round compare, which leaves one unknown too many (``K`` cuts: ``K`` ratios against ``K + 1`` corrections and a speed
ratio, less a common level), and the priors decide. A probe row (``Held.probe``: a fixed kernel every device of one
type runs, timed at the round's start) adds ``log M = log g_r + log s_d + log L_k``, its level ``L_k`` free per probe
and device type, so the speed ratio between devices of one type is measured in every round. Rounds without probes
fit as before.

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

__all__ = ["Held", "SpeedFit", "fit_speeds", "drift_prior", "SPEED_PRIOR", "CORRECTION_PRIOR", "DRIFT_PRIOR",
           "MIN_NOISE", "DECAY", "ITERATIONS", "PROBE_PRIOR", "PROBE_HUBER"]

SPEED_PRIOR = 1e-6
"""``lambda_s``: how strongly a speed factor is pulled to 1 (weak: differences between devices are speed)."""
CORRECTION_PRIOR = 0.05
"""``lambda_c``: how strongly a correction is pulled to the corrections' common level (the profile's shape is
trusted until the data insists: one op range is not made cheap to explain a few percent of noise). Chosen on the
81 recorded rebalancing runs of ``tests/golden/traces/`` whose straggler held its core (docs/rebalancing.md)."""
DECAY = 0.85
"""Weight of a round relative to the next one (``RebalanceConfig.speed_decay``)."""
ITERATIONS = 30
"""Gauss-Newton iterations (fixed, so the fit is deterministic)."""
DRIFT_PRIOR = 0.1
"""``lambda_g`` until the window holds two rounds of one plan (nothing to measure the drift from yet): weak, so a
first moved cut is not read from two rounds' absolute times alone."""
MIN_NOISE = 1e-3
"""Floor of the measured noise (in log units, 0.1%): rounds that differ in level only (every device alike) have no
spread of their own."""
MAX_DRIFT_PRIOR = 1e3
"""``lambda_g`` on a host that does not drift (identical rounds of one plan): the rounds' absolute times are
trusted, and a moved cut separates speed from op error exactly."""
PROBE_HUBER = 0.1
"""Residual (log units, about 10%) beyond which a probe row is down-weighted (Huber): on this shared host a whole
probe window sometimes runs at half speed on one core while the other's runs clean (1 round in 5 or so)."""
PROBE_PRIOR = 1e-6
"""How strongly a probe's level is pulled to 1 (only to keep the fit regular: its seconds are in no model's units)."""
_GAUGE = 1e3
"""Weight of the row that holds the speed factors' geometric mean at 1."""


@dataclass(frozen=True)
class Held:
    """What one device computed in one round and how long it took: its share of the model's work, or a probe."""

    device: str
    measured_s: float
    ranges: tuple[tuple[int, int, float], ...]
    """``(start, stop, runs)``: node indices ``[start, stop)`` of the profile, run ``runs`` times (empty for a
    probe)."""
    probe: str = ""
    """Set for a probe: the name of the fixed kernel the device timed and of the device type it ran on
    (``runtime.timing.speed_probe``). Devices that time the same probe ran the same work, so its seconds differ
    between them by their speed alone."""

    def to_list(self) -> list[object]:
        out: list[object] = [self.device, self.measured_s, [list(r) for r in self.ranges]]
        return out + [self.probe] if self.probe else out

    @staticmethod
    def from_list(data: Sequence[object]) -> "Held":
        device, measured, ranges, *probe = data
        return Held(str(device), float(measured),  # type: ignore[arg-type]
                    tuple((int(a), int(b), float(n)) for a, b, n in ranges),  # type: ignore[union-attr, misc]
                    str(probe[0]) if probe else "")


@dataclass(frozen=True)
class SpeedFit:
    speed: dict[str, float]
    """Per device that held work: its speed factor (geometric mean 1)."""
    corrections: tuple[tuple[int, int, float], ...]
    """``(start, stop, factor)`` per atom: the cost model's correction on nodes ``[start, stop)``."""


def drift_prior(rounds: Sequence[Sequence[Held]]) -> float:
    """``lambda_g = noise / drift``, both measured on the rounds that ran one plan (an empirical-Bayes choice of the
    prior's strength): the *noise* is how each device's log compute moves about its round's mean from round to
    round (what the host's drift, common to all devices, does not explain); the *drift* is how each round's mean log
    compute moves about its plan's mean, less the part the noise puts there. ``DRIFT_PRIOR`` until some plan has run
    twice."""
    groups: dict[tuple[object, ...], list[dict[str, float]]] = {}
    for held in rounds:
        held = [h for h in held if not h.probe]
        logs = {h.device: math.log(h.measured_s) for h in held if h.measured_s > 0}
        if logs:
            groups.setdefault(tuple(sorted((h.device, h.ranges) for h in held)), []).append(logs)
    runs = [v for v in groups.values() if len(v) > 1]
    if not runs:
        return DRIFT_PRIOR
    levels, spreads = [], []  # (value, its mean over the plan's rounds) pairs
    for logs in runs:
        level = [sum(r.values()) / len(r) for r in logs]
        levels += [(x, sum(level) / len(level)) for x in level]
        for device in logs[0]:
            own = [r[device] - m for r, m in zip(logs, level) if device in r]
            spreads += [(x, sum(own) / len(own)) for x in own]
    dof = sum(len(v) - 1 for v in runs)
    devices = max(len(v[0]) for v in runs)
    noise = max(sum((x - m) ** 2 for x, m in spreads) / (dof * devices), MIN_NOISE ** 2)
    drift = max(sum((x - m) ** 2 for x, m in levels) / dof - noise / devices, 1e-12)
    return min(noise / drift, MAX_DRIFT_PRIOR)


def _probes(rounds: Sequence[Sequence[Held]]) -> list[str]:
    return sorted({h.probe for held in rounds for h in held if h.probe})


def _atoms(rounds: Sequence[Sequence[Held]]) -> list[tuple[int, int]]:
    cuts = sorted({x for held in rounds for h in held for a, b, _ in h.ranges for x in (a, b)})
    return list(zip(cuts, cuts[1:]))


def fit_speeds(rounds: Sequence[Sequence[Held]], predict: Callable[[str, int, int], float],
               decay: float = DECAY) -> SpeedFit:
    """Fit speed factors and op-range corrections to ``rounds`` (oldest first); ``predict(device, start, stop)``
    is the cost model's seconds for one run of nodes ``[start, stop)`` on ``device`` (no speed factor)."""
    atoms, probes = _atoms(rounds), _probes(rounds)
    devices = sorted({h.device for held in rounds for h in held})
    if not (atoms or probes) or not devices:
        return SpeedFit({}, ())
    nd, na, nk, nr = len(devices), len(atoms), len(probes), len(rounds)
    # theta: log s per device, log c per atom, the corrections' common level log m, log L per probe, log g per round
    g0 = nd + na + 1 + nk
    first_atom = {a: k for k, (a, _) in enumerate(atoms)}
    rows, logs, weights, owner, when, kernel = [], [], [], [], [], []
    for age, held in enumerate(reversed(rounds)):
        for h in held:
            coeff = np.zeros(na)
            for start, stop, runs in h.ranges:
                for k in range(first_atom[start], na):
                    a, b = atoms[k]
                    if a >= stop:
                        break
                    coeff[k] += runs * predict(h.device, a, b)
            if h.measured_s > 0 and (h.probe or coeff.sum() > 0):
                rows.append(coeff)
                logs.append(math.log(h.measured_s))
                weights.append(decay ** age)
                owner.append(devices.index(h.device))
                when.append(age)
                kernel.append(nd + na + 1 + probes.index(h.probe) if h.probe else -1)
    if not rows:
        return SpeedFit({}, ())
    P, y, w, dev = np.array(rows), np.array(logs), np.sqrt(np.array(weights)), np.array(owner)
    probe_col = np.array(kernel)
    probed = probe_col >= 0
    round_of = g0 + np.array(when)
    theta = np.zeros(g0 + nr)
    # prior rows: sqrt(lambda_s) log s_d; sqrt(lambda_c) (log c_a - log m); sqrt(lambda_g) log g_r; a probe's level
    # is free (the tiny PROBE_PRIOR only keeps the system regular)
    prior = np.zeros((nd + na + nk + nr, g0 + nr))
    prior[:nd, :nd] = math.sqrt(SPEED_PRIOR) * np.eye(nd)
    prior[nd:nd + na, nd:nd + na] = math.sqrt(CORRECTION_PRIOR) * np.eye(na)
    prior[nd:nd + na, nd + na] = -math.sqrt(CORRECTION_PRIOR)
    prior[nd + na:nd + na + nk, nd + na + 1:g0] = math.sqrt(PROBE_PRIOR) * np.eye(nk)
    prior[nd + na + nk:, g0:] = math.sqrt(drift_prior(rounds)) * np.eye(nr)
    gauge = _GAUGE * np.r_[np.ones(nd), np.zeros(na + 1 + nk + nr)][None, :]
    at = np.arange(len(y))
    for _ in range(ITERATIONS):
        c = np.exp(theta[nd:nd + na])
        q = np.where(probed, 1.0, P @ c)
        level = np.where(probed, theta[np.maximum(probe_col, 0)], np.log(q))
        residual = y - theta[dev] - theta[round_of] - level
        jac = np.zeros((len(y), g0 + nr))
        jac[at, dev] = 1.0
        jac[at, round_of] = 1.0
        jac[:, nd:nd + na] = np.where(probed[:, None], 0.0, P * c[None, :] / q[:, None])
        jac[at[probed], probe_col[probed]] = 1.0
        # a probe run that something else on the host slowed is an outlier, not a speed: Huber weights (iteratively
        # re-weighted) let a probe row whose residual exceeds PROBE_HUBER count as if it were that far off only
        robust = w * np.where(probed, np.sqrt(np.minimum(1.0, PROBE_HUBER / np.maximum(np.abs(residual), 1e-12))), 1.0)
        # one linear least squares per iteration: the weighted data, the priors and the gauge
        A = np.vstack([jac * robust[:, None], prior, gauge])
        b = np.r_[residual * robust, -prior @ theta, -gauge @ theta]
        step = np.linalg.lstsq(A, b, rcond=None)[0]
        theta = theta + step
        if float(np.abs(step).max()) < 1e-12:
            break
    speed = {d: float(math.exp(theta[i])) for i, d in enumerate(devices)}
    corrections = tuple((a, b, float(math.exp(theta[nd + k]))) for k, (a, b) in enumerate(atoms))
    return SpeedFit(speed, corrections)
