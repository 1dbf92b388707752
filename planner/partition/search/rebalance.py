"""Dynamic load balancing between training rounds (the rebalancing patent's S3-S6, docs/methods.md), as a pure algorithm.

Seed 003 gives every device a *weight*, its share of the load, equal at first (S3); each round
trains with the partition made from the current weights and lets every device record how long it
waited (S4); after the round, the maximum and mean wait judge the balance, and when it is off the
weights move in proportion to the waits and the model is re-partitioned (S5); once the partition
has not changed for several rounds the balance is taken as reached (S6).

This module adds one thing the seed leaves implicit: the waits say *that* a device is slow, the
measured compute says *how* slow. The measured compute of the last rounds, set against the cost model's
prediction for the work each device held, is split into a speed factor per device and a correction per
op range (``planner.partition.search.speed``): a stage that moves keeps its correction, a device keeps its
speed, and the re-plan sees both (``Problem.speed_factors``, ``build_problem(corrections=...)``). The
weights then carry only what the speed factors do not explain (see ``placer_weights``), so the two never
count the same slowness twice.

Everything here takes and returns plain data: no torch.distributed, no clock, no files. The
runtime (``planner.runtime.launch.worker``) measures, calls ``decide`` and ``settle`` once per round, and
re-plans through ``replan``.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Callable, Mapping, Sequence

from planner.errors import PlannerError
from planner.partition.search.speed import Held, fit_speeds

__all__ = [
    "DeviceRound", "RoundStats", "RebalanceConfig", "RebalanceState", "Decision",
    "initial_state", "imbalance", "is_balanced", "update_weights", "observe",
    "placer_weights", "decide", "settle", "plan_key", "plans_equal", "plan_fingerprint", "normalise_weights",
]


@dataclass(frozen=True)
class DeviceRound:
    """What one device did over one round (K steps): the one record of it, from a rank's timer
    (``planner.runtime.timing.RankTimer.end_round``, then measured against the round's slowest rank by
    ``stats_from``) or from the simulator (``simulated``)."""

    device: str
    compute_s: float
    """Time spent computing its stages' forward and backward passes (emulated slowdown included)."""
    wait_s: float
    """Time not computing: blocked on receives plus idle in the schedule."""
    recv_s: float = 0.0
    """The part of ``wait_s`` spent blocked on point-to-point receives and sends."""
    post_s: float = 0.0
    """The part of ``wait_s`` spent posting point-to-point sends and receives."""
    update_s: float = 0.0
    """The part of ``wait_s`` spent in the optimizer step."""
    rank: int = -1
    """The rank that measured it (-1: simulated)."""
    wall_s: float = 0.0
    """The rank's own wall time over the round (``wait_s`` is measured against the slowest rank's)."""
    emulated_s: float = 0.0
    """The part of ``compute_s`` slept by ``--emulate-slowdown`` (for tests; the estimator never reads it)."""
    compute_cpu_s: float = 0.0
    """``compute_s`` on the clock the profile timed its ops with (``runtime.timing.compute_cpu_clock``: the thread's
    CPU time on a one-thread CPU rank), the emulated slowdown included; 0 where the rank has no such clock. The
    speed fit reads it (``fitted_compute_s``)."""
    probe_s: float = 0.0
    """The device's time for the speed probe at the round's start (``runtime.timing.speed_probe``, on the clock of
    ``fitted_compute_s``, the emulated slowdown included); 0 where none ran. Not part of ``compute_s``."""

    @property
    def fitted_compute_s(self) -> float:
        """What the speed fit reads as the device's compute: ``compute_cpu_s`` where measured, else ``compute_s``.
        The wall clock around a pass also counts the time other threads took the core meanwhile; on 2 CPU ranks,
        gloo's copies of the boundary tensors took 0.9 ms of each 7.6 ms forward of resnet_small's last stage
        (docs/rebalancing.md), an error of where a stage sits, not of the device or its ops."""
        return self.compute_cpu_s if self.compute_cpu_s > 0 else self.compute_s

    @classmethod
    def simulated(cls, device: str, busy_s: float, idle_s: float) -> "DeviceRound":
        """A simulated step's device as a round: busy time computing, idle time waiting."""
        return cls(device, compute_s=busy_s, wait_s=idle_s)


@dataclass(frozen=True)
class RoundStats:
    """One round as rank 0 gathered it."""

    round: int
    first_step: int
    steps: int
    wall_s: float
    """Wall time of the round (the slowest rank's)."""
    devices: tuple[DeviceRound, ...]

    @property
    def step_time_s(self) -> float:
        return self.wall_s / self.steps if self.steps else 0.0

    def waits(self) -> dict[str, float]:
        return {d.device: d.wait_s for d in self.devices}

    def computes(self) -> dict[str, float]:
        return {d.device: d.compute_s for d in self.devices}


