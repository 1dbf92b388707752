"""Run a function on N gloo ranks in subprocesses (torch.multiprocessing) with a hard timeout.

The ranks fork from the fork server that ``plan run`` uses (``planner.runtime.launch.elastic.START_METHOD``), with the
same preloaded runtime, so they share it with the jobs that ``tests/_inproc.py`` launches in this process: a spawned
rank imported torch afresh, about 3 s of a core each.
"""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable[..., Any], world: int, store_path: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        # Leave together: a rank that tears gloo down while its peer still finishes can abort the
        # peer ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 90.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise if any fails or time runs out."""
    from planner.runtime.launch.elastic import START_METHOD, preload_fork_server

    preload_fork_server()  # as launch() does: whichever starts the server first, it holds the same runtime
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(fn, world, store, args), nprocs=world, join=False,
                                 start_method=START_METHOD)
        import time

        deadline = time.monotonic() + timeout_s
        while not ctx.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout_s} s")
