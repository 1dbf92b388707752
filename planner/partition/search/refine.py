"""Offline rebalancing against the simulator (the rebalancing patent's S3-S6), then the boundary polish.

This is the runtime's loop (``planner.partition.search.rebalance``, the only S3-S6 implementation) fed
with *simulated* rounds instead of measured ones:

- S3: every device starts with a weight, its share of the load: equal, or the caller's.
- S4: each round partitions with the current weights and simulates one training step; every device
  that holds a stage reports its simulated compute (``busy_s``) and wait (``idle_s``), and the round's
  wall time is the step time.
- S5: ``rebalance.decide`` judges the balance with the same threshold as at run time (the largest wait
  above the mean, as a fraction of the round) and moves the weights in proportion to the waits. The
  load each device was meant to carry is the weight the placer was given (the simulated compute is the
  prediction itself, so the speed factors stay 1).
- S6: ``rebalance.settle`` stops the loop once ``patience`` rounds brought no plan it had not had, once a
  round is balanced (the deterministic placer would return the same plan), or after ``max_rounds``.

The best partition seen (smallest simulated step time; the earlier round on ties) is returned with the
weights that produced it and the record of every round. A placer that ignores weights (``dp``, ``ilp``,
the baselines) gets one round. Then the best partition goes through the boundary polish
(``planner.partition.search.polish``), recorded under ``polish``; ``RefineConfig(polish=None)`` leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from planner.partition.model.cost import evaluate
from planner.partition.model.problem import Partition, Placed, Problem, with_facts
from planner.partition.placers.registry import call, takes_weights
from planner.partition.search.polish import PolishConfig, polish
from planner.partition.search.rebalance import (DeviceRound, RebalanceConfig, RoundStats, decide, initial_state,
                                                settle)

__all__ = ["RefineConfig", "RefineResult", "refine"]


@dataclass(frozen=True)
class RefineConfig:
    """The offline loop: the rebalancer's knobs (shared with ``plan run``) and the polish that follows."""

    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    """Threshold, gain, patience, max_step and max_rounds: the same meaning as at run time."""
    polish: PolishConfig | None = PolishConfig()
    """The boundary polish run on the best partition (``None``: none)."""


@dataclass(frozen=True)
class RefineResult:
    partition: Partition
    weights: dict[str, float]
    """The weights that produced ``partition``."""
    record: dict[str, Any]
    """``{"rounds": [{round, weights, waits, step_time_s, balanced, changed}], "converged", "stop", ..., "polish"}``."""


def refine(problem: Problem, method: str, weights: Mapping[str, float], options: Mapping[str, Any],
           config: RefineConfig = RefineConfig()) -> RefineResult:
    """Run the S3-S6 loop with placer ``method`` against the simulator (one round if it ignores weights), then polish."""
    knobs = config.rebalance
    state = initial_state(problem.cluster.device_ids, weights)
    rounds = knobs.max_rounds if takes_weights(method) else 1
    history: list[dict[str, Any]] = []
    best: tuple[float, Partition, dict[str, float]] | None = None
    stop = "max_rounds"
    for number in range(rounds):
        used = dict(state.weights)
        partition = call(method, problem, used, options)
        stats = _simulated_round(problem, partition, number)
        decision = decide(state, stats, stats.computes(), knobs, intended=used)
        state = settle(decision.state, _stages(problem, partition), knobs)
        history.append({"round": number, "weights": used, "waits": stats.waits(), "step_time_s": stats.wall_s,
                        "balanced": decision.balanced, "changed": state.stable_rounds == 0, "stages": len(partition),
                        "reason": decision.reason})
        if best is None or stats.wall_s < best[0]:
            best = (stats.wall_s, partition, used)
        if decision.balanced or state.converged:
            stop = "balanced" if decision.balanced else "no new partition"
            break
    assert best is not None
    if not takes_weights(method):
        stop = "method ignores weights"
    record: dict[str, Any] = {
        "rounds": history, "converged": stop != "max_rounds", "stop": stop,
        "threshold": knobs.threshold, "gain": knobs.gain, "patience": knobs.patience,
        "best_round": next(r["round"] for r in history if r["step_time_s"] == best[0])}
    chosen = best[1]
    if config.polish is not None:
        polished = polish(problem, chosen, config.polish)
        record["polish"] = polished.record
        if polished.partition != tuple(chosen):
            chosen = with_facts(chosen, {}, stages=polished.partition) if isinstance(chosen, Placed) else polished.partition
    return RefineResult(chosen, best[2], record)


def _simulated_round(problem: Problem, partition: Partition, number: int) -> RoundStats:
    """S4 from the simulator: one step of ``partition``, each device's busy and idle time."""
    result = evaluate(problem, partition, record_events=False)
    devices = tuple(DeviceRound.simulated(device, s.busy_s, s.idle_s) for device, s in sorted(result.devices.items()))
    return RoundStats(round=number, first_step=number, steps=1, wall_s=result.step_time_s, devices=devices)


def _stages(problem: Problem, partition: Partition) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The partition as (device, nodes) per stage: the form ``settle`` fingerprints, as the runtime's plans."""
    return tuple((st.device, tuple(n for b in problem.blocks[st.start:st.stop] for n in b.nodes)) for st in partition)