@dataclass(frozen=True)
class RebalanceConfig:
    """Knobs of the loop. Defaults suit rounds of a few steps on a pipeline of a few stages."""

    threshold: float = 0.05
    """A round is unbalanced when (max wait - mean wait) exceeds this fraction of the round's wall time."""
    gain: float = 1.0
    """Fraction of the wait-proportional weight move applied per round (1 = the full move)."""
    patience: int = 3
    """S6: stop rebalancing once the plan has not changed for this many consecutive rounds."""
    min_improvement: float = 0.05
    """Adopt a new plan only if it is predicted at least this fraction faster than the plan in force
    (both judged with the new speed factors); migrating for less is not worth it and breeds flapping."""
    max_step: float = 4.0
    """Bound on the factor by which one round may multiply a weight (guards against a bad round)."""
    speed_decay: float = 0.85
    """Weight of a round in the speed fit relative to the round after it (``speed.fit_speeds``); 1 weighs the
    remembered rounds alike. Speed is a property of the device, not of the plan, so the fit runs across plan
    changes: the rounds before a re-plan are what separate a device's speed from its ops' error."""
    speed_window: int = 8
    """Rounds the speed fit remembers."""
    max_rounds: int = 20
    """Hard stop of the offline loop (``plan partition --refine``); at run time the step count bounds it."""
    spike: float = 1.25
    """At run time, a round whose step takes more than this many times the last judged round's, on the same plan,
    is measured but not judged, once (``is_spike``): a transient (another job on the host, a page-cache flush) is
    not a trend, and a re-plan on it costs a migration and a warm-up. A slowdown that lasts is judged a round later."""

    def __post_init__(self) -> None:
        if not self.threshold >= 0:
            raise PlannerError(f"rebalance threshold must be >= 0, found {self.threshold!r}; try 0.05")
        if not 0 < self.gain <= 1:
            raise PlannerError(f"rebalance gain must be in (0, 1], found {self.gain!r}; try 1.0")
        if self.patience < 1:
            raise PlannerError(f"rebalance patience must be at least 1 round, found {self.patience!r}; try 3")
        if not self.min_improvement >= 0:
            raise PlannerError(f"rebalance min_improvement must be >= 0, found {self.min_improvement!r}; try 0.05")
        if not self.max_step > 1:
            raise PlannerError(f"rebalance max_step must be > 1, found {self.max_step!r}; try 4")
        if not 0 < self.speed_decay <= 1:
            raise PlannerError(f"rebalance speed_decay must be in (0, 1], found {self.speed_decay!r}; try 0.85")
        if self.speed_window < 1:
            raise PlannerError(f"rebalance speed_window must be at least 1 round, found {self.speed_window!r}; try 8")
        if self.max_rounds < 1:
            raise PlannerError(f"rebalance max_rounds must be at least 1, found {self.max_rounds!r}; try 20")
        if not self.spike > 1:
            raise PlannerError(f"rebalance spike must be > 1, found {self.spike!r}; try 1.25")


