"""Test-only placer ``test-shift``: two stages cut at ``PLANNER_TEST_CUT`` (a block index) on the problem's first two
devices (cpu0, cpu1 of cpu-2; for a hybrid re-plan, the first two of each replica pipeline's sub-problem).

Loaded into the ranks as an extra run hook (``tests._shift_placer:hooks``), so a rebalancing test can
force a known re-plan and check that migration keeps training exact.
"""

from __future__ import annotations

import os
from typing import Any

from planner.partition.placers.registry import register
from planner.partition.model.problem import Partition, Problem, StageSpec
from planner.runtime.launch.config import RunConfig, RunHooks


def shift(problem: Problem, *, weights: Any = None, **options: Any) -> Partition:
    cut = int(os.environ["PLANNER_TEST_CUT"])
    first, second = problem.cluster.device_ids[:2]
    return (StageSpec(0, cut, first), StageSpec(cut, len(problem.blocks), second))


register("test-shift", shift)


def hooks(config: RunConfig) -> RunHooks:
    return RunHooks()
