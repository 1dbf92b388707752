"""Offline rebalancing against the simulator (seed 003 S3-S6), for placers that take device weights.

- S3: every device starts with a weight, its share of the load: equal (1.0), or the caller's.
- S4: each round partitions with the current weights and simulates one training step; every device
  that holds a stage reports its simulated wait (``idle_s``: step time minus its busy time).
- S5: the round is balanced when ``max wait <= (1 + threshold) * mean wait``. Otherwise weight moves
  in proportion to the waits: ``w_d <- w_d * (1 + gain_k * (wait_d - mean) / mean)`` with
  ``gain_k = gain * decay**k`` in round ``k`` (the factor is clamped to ``[1 / max_step, max_step]``),
  normalised to mean 1, so devices that waited more get more
  work, and the model is partitioned again. Devices without a stage did not train and keep their weight.
- S6: stop when the partition has not changed for ``patience`` rounds, when a round is balanced (the
  weights, and so the deterministic partition, would not change again), or after ``max_rounds``.
  Because a partition moves in whole blocks while weights move continuously, the loop can also
  settle into alternating between a few partitions; "not changed" is therefore read as "no partition
  not seen before for ``patience`` rounds" (``stop: "no new partition"``), which includes the literal
  case (``stop: "unchanged"``). Both count as converged.

The best partition seen (smallest simulated step time; the earlier round on ties) is returned with
the weights that produced it and the record of every round. The same loop runs at training time
from measured waits in ``planner.partition.search.rebalance``.

A placer that ignores weights (``dp``, ``ilp``, the baselines) gets one round: its plan, simulated.
Then the best partition goes through the boundary polish (``planner.partition.search.polish``: local search of
the cuts, stage count and devices against the simulator, taking only moves that lower the simulated
step time and fit in memory), recorded under ``polish``; ``RefineConfig(polish=None)`` leaves it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from planner.errors import PlannerError
from planner.partition.placers.registry import call, takes_weights
from planner.partition.search.polish import PolishConfig, polish
from planner.partition.model.cost import evaluate
from planner.partition.model.problem import Partition, Placed, Problem, facts_of


@dataclass(frozen=True)
class RefineConfig:
    """Knobs of the offline loop."""

    threshold: float = 0.10
    """S5: a round is balanced when the largest wait is at most 10% above the mean wait."""
    gain: float = 0.5
    """S5: fraction of the relative wait difference moved into a device's weight in the first round."""
    decay: float = 0.7
    """The gain shrinks by this factor every round, so weights settle instead of cycling between the
    same few cut sets (the partition moves in whole blocks while weights move continuously)."""
    patience: int = 3
    """S6: stop once no new partition has appeared for this many consecutive rounds."""
    max_rounds: int = 20
    """Hard stop, whatever the balance."""
    max_step: float = 4.0
    """Largest factor by which one round may multiply (or divide) a weight."""
    polish: PolishConfig | None = PolishConfig()
    """The boundary polish run on the best partition (``None``: none)."""

    def __post_init__(self) -> None:
        if not (self.threshold >= 0 and self.gain > 0 and 0 < self.decay <= 1 and self.max_step > 1):
            raise PlannerError(f"refine needs threshold >= 0, gain > 0, 0 < decay <= 1 and max_step > 1, found "
                               f"threshold={self.threshold!r}, gain={self.gain!r}, decay={self.decay!r}, "
                               f"max_step={self.max_step!r}")
        if self.patience < 1 or self.max_rounds < 1:
            raise PlannerError(f"refine needs patience >= 1 and max_rounds >= 1, found {self.patience!r} "
                               f"and {self.max_rounds!r}")


@dataclass(frozen=True)
class RefineResult:
    partition: Partition
    weights: dict[str, float]
    """The weights that produced ``partition``."""
    record: dict[str, Any]
    """``{"rounds": [{round, weights, waits, step_time_s, balanced, changed}], "converged", "stop", ..., "polish"}``."""


