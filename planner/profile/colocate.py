"""Co-location: how much slower one training micro-batch gets while other ranks of the same host train too.

A profile timed in one process alone does not see the ranks that will share the host's cores, memory
bandwidth and caches: on 2 CPU ranks of a 2-core machine the ranks computed 1.12-1.32x what a lone
profile predicted. ``plan profile --colocate N`` therefore starts ``N - 1`` helper processes that train the
same model on the same micro-batch in a loop (as the other ranks will), times the profiling process's
whole-model training micro-batch again while they run, and records ``whole_model.colocation``:
``{"ranks": N, "train_s": loaded, "factor": loaded / alone}``. The cost model multiplies the profiled
type's measured times by that factor on devices whose host holds at least ``N`` devices of that type
(``planner.partition.model.times.calibration_factors``).
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable

import torch

__all__ = ["measure_colocated"]

READY_TIMEOUT_S = 120.0


def _helper(spec: str, input_spec: str | None, microbatch_size: int | None, threads: int, ready: Any, stop: Any) -> None:
    """A stand-in for another rank: train the model on its example micro-batch until told to stop."""
    torch.set_num_threads(max(threads, 1))
    from planner.profile.loader import load_factory

    module, inputs = load_factory(spec, input_spec, microbatch_size)
    module.train()
    ready.set()
    while not stop.is_set():
        out = module(*inputs)
        outs = [t for t in (out if isinstance(out, (tuple, list)) else [out])
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        module.zero_grad(set_to_none=True)


def measure_colocated(ranks: int, spec: str, input_spec: str | None, microbatch_size: int | None, threads: int,
                      time_training: Callable[[], float], windows: int = 1) -> list[float]:
    """``time_training()``, ``windows`` times, while ``ranks - 1`` helper processes train the same model; returns the
    seconds of each."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    helpers = []
    try:
        for _ in range(ranks - 1):
            ready = ctx.Event()
            proc = ctx.Process(target=_helper, args=(spec, input_spec, microbatch_size, threads, ready, stop),
                               daemon=True)
            proc.start()
            helpers.append((proc, ready))
        for proc, ready in helpers:
            if not ready.wait(READY_TIMEOUT_S):
                raise RuntimeError(f"a co-location helper did not start within {READY_TIMEOUT_S:.0f} s")
        return [time_training() for _ in range(windows)]
    finally:
        stop.set()
        for proc, _ in helpers:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
