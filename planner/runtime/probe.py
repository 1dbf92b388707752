"""Probe what the pipeline runtime itself adds to every pass: ``Cluster.pass_overhead_s``,
``Cluster.pass_byte_overhead_s`` and ``Cluster.schedule_runtime_pass_overhead_s``.

Each forward or backward pass of a stage under ``torch.distributed.pipelining`` costs more than its
ops and its bytes: the schedule's Python, preparing the stage's inputs and outputs, posting the
point-to-point operations and completing them. On GPUs most of it hides behind kernels; on CPU ranks
it is on the critical path, and for a step of a few tenths of a second it is several percent. Moving
large activations inside a running pipeline also costs more than a ping-pong between idle ranks says
(the links' figures): on CPU ranks gloo's copies through the kernel's socket buffers compete with the
compute for the same cores, and a message that arrives before its receive is posted waits in the
socket buffer.

The probe runs this very runtime (``planner.runtime.pipeline.stages``) on ranks 0 and 1, a 2-stage
pipeline with ``PROBE_MICROBATCHES`` micro-batches, the median of ``PROBE_STEPS`` steps after a
warm-up, three times over (under 1F1B, but the third):

1. a 4-layer, 16-wide MLP (negligible compute and bytes): the per-pass figure ``o`` that makes the
   simulator (``planner.partition.sim.simulate``), fed with the probed link and each stage's compute as the
   cost model knows it, predict the measured step;
2. a 4-layer elementwise model whose activations are ``BYTE_PROBE_SIZES`` large: with ``o`` fixed,
   the per-byte figure that makes the simulator predict each measured step; the mean over the sizes.

3. the same MLP under ``zb-h1`` (torch's ``_PipelineScheduleRuntime``, which runs interleaved 1F1B and every
   zero-bubble schedule): the per-pass figure of that runtime, ``z``, with the per-byte figure fixed. It takes
   each send and receive as an action of its own and splits each backward into two autograd calls (interleaved
   1F1B's whole backwards are charged the same figure: its sends and receives are actions too), and on passes as
   small as these it costs more per pass than ``Schedule1F1B``: a plan of the digits MLP that ``o`` alone predicted
   about as fast under ``zb-h2`` as under 1F1B ran about 1.3 times as long (``bench/schedules.py``, 2026-11-29). The
   stages' weight gradients are taken as half their backward (the MLP's ``Linear`` layers: the input and the weight
   gradient are one matrix product each); next to ``z`` they hardly count.

All are found by bisection, as the simulated step grows monotonically with each figure. Every rank
of the job must call :func:`probe_runtime`.

*The compute the simulator is fed* is each stage's forward and backward timed alone, outside the runtime
(``TinyRun.lone_s``), as ``plan profile`` times a model's ops, not the time the runtime spends inside its
pass methods (``forward_one_chunk``, ``backward_one_chunk``): those hold part of the runtime's own cost
(preparing the stage's inputs and outputs, the autograd call), which the cost model's compute, built from
profiled ops, does not. Fed the latter, the probe left that part out of ``o``: on the 16-wide MLP the passes
took 0.12-0.19 ms inside the runtime against 0.04-0.09 ms alone (2026-11-28), and a plan of the digits MLP, whose
passes are of that size, ran about twice as long as predicted. That inner part is also reported
alone (``pass_compute_overhead_s``), since a rank's measured compute includes it: calibration compares the
measured compute with the cost model's plus it (``RoundModel.predicted_compute_s``).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from planner.formats.cluster import Cluster, Device, Link
from planner.formats.plan import Plan, Stage
from planner.partition.sim.simulate import SimStage, simulate

__all__ = ["PROBE_MICROBATCHES", "PROBE_STEPS", "BYTE_PROBE_SIZES", "TinyRun", "RuntimeProbe", "fit_pass_overhead",
           "fit_byte_overhead", "fit_schedule_runtime_overhead", "inner_overhead", "probe_runtime"]

PROBE_MICROBATCHES = 8
ZERO_BUBBLE_PROBE = "zb-h1"
"""The zero-bubble schedule the per-pass figure of torch's ``_PipelineScheduleRuntime`` is fitted on."""
PROBE_STEPS = 15
WARMUP_STEPS = 3
LONE_REPEATS = 30
"""Forward-and-backward passes of a stage timed alone (the median), for ``TinyRun.lone_s``."""
WIDTH = 16
ROWS = 4
BYTE_PROBE_SIZES = (1 << 20, 1 << 22)
"""Activation bytes per micro-batch of the large-message runs (1 and 4 MiB, the size of the bundled models'
activations between stages)."""