def normalise_weights(weights: Mapping[str, float], device_ids: tuple[str, ...]) -> dict[str, float]:
    """Weights for every device (1.0 where absent), checked positive and finite, scaled to mean 1."""
    for device, weight in sorted(weights.items()):
        if device not in device_ids:
            raise PlannerError(f"a weight is given for device {device!r}, which is not in the cluster "
                               f"(devices: {', '.join(device_ids)}); remove it or fix the device id")
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            raise PlannerError(f"the weight of device {device!r} must be a positive finite number, found {weight!r}")
    raw = {d: float(weights.get(d, 1.0)) for d in device_ids}
    total = sum(raw.values())
    return {d: w * len(raw) / total for d, w in raw.items()}


def refine(problem: Problem, method: str, weights: Mapping[str, float], options: Mapping[str, Any],
           config: RefineConfig = RefineConfig()) -> RefineResult:
    """Run the S3-S6 loop with placer ``method`` against the simulator (one round if it ignores weights), then polish."""
    current = normalise_weights(weights, problem.cluster.device_ids)
    rounds = config.max_rounds if takes_weights(method) else 1
    history: list[dict[str, Any]] = []
    best: tuple[float, Partition, dict[str, float]] | None = None
    previous: Partition | None = None
    seen: set[Partition] = set()
    stale, stop = 0, "max_rounds"
    for number in range(rounds):
        partition = call(method, problem, current, options)
        result = evaluate(problem, partition, record_events=False)
        waits = {d: s.idle_s for d, s in result.devices.items()}
        balanced = _balanced(waits, config.threshold)
        changed = partition != previous
        history.append({"round": number, "weights": dict(current), "waits": waits, "step_time_s": result.step_time_s,
                       "balanced": balanced, "changed": changed, "stages": len(partition)})
        if best is None or result.step_time_s < best[0]:
            best = (result.step_time_s, partition, dict(current))
        stale = stale + 1 if partition in seen else 0
        seen.add(partition)
        if balanced or stale >= config.patience:
            stop = "balanced" if balanced else ("unchanged" if not changed else "no new partition")
            break
        current = _move_weights(current, waits, config.gain * config.decay**number, config.max_step)
        previous = partition
    assert best is not None
    if not takes_weights(method):
        stop = "method ignores weights"
    record: dict[str, Any] = {
        "rounds": history, "converged": stop != "max_rounds", "stop": stop,
        "threshold": config.threshold, "gain": config.gain, "decay": config.decay, "patience": config.patience,
        "best_round": next(r["round"] for r in history if r["step_time_s"] == best[0])}
    chosen = best[1]
    if config.polish is not None:
        polished = polish(problem, chosen, config.polish)
        record["polish"] = polished.record
        if polished.partition != tuple(chosen):
            chosen = Placed(polished.partition, facts_of(chosen)) if facts_of(chosen) else polished.partition
    return RefineResult(chosen, best[2], record)


def _balanced(waits: Mapping[str, float], threshold: float) -> bool:
    """S5: the largest wait lies within ``threshold`` of the mean (trivially so for one device or no waits)."""
    if len(waits) < 2:
        return True
    mean = sum(waits.values()) / len(waits)
    return mean <= 0 or max(waits.values()) <= (1 + threshold) * mean


def _move_weights(weights: Mapping[str, float], waits: Mapping[str, float], gain: float,
                  max_step: float) -> dict[str, float]:
    """S5: ``w_d *= 1 + gain * (wait_d - mean) / mean`` for devices that trained, clamped, normalised to mean 1."""
    mean = sum(waits.values()) / len(waits)
    moved = {}
    for device, weight in weights.items():
        if device in waits:
            factor = 1 + gain * (waits[device] - mean) / mean
            weight *= min(max(factor, 1 / max_step), max_step)
        moved[device] = weight
    total = sum(moved.values())
    return {d: w * len(moved) / total for d, w in moved.items()}
