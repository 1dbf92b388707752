"""Probe what the pipeline runtime itself adds to every pass: ``Cluster.pass_overhead_s``.

Each forward or backward pass of a stage under ``torch.distributed.pipelining`` costs more than its
ops and its bytes: the schedule's Python, preparing the stage's inputs and outputs, posting the
point-to-point operations and completing them. On GPUs most of it hides behind kernels; on CPU ranks
it is on the critical path, and for a step of a few tenths of a second it is several percent.

The probe runs this very runtime (``planner.runtime.stages``) on ranks 0 and 1: a 2-stage 1F1B
pipeline of a 4-layer, 16-wide MLP (negligible compute and bytes), ``PROBE_MICROBATCHES``
micro-batches, the median of ``PROBE_STEPS`` steps after a warm-up. The overhead is the per-pass
figure ``o`` that makes the simulator (``planner.partition.simulate``), fed with the ranks' measured
compute and the probed link, predict the measured step: found by bisection, as the simulated step
grows monotonically with ``o``. Every rank of the job must call :func:`probe_pass_overhead`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from planner.formats.cluster import Cluster, Device, Link
from planner.formats.plan import Plan, Stage
from planner.partition.simulate import SimStage, simulate

__all__ = ["PROBE_MICROBATCHES", "PROBE_STEPS", "TinyRun", "fit_pass_overhead", "probe_pass_overhead"]

PROBE_MICROBATCHES = 8
PROBE_STEPS = 15
WARMUP_STEPS = 3
WIDTH = 16
ROWS = 4


@dataclass(frozen=True)
class TinyRun:
    """What the two probe ranks measured: the median step and each rank's compute per step."""

    step_s: float
    compute_s: tuple[float, float]
    """Per rank (0, 1): seconds in the stage's forward and backward passes per step."""
    message_bytes: int
    """Bytes of one activation (and one gradient) between the stages, per micro-batch."""


def fit_pass_overhead(run: TinyRun, link: Link, microbatches: int = PROBE_MICROBATCHES) -> float:
    """The per-pass overhead that makes the simulated 1F1B step of ``run``'s pipeline equal its measured step.

    0 when the simulator already predicts the measured step without one."""
    per_pass = [c / (2 * microbatches) for c in run.compute_s]
    stages = [SimStage("a", per_pass[0], per_pass[0], run.message_bytes, 0, 0, 0),
              SimStage("b", per_pass[1], per_pass[1], 0, run.message_bytes, 0, 0)]

    def step(overhead: float) -> float:
        cluster = Cluster("probe", (Device("a", "probe", "h", 1), Device("b", "probe", "h", 1)), link, link,
                          pass_overhead_s=overhead)
        return simulate(stages, cluster, "1f1b", microbatches, record_events=False).step_time_s

    low, high = 0.0, run.step_s / (2 * microbatches)
    if step(low) >= run.step_s:
        return 0.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < run.step_s else (low, mid)
    return (low + high) / 2


def probe_pass_overhead(rank: int, device: torch.device, link: Link) -> float:
    """Run the tiny pipeline on ranks 0 and 1 and return the fitted overhead (the same on every rank)."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])  # every rank takes part in creating it
    mine = _run_tiny(rank, device, group) if rank in (0, 1) else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    (step0, compute0, nbytes), (step1, compute1, _) = gathered[0], gathered[1]
    run = TinyRun(max(step0, step1), (compute0, compute1), nbytes)
    return fit_pass_overhead(run, link)


def _run_tiny(rank: int, device: torch.device, group: Any) -> tuple[float, float, int]:
    """This rank's half of the tiny pipeline: (median step seconds, compute seconds per step, message bytes)."""
    import torch.distributed as dist

    from planner.profile.capture import capture
    from planner.runtime.stages import build_rank_stages, build_schedule
    from planner.runtime.timing import RankTimer, instrument_stage

    torch.manual_seed(0)
    module = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(4))).to(device)
    example = torch.randn(ROWS, WIDTH, device=device)
    captured = capture(module, (example,), "auto")
    names = [op.name for op in captured.ops]
    half = len(names) // 2
    plan = Plan("probe", "1f1b", PROBE_MICROBATCHES,
                (Stage(0, "rank0", tuple(names[:half])), Stage(1, "rank1", tuple(names[half:]))),
                {"step_time_s": 0.0}, {"device_ranks": ["rank0", "rank1"]})
    stages = build_rank_stages(captured, module, plan, rank, device, group)
    schedule = build_schedule(stages, lambda out, target: ((out - target) ** 2).mean())
    batch = torch.randn(ROWS * PROBE_MICROBATCHES, WIDTH, device=device)
    target = torch.randn(ROWS * PROBE_MICROBATCHES, WIDTH, device=device)
    timer = RankTimer(rank, f"rank{rank}")
    for stage in stages.stages:
        instrument_stage(stage, timer)
    steps, computes = [], []
    for i in range(WARMUP_STEPS + PROBE_STEPS):
        dist.barrier(group)
        timer.begin_round()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(batch)
        else:
            schedule.step(target=target, losses=[])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP_STEPS:
            steps.append(time.perf_counter() - start)
            computes.append(timer.end_round().compute_s)
    return statistics.median(steps), statistics.median(computes), ROWS * WIDTH * example.element_size()