@dataclass(frozen=True)
class TinyRun:
    """What the two probe ranks measured: the median step, each rank's compute per step inside the runtime and
    its stage's forward and backward timed alone."""

    step_s: float
    compute_s: tuple[float, float]
    """Per rank (0, 1): seconds inside the runtime's pass methods per step (what ``plan run`` reports as compute)."""
    message_bytes: int
    """Bytes of one activation (and one gradient) between the stages, per micro-batch."""
    lone_s: tuple[float, float] | None = None
    """Per rank (0, 1): seconds of one micro-batch's forward and backward of its stage, timed alone outside the
    runtime (the median of ``LONE_REPEATS``): the compute the cost model would give the stage. None: not timed, and
    the simulation takes ``compute_s`` instead."""

    def pass_compute_s(self, rank: int, microbatches: int) -> float:
        """Seconds of one pass (forward or backward) of ``rank``'s stage as the simulator is fed them."""
        if self.lone_s is not None:
            return self.lone_s[rank] / 2
        return self.compute_s[rank] / (2 * microbatches)


@dataclass(frozen=True)
class RuntimeProbe:
    """The fitted figures (``Cluster.pass_overhead_s``, ``Cluster.pass_byte_overhead_s``)."""

    pass_overhead_s: float
    pass_byte_overhead_s: float
    pass_compute_overhead_s: float = 0.0
    """The part of ``pass_overhead_s`` spent inside the runtime's pass methods (``inner_overhead``)."""
    schedule_runtime_pass_overhead_s: float = 0.0
    """``pass_overhead_s`` of torch's ``_PipelineScheduleRuntime`` (``fit_schedule_runtime_overhead``)."""

    @property
    def source(self) -> str:
        """How they were measured (``runtime.source`` of the cluster file)."""
        sizes = " and ".join(f"{size / 2**20:g} MiB" for size in BYTE_PROBE_SIZES)
        return (f"measured on ranks 0 and 1, 2-stage 1F1B pipelines of {PROBE_MICROBATCHES} micro-batches, median of "
                f"{PROBE_STEPS} steps, fitted with the simulator fed each stage's compute timed alone "
                f"(planner/runtime/probe.py): pass_overhead_s on a 4-layer, {WIDTH}-wide MLP, of which "
                f"pass_compute_overhead_s inside the runtime's pass methods; pass_byte_overhead_s on a 4-layer "
                f"elementwise model with {sizes} activations; schedule_runtime_pass_overhead_s on the MLP under "
                f"{ZERO_BUBBLE_PROBE}")


def fit_pass_overhead(run: TinyRun, link: Link, microbatches: int = PROBE_MICROBATCHES) -> float:
    """The per-pass overhead that makes the simulated 1F1B step of ``run``'s pipeline equal its measured step.

    0 when the simulator already predicts the measured step without one."""
    return _fit(lambda o: _simulated_step(run, link, microbatches, o, 0.0), run.step_s, run.step_s / (2 * microbatches))


def fit_byte_overhead(run: TinyRun, link: Link, pass_overhead_s: float, microbatches: int = PROBE_MICROBATCHES) -> float:
    """The per-byte overhead that, with ``pass_overhead_s``, makes the simulated step of ``run`` equal its measured
    step (0 when the simulator already predicts it without one)."""
    if run.message_bytes <= 0:
        return 0.0
    return _fit(lambda b: _simulated_step(run, link, microbatches, pass_overhead_s, b), run.step_s,
                run.step_s / (2 * microbatches * run.message_bytes))


def fit_schedule_runtime_overhead(run: TinyRun, link: Link, pass_byte_overhead_s: float,
                                  microbatches: int = PROBE_MICROBATCHES) -> float:
    """The per-pass overhead that makes the simulated ``ZERO_BUBBLE_PROBE`` step of ``run``'s pipeline (the MLP run
    under that schedule) equal its measured step, with ``pass_byte_overhead_s`` fixed (0 when the simulator already
    predicts the measured step without one)."""
    return _fit(lambda z: _simulated_step(run, link, microbatches, z, pass_byte_overhead_s, ZERO_BUBBLE_PROBE),
                run.step_s, run.step_s / (3 * microbatches))


def inner_overhead(run: TinyRun, microbatches: int = PROBE_MICROBATCHES) -> float:
    """Seconds per pass the runtime spends inside its pass methods beyond the stage's compute alone: the mean over the
    two ranks of (compute per pass inside the runtime - the same pass alone), at least 0 (0 without ``lone_s``)."""
    if run.lone_s is None:
        return 0.0
    inner = [c / (2 * microbatches) - lone / 2 for c, lone in zip(run.compute_s, run.lone_s)]
    return max(statistics.fmean(inner), 0.0)


def _simulated_step(run: TinyRun, link: Link, microbatches: int, overhead: float, per_byte: float,
                    schedule: str = "1f1b") -> float:
    """The probe pipeline's step as the simulator gives it, charging ``overhead`` per pass of ``schedule`` (as
    ``pass_overhead_s``, or as ``schedule_runtime_pass_overhead_s`` under a schedule of that runtime)."""
    per_pass = [run.pass_compute_s(rank, microbatches) for rank in (0, 1)]
    stages = [SimStage("a", per_pass[0], per_pass[0], run.message_bytes, 0, 0, 0, bwd_weight_s=per_pass[0] / 2),
              SimStage("b", per_pass[1], per_pass[1], 0, run.message_bytes, 0, 0, bwd_weight_s=per_pass[1] / 2)]
    cluster = Cluster("probe", (Device("a", "probe", "h", 1), Device("b", "probe", "h", 1)), link, link,
                      pass_overhead_s=overhead, pass_byte_overhead_s=per_byte,
                      schedule_runtime_pass_overhead_s=overhead)
    return simulate(stages, cluster, schedule, microbatches, record_events=False).step_time_s


