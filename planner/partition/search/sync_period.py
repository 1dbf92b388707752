"""The adaptive aggregation interval of the multi-step delayed update method (docs/methods.md), as a pure rule
(docs/sync.md).

Replicas that take ``H`` local steps between aggregations pay one aggregation per ``H`` steps. The method chooses
``H`` as training runs; the rule here combines two sources:

- **cost** (what the run measures): an aggregation exposes ``sync_s`` seconds and a step computes ``compute_s``.
  With ``H`` local steps the aggregation's share of the time is ``sync_s / (H compute_s + sync_s)``; the least
  ``H`` that keeps it at most ``overhead`` is ``H_cost = ceil(sync_s (1 - overhead) / (overhead compute_s))``.
- **progress** (AdaComm: Wang and Joshi, "Adaptive Communication Strategies to Achieve the Best Error-Runtime
  Trade-off in Local-Update SGD", MLSys 2019, Theorem 3 and section 4): as the training loss ``F`` falls, replicas
  should average more often, ``H = ceil(H_0 (F / F_0) ** loss_power)`` with ``loss_power = 1/2``, ``F_0`` the loss
  when the run started adapting.

``H = clamp(ceil(H_cost (F / F_0) ** loss_power), min_period, max_period)``: long intervals while the loss is high
and communication dear, shorter ones as the model approaches a minimum, where local models drift apart fastest
relative to their progress. The planner applies the same rule to its predicted times (``initial_period``) to
write a plan's first interval; the runtime (``planner.runtime.data_parallel.local``) re-applies it every round
to what it measured.

Plain data in and out: no torch, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.errors import UsageError

__all__ = ["AdaptiveRule", "cost_period", "next_period", "initial_period"]


@dataclass(frozen=True)
class AdaptiveRule:
    """The adaptive interval's knobs (``plan run --sync adaptive``; docs/sync.md lists them with their defaults)."""

    overhead: float = 0.1
    """Largest share of the step time the aggregations may take (the cost rule's target)."""
    min_period: int = 2
    """Two by default: one local step in two then runs with no aggregation in flight, which is how the runtime
    measures what a travelling aggregation adds to the compute (docs/sync.md)."""
    max_period: int = 32
    loss_power: float = 0.5
    """AdaComm's exponent: ``H`` shrinks as ``(F / F_0) ** loss_power``."""

    def __post_init__(self) -> None:
        if not 0.0 < self.overhead < 1.0:
            raise UsageError(f"the adaptive rule's overhead must be between 0 and 1, found {self.overhead}; "
                             f"pass a share such as 0.1")
        if not 1 <= self.min_period <= self.max_period:
            raise UsageError(f"the adaptive rule needs 1 <= min_period <= max_period, found {self.min_period} and "
                             f"{self.max_period}; pass bounds such as 1 and 32")
        if self.loss_power < 0:
            raise UsageError(f"the adaptive rule's loss_power must be 0 or more, found {self.loss_power}")

    def clamp(self, period: float) -> int:
        return int(min(max(math.ceil(period - 1e-9), self.min_period), self.max_period))


def cost_period(compute_s: float, sync_s: float, rule: AdaptiveRule) -> float:
    """The least interval keeping an aggregation's share of the time at most ``rule.overhead`` (unclamped)."""
    if sync_s <= 0.0:
        return 1.0
    if compute_s <= 0.0:
        return float(rule.max_period)
    return sync_s * (1.0 - rule.overhead) / (rule.overhead * compute_s)


def next_period(compute_s: float, sync_s: float, loss_start: float | None, loss_now: float | None,
                rule: AdaptiveRule) -> int:
    """The interval for the next aggregations: the cost rule scaled by AdaComm's loss ratio (no loss known: the
    cost rule alone), clamped to the rule's bounds."""
    period = cost_period(compute_s, sync_s, rule)
    if loss_start is not None and loss_now is not None and loss_start > 0.0 and loss_now >= 0.0:
        period *= min(loss_now / loss_start, 1.0) ** rule.loss_power
    return rule.clamp(period)


def initial_period(compute_s: float, sync_s: float, rule: AdaptiveRule | None = None) -> int:
    """The first interval, from the planner's predicted step compute and aggregation times (no loss yet)."""
    return next_period(compute_s, sync_s, None, None, rule or AdaptiveRule())