@dataclass(frozen=True)
class RebalanceState:
    """The loop's memory between rounds."""

    weights: Mapping[str, float]
    """Seed 003 S3: each device's share of the load, mean 1."""
    speed_factors: Mapping[str, float] = field(default_factory=dict)
    """Per device: how much slower than the cost model it computes, relative to the others (geometric mean 1;
    ``speed.fit_speeds``)."""
    corrections: tuple[tuple[int, int, float], ...] = ()
    """``(start, stop, factor)``: the cost model's correction on profile nodes ``[start, stop)``."""
    history: tuple[tuple[Held, ...], ...] = ()
    """The last rounds' measured compute and the work behind it (``speed_window`` rounds), oldest first."""
    stable_rounds: int = 0
    """Consecutive rounds that brought no plan the loop had not had before (S6's "not changed")."""
    seen: tuple[str, ...] = ()
    """Fingerprints (``plan_fingerprint``) of every plan the loop has had: a partition moves in whole blocks
    while weights move continuously, so the loop can alternate between a few plans; returning to one counts
    as no change."""
    rounds: int = 0
    converged: bool = False
    """S6 reached: the loop no longer changes the plan."""

    def to_dict(self) -> dict[str, object]:
        return {"weights": dict(self.weights), "speed_factors": dict(self.speed_factors),
                "corrections": [list(c) for c in self.corrections],
                "history": [[h.to_list() for h in held] for held in self.history],
                "stable_rounds": self.stable_rounds, "rounds": self.rounds, "converged": self.converged,
                "seen": list(self.seen)}

    @staticmethod
    def from_dict(data: Mapping[str, object]) -> "RebalanceState":
        try:
            return RebalanceState(
                weights=MappingProxyType({str(k): float(v) for k, v in dict(data["weights"]).items()}),  # type: ignore[arg-type]
                speed_factors=MappingProxyType({str(k): float(v) for k, v in dict(data.get("speed_factors", {})).items()}),  # type: ignore[arg-type]
                corrections=tuple((int(a), int(b), float(f)) for a, b, f in data.get("corrections", ())),  # type: ignore[union-attr]
                history=tuple(tuple(Held.from_list(h) for h in held) for held in data.get("history", ())),  # type: ignore[union-attr]
                stable_rounds=int(data.get("stable_rounds", 0)),  # type: ignore[arg-type]
                rounds=int(data.get("rounds", 0)),  # type: ignore[arg-type]
                converged=bool(data.get("converged", False)),
                seen=tuple(str(x) for x in data.get("seen", ())),  # type: ignore[union-attr]
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlannerError(f"rebalance state must hold weights, speed_factors, stable_rounds, rounds and "
                               f"converged, found {dict(data)!r} ({exc}); delete the checkpoint to start over") from None


@dataclass(frozen=True)
class Decision:
    """What ``decide`` concluded about one round."""

    state: RebalanceState
    """Updated weights and speed factors (counters untouched until ``settle``)."""
    imbalance: float
    balanced: bool
    replan: bool
    """True when the runtime should ask the placer for a new plan."""
    reason: str


def normalise_weights(weights: Mapping[str, float], device_ids: Sequence[str]) -> dict[str, float]:
    """S3: a weight for every device (1.0 where absent), checked positive and finite, scaled to mean 1.

    The one normaliser: the placers' ``weights``, the offline loop and the runtime all use it.
    """
    if not device_ids:
        raise PlannerError("rebalancing needs at least one device; the plan lists none")
    for device, weight in sorted(weights.items()):
        if device not in device_ids:
            raise PlannerError(f"a weight is given for device {device!r}, which is not one of the devices "
                               f"({', '.join(device_ids)}); remove it or fix the device id")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise PlannerError(f"the weight of device {device!r} must be a positive finite number, found {weight!r}")
    return _normalise({d: float(weights.get(d, 1.0)) for d in device_ids})


def initial_state(device_ids: Sequence[str], plan_weights: Mapping[str, float] | None = None) -> RebalanceState:
    """S3: equal weights, or the plan's own ``weights`` (normalised to mean 1) when it carries them."""
    return RebalanceState(weights=MappingProxyType(normalise_weights(plan_weights or {}, device_ids)))


def imbalance(stats: RoundStats) -> float:
    """S5's balance measure: (max wait - mean wait) / round wall time (0 for one device or an empty round)."""
    waits = [d.wait_s for d in stats.devices]
    if len(waits) < 2 or stats.wall_s <= 0:
        return 0.0
    return (max(waits) - sum(waits) / len(waits)) / stats.wall_s


def is_balanced(stats: RoundStats, threshold: float) -> bool:
    """S5: balanced unless the maximum wait lies more than ``threshold`` (of the round) above the mean."""
    return imbalance(stats) <= threshold


def update_weights(weights: Mapping[str, float], stats: RoundStats, loads: Mapping[str, float],
                   *, gain: float = 1.0, max_step: float = 4.0) -> dict[str, float]:
    """S5: move weight towards the devices that waited, in proportion to their waits.

    A device's target share is the load it actually carried (``loads``: what the plan put on it, e.g. its
    predicted compute, which the plan's cut granularity makes differ from its weight) stretched by
    ``1 + excess_wait / compute``, where the excess is its wait above the smallest wait (the
    pipeline bubble every device pays). Over a round of wall time T with compute c and wait w,
    c + w = T for every device, so the stretched share is proportional to load / compute: the
    device's measured speed. ``gain`` < 1 moves only part of the way. Devices absent from the
    round, or that computed nothing, keep their weight. Result normalised to mean 1.
    """
    rounds = {d.device: d for d in stats.devices}
    min_wait = min((d.wait_s for d in stats.devices), default=0.0)
    active = [d for d in sorted(weights) if d in rounds and rounds[d].compute_s > 0 and loads.get(d, 0.0) > 0]
    total_load = sum(loads[d] for d in active)
    total_weight = sum(weights[d] for d in active)
    targets = {}
    for device in active:
        measured = rounds[device]
        carried = loads[device] / total_load * total_weight  # the share it really had, in weight units
        stretch = 1.0 + (measured.wait_s - min_wait) / measured.compute_s
        targets[device] = carried * min(max(stretch, 1.0 / max_step), max_step)
    scale = total_weight / sum(targets.values()) if targets else 1.0  # active devices keep their total
    out = dict(weights)
    for device, target in targets.items():
        out[device] = weights[device] + gain * (target * scale - weights[device])
    return _normalise(out)


def placer_weights(weights: Mapping[str, float], factors: Mapping[str, float]) -> dict[str, float]:
    """The weights to hand the placer next to the speed factors: the part the factors do not explain.

    A device of speed factor s doing share w of the load is as loaded as the model predicts when
    w is proportional to 1 / s; the residual ``w * s`` (normalised to mean 1) is then 1 for every
    device. Residuals away from 1 come from what the cost model misses (links, schedule effects).
    """
    return _normalise({d: w * factors.get(d, 1.0) for d, w in weights.items()})


def observe(state: RebalanceState, held: Sequence[Held], predict: Callable[[str, int, int], float],
            config: RebalanceConfig) -> RebalanceState:
    """Add one round's measured work to the state and re-fit the speed factors and op corrections
    (``speed.fit_speeds``; ``predict(device, start, stop)``: the cost model's seconds for one run of profile nodes
    ``[start, stop)`` on ``device``, without factors). Devices absent from every remembered round keep theirs."""
    history = (state.history + (tuple(held),))[-config.speed_window:]
    fit = fit_speeds(history, predict, decay=config.speed_decay)
    factors = dict(sorted({**state.speed_factors, **fit.speed}.items()))
    return replace(state, history=history, speed_factors=MappingProxyType(factors), corrections=fit.corrections)


def is_spike(step_s: float, last_judged_s: float | None, spiked_before: bool, config: RebalanceConfig) -> bool:
    """True when a round's step (``step_s``) is a transient to measure but not judge: more than ``config.spike``
    times the last judged round's on the same plan (``last_judged_s``; None after a switch), unless the round before
    was already one (then the slowdown lasts, and it is judged)."""
    return last_judged_s is not None and not spiked_before and step_s > config.spike * last_judged_s


def decide(state: RebalanceState, stats: RoundStats, predicted_compute_s: Mapping[str, float],
           config: RebalanceConfig, intended: Mapping[str, float] | None = None) -> Decision:
    """S5 for one round: judge balance, and move weights when unbalanced (speed factors: ``observe``).

    ``predicted_compute_s``: the cost model's compute for the round's work on each device. ``intended``: the
    load the plan was meant to put on each device, in any unit (``update_weights``' ``loads``); default
    ``predicted_compute_s``, which is what the runtime passes. The offline loop passes the weights it gave the
    placer: there the simulated compute *is* the prediction, and only the placer's rounding to whole blocks
    separates intent from outcome.
    """
    gap = imbalance(stats)
    balanced = gap <= config.threshold
    if state.converged:
        return Decision(state, gap, balanced, False, "converged (S6): plan frozen")
    if balanced:
        return Decision(state, gap, True, False,
                        f"balanced: max wait {gap:.1%} of the round above the mean (threshold {config.threshold:.1%})")
    loads = predicted_compute_s if intended is None else intended
    weights = update_weights(state.weights, stats, loads, gain=config.gain, max_step=config.max_step)
    new_state = replace(state, weights=MappingProxyType(weights))
    return Decision(new_state, gap, False, True,
                    f"unbalanced: max wait {gap:.1%} of the round above the mean (threshold {config.threshold:.1%})")


def settle(state: RebalanceState, plan: Sequence[tuple[str, Sequence[str]]], config: RebalanceConfig) -> RebalanceState:
    """S6 bookkeeping after the round's re-plan (if any), given the plan now in force: a plan the loop has
    had before counts as no change; freeze once ``patience`` rounds in a row brought none."""
    fingerprint = plan_fingerprint(plan)
    new = fingerprint not in state.seen
    stable = 0 if new else state.stable_rounds + 1
    return replace(state, stable_rounds=stable, rounds=state.rounds + 1, seen=state.seen + ((fingerprint,) if new else ()),
                   converged=state.converged or stable >= config.patience)


def plan_key(stages: Sequence[tuple[str, Sequence[str]]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """A comparable form of a plan's placement: (device, nodes) per stage in order."""
    return tuple((device, tuple(nodes)) for device, nodes in stages)


def plans_equal(a: Sequence[tuple[str, Sequence[str]]], b: Sequence[tuple[str, Sequence[str]]]) -> bool:
    return plan_key(a) == plan_key(b)


def plan_fingerprint(stages: Sequence[tuple[str, Sequence[str]]]) -> str:
    """A short stable digest of ``plan_key(stages)`` (what ``RebalanceState.seen`` keeps)."""
    return hashlib.sha256(repr(plan_key(stages)).encode()).hexdigest()[:16]


def _normalise(weights: Mapping[str, float]) -> dict[str, float]:
    total = sum(weights.values())
    if not weights or total <= 0:
        return dict(weights)
    n = len(weights)
    return {d: w * n / total for d, w in sorted(weights.items())}