def _fit(step: Callable[[float], float], measured: float, high: float) -> float:
    """The ``x`` in ``[0, high]`` with ``step(x) == measured`` (``step`` increasing); 0 if ``step(0) >= measured``."""
    low = 0.0
    if step(low) >= measured:
        return 0.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < measured else (low, mid)
    return (low + high) / 2


def probe_runtime(rank: int, device: torch.device, link: Link) -> RuntimeProbe:
    """Run the probe pipelines on ranks 0 and 1 and fit both figures (the same result on every rank)."""
    import torch.distributed as dist

    group = dist.new_group([0, 1])  # every rank takes part in creating it
    runs = [_gathered(rank, device, group, None)]
    runs += [_gathered(rank, device, group, size) for size in BYTE_PROBE_SIZES]
    zero_bubble = _gathered(rank, device, group, None, ZERO_BUBBLE_PROBE)
    overhead = fit_pass_overhead(runs[0], link)
    per_byte = statistics.fmean(fit_byte_overhead(run, link, overhead) for run in runs[1:])
    return RuntimeProbe(overhead, per_byte, min(inner_overhead(runs[0]), overhead),
                        fit_schedule_runtime_overhead(zero_bubble, link, per_byte))


def _gathered(rank: int, device: torch.device, group: Any, message_bytes: int | None,
              schedule: str = "1f1b") -> TinyRun:
    import torch.distributed as dist

    mine = _run_tiny(rank, device, group, message_bytes, schedule) if rank in (0, 1) else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    (step0, compute0, nbytes, lone0), (step1, compute1, _, lone1) = gathered[0], gathered[1]
    return TinyRun(max(step0, step1), (compute0, compute1), nbytes, (lone0, lone1))


class _Elementwise(nn.Module):
    """``tanh(x * w + b)``: a layer whose compute is small next to the bytes it passes on."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(width))
        self.b = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w + self.b)


def _run_tiny(rank: int, device: torch.device, group: Any, message_bytes: int | None,
              schedule: str = "1f1b") -> tuple[float, float, int, float]:
    """This rank's half of a probe pipeline under ``schedule``: (median step seconds, compute seconds per step,
    message bytes, its stage's forward and backward alone).

    ``message_bytes`` None: the small MLP; else the elementwise model with activations of that size."""
    import torch.distributed as dist

    from planner.profile.capture import capture
    from planner.runtime.pipeline.stages import build_rank_stages, build_schedule, training_step_kwargs
    from planner.runtime.timing import RankTimer, instrument_stage

    torch.manual_seed(0)
    width = WIDTH if message_bytes is None else max(message_bytes // (ROWS * 4), 1)
    layers = [nn.Linear(WIDTH, WIDTH) if message_bytes is None else _Elementwise(width) for _ in range(4)]
    module = nn.Sequential(*layers).to(device)
    example = torch.randn(ROWS, width, device=device)
    captured = capture(module, (example,), "auto")
    names = [op.name for op in captured.ops]
    half = len(names) // 2
    plan = Plan("probe", schedule, PROBE_MICROBATCHES,
                (Stage(0, "rank0", tuple(names[:half])), Stage(1, "rank1", tuple(names[half:]))),
                {"step_time_s": 0.0}, {"device_ranks": ["rank0", "rank1"]})
    stages = build_rank_stages(captured, module, plan, rank, device, group)
    runner = build_schedule(stages, lambda out, target: ((out - target) ** 2).mean())
    batch = torch.randn(ROWS * PROBE_MICROBATCHES, width, device=device)
    target = torch.randn(ROWS * PROBE_MICROBATCHES, width, device=device)
    timer = RankTimer(rank, f"rank{rank}")
    for stage in stages.stages:
        instrument_stage(stage, timer)
    steps, computes = [], []
    step_kwargs = training_step_kwargs(runner)
    for i in range(WARMUP_STEPS + PROBE_STEPS):
        dist.barrier(group)
        timer.begin_round()
        start = time.perf_counter()
        if rank == 0:
            runner.step(batch, **step_kwargs)
        else:
            runner.step(target=target, losses=[], **step_kwargs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP_STEPS:
            steps.append(time.perf_counter() - start)
            computes.append(timer.end_round().compute_s)
    lone = _time_alone(stages.modules[0], torch.randn(ROWS, width, device=device, requires_grad=rank == 1), device)
    return statistics.median(steps), statistics.median(computes), ROWS * width * example.element_size(), lone


def _time_alone(module: nn.Module, x: torch.Tensor, device: torch.device) -> float:
    """Median seconds of one forward and backward of ``module`` on ``x``, outside the pipeline runtime (as the
    profile times ops: nothing but the module's own work)."""
    times = []
    for i in range(WARMUP_STEPS + LONE_REPEATS):
        start = time.perf_counter()
        out = module(x)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    module.zero_grad(set_to_none=True)
    return statistics.median(times)
