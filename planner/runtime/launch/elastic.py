"""Start the ranks of ``plan run`` with torch's elastic launcher (what ``torchrun`` itself uses).

``launch`` is ``torch.distributed.launcher.api.elastic_launch`` with ``main.elastic_main`` as the entry
point: one process per rank on this node, rendezvous over c10d (a free local port unless
``--rdzv-endpoint`` names a shared one), ``--max-restarts`` restarts of the whole worker group. Results
come back as the ranks' return values; a ``PlannerError`` raised on a rank comes back as the same error, and a job
whose ranks crashed is reported in one line naming the rank that failed first (``worker.note_failure``).

Ranks start from ``multiprocessing``'s fork server with the runtime preloaded (``START_METHOD``), not by
``spawn`` as ``torchrun`` does: a spawned rank imported torch and the runtime afresh (about 4 s of a core
each, ``torch.distributed.pipelining`` alone 2 s) and tore a whole interpreter down at the end. The server
imports them once, has no threads, and forks every rank (and every restarted rank) from that state: a 2-rank
job on 2 cores started in 5.7 s instead of 9.1 s. The server keeps the environment it started with, and a process
that launches several jobs (``plan train``, the test suite) reuses it, so each rank is handed the launcher's
environment as it is at ``launch`` (``main.elastic_main``); the working directory comes with ``multiprocessing``'s
own preparation data.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from planner import errors
from planner.errors import DistributedError, Interrupted, UsageError
from planner.runtime.checkpoint import latest_checkpoint
from planner.runtime.launch.config import RunConfig
from planner.runtime.launch.main import INTERRUPTED_EXIT, elastic_main
from planner.runtime.launch.worker import FAILURES_ENV
from planner.runtime.links import check_gpus_per_host

__all__ = ["LaunchOptions", "launch", "parse_nnodes", "START_METHOD", "preload_fork_server"]

log = logging.getLogger(__name__)

START_METHOD = "forkserver"
"""How ranks start (module docstring); the server preloads ``main``, which imports the whole rank runtime."""


PRELOAD_LAZY = ("torch.export._trace",)
"""Modules a rank imports on first use that the server imports once for all of them: every rank captures its model
with ``torch.export`` (``profile.capture``), whose first call took 0.31 s of a core, 0.06 s once these were imported
(in 0.14 s)."""


PACKAGE_PARENT = Path(__file__).resolve().parents[3]
"""The directory holding the ``planner`` package, where the fork server starts (``preload_fork_server``)."""


def preload_fork_server() -> None:
    """Start the fork server (once per process; later launches reuse it) with ``main`` preloaded.

    multiprocessing starts the server as ``python -c``, whose ``sys.path`` begins with the working directory, and
    Python 3.11 does not hand it this process's path. Started from a user's directory, a file there named like a
    standard module (``profile.py`` shadowed ``profile``, which torch imports through ``cProfile``) broke every
    rank. So the server starts in the directory that holds the ``planner`` package: the runtime imports from there,
    and nothing of the user's shadows the standard library. Ranks still run in the launcher's working directory
    (multiprocessing's preparation data carries it), where they import the user's modules.

    The server imports torch with its C++ log at ``FATAL`` unless ``TORCH_CPP_LOG_LEVEL`` says otherwise: a rank
    waiting in gloo's monitored barrier when another was interrupted logged an ERROR line of its own to stderr
    before the launcher's one line (seen once in a fresh-clone run of the Ctrl-C test); what fails reaches the
    launcher as the Python exception, with its message."""
    multiprocessing.set_forkserver_preload([elastic_main.__module__, *PRELOAD_LAZY])
    here = os.getcwd()
    level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.chdir(PACKAGE_PARENT)
    os.environ["TORCH_CPP_LOG_LEVEL"] = level or "FATAL"  # read once, when the server imports torch
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.chdir(here)
        if level is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


@dataclass(frozen=True)
class LaunchOptions:
    """How to start ranks; names and meanings follow ``torchrun``."""

    nproc_per_node: int = 1
    nnodes: str = "1"
    """``N`` or ``MIN:MAX`` nodes."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous; default: a free port on this host (single node)."""
    rdzv_backend: str = "c10d"
    rdzv_id: str = "plan-run"
    """Same on every node of one job."""
    max_restarts: int = 0
    monitor_interval_s: float = 0.1


def parse_nnodes(nnodes: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1:4"`` -> (1, 4)."""
    try:
        parts = [int(p) for p in nnodes.split(":")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 1 or parts[0] > parts[-1]:
        raise UsageError(f"--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, found {nnodes!r}")
    return parts[0], parts[-1]


def launch(config: RunConfig, options: LaunchOptions) -> dict[int, dict[str, Any]]:
    """Run ``config`` on ``options.nproc_per_node`` local ranks; return local rank -> that rank's summary."""
    if options.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node must be at least 1, found {options.nproc_per_node}")
    min_nodes, max_nodes = parse_nnodes(options.nnodes)
    check_gpus_per_host(options.nproc_per_node)  # before any rank starts, rather than in each of them
    endpoint = options.rdzv_endpoint
    if endpoint is None and max_nodes > 1:
        raise UsageError("--nnodes above 1 needs --rdzv-endpoint HOST:PORT shared by every node")
    launch_config = LaunchConfig(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=options.nproc_per_node,
        run_id=options.rdzv_id, rdzv_backend=options.rdzv_backend,
        rdzv_endpoint=endpoint or "localhost:0", max_restarts=options.max_restarts,
        monitor_interval=options.monitor_interval_s, start_method=START_METHOD,
        rdzv_configs={"timeout": max(60, int(config.timeout_s))},
    )
    # Restarted workers must not reuse the agent's rendezvous store: their gloo groups would read the
    # dead attempt's addresses ("connectFullMesh ... Connection refused"); a fresh store per attempt works.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    preload_fork_server()
    try:
        with _omp_threads(options.nproc_per_node), _quiet_agent(), _failure_notes() as notes:
            results = elastic_launch(launch_config, elastic_main)(dataclasses.asdict(config), dict(os.environ))
    except ChildFailedError as exc:
        if any(f.exitcode in (INTERRUPTED_EXIT, -signal.SIGINT) for f in exc.failures.values()):
            raise Interrupted(_interrupted_line(config)) from None
        raise DistributedError(_failure_line(exc, notes)) from None
    except (SignalException, KeyboardInterrupt):
        # The agent stopped every rank before raising (its handler for SIGINT/SIGTERM); the ranks ignore
        # SIGINT themselves (``main.elastic_main``), so a terminal's Ctrl-C reaches them only this way.
        raise Interrupted(_interrupted_line(config)) from None
    _raise_first_error(results)
    return dict(sorted(results.items()))


@contextlib.contextmanager
def _omp_threads(nproc: int) -> Iterator[None]:
    """One intra-op thread per rank when several share a node, as torchrun does (ranks inherit the env)."""
    if nproc <= 1 or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The elastic agent's and spawn's warnings (each rank's start, a signal, workers shut down) held back;
    their errors, which name a failed rank's traceback, still print."""
    prefixes = ("torch.distributed.elastic", "torch.multiprocessing")
    loggers = [logging.getLogger(name) for name in (*prefixes, *logging.root.manager.loggerDict)
               if name.startswith(prefixes)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _interrupted_line(config: RunConfig) -> str:
    """What an interrupted run can resume from (``plan run`` resumes from the newest checkpoint by itself)."""
    directory = config.options.get("checkpoint_dir")
    if not directory:
        return ("interrupted; every rank was stopped; no checkpoint was kept (pass --checkpoint-dir DIR "
                "--checkpoint-every N to make a run resumable)")
    try:
        info = latest_checkpoint(directory)
    except errors.PlannerError as exc:
        return f"interrupted; every rank was stopped; the checkpoints in {directory!r} cannot be read ({exc})"
    if info is None:
        return (f"interrupted; every rank was stopped; no checkpoint was written to {directory!r} yet, so the "
                f"same command starts afresh")
    return (f"interrupted; every rank was stopped; the same command resumes from step {info.step} "
            f"(checkpoint {str(info.path)!r})")


def _raise_first_error(results: dict[int, Any]) -> None:
    for rank, result in sorted(results.items()):
        if isinstance(result, dict) and "error" in result:
            kind = getattr(errors, str(result.get("kind")), None)
            cls = kind if isinstance(kind, type) and issubclass(kind, errors.PlannerError) else DistributedError
            raise cls(str(result["error"]))
        if not isinstance(result, dict):
            raise DistributedError(f"rank {rank} returned no summary ({result!r}); see its log above")


@contextlib.contextmanager
def _failure_notes() -> Iterator[list[dict[str, Any]]]:
    """A directory where the ranks note their errors (``worker.FAILURES_ENV``), named in the environment the ranks
    adopt; yields the list the notes are read into when the job ends, removed with the directory."""
    notes: list[dict[str, Any]] = []
    before = os.environ.get(FAILURES_ENV)
    with tempfile.TemporaryDirectory(prefix="plan-run-failures-") as directory:
        os.environ[FAILURES_ENV] = directory
        try:
            yield notes
        finally:
            if before is None:
                os.environ.pop(FAILURES_ENV, None)
            else:
                os.environ[FAILURES_ENV] = before
            for path in sorted(Path(directory).glob("rank*.json")):
                with contextlib.suppress(OSError, ValueError):
                    notes.append(json.loads(path.read_text()))


def _failure_line(exc: ChildFailedError, notes: list[dict[str, Any]]) -> str:
    """One line for a failed job: the rank that failed first by the ranks' own notes (in the last restart attempt),
    else the rank torch's agent reports."""
    noted = [n for n in notes if isinstance(n, dict) and {"rank", "time", "attempt", "line"} <= n.keys()]
    if noted:
        last = max(n["attempt"] for n in noted)
        first_note = min((n for n in noted if n["attempt"] == last), key=lambda n: (n["time"], n["rank"]))
        rank, first = first_note["rank"], str(first_note["line"])
    else:
        rank, failure = min(exc.failures.items())
        text = str(getattr(failure, "message", "") or "").strip()
        if isinstance(getattr(failure, "message", None), dict):
            text = str(failure.message.get("message", "")).strip()
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), f"exit code {failure.exitcode}")
    return (f"rank {rank} failed: {first[:400]}; the other ranks were stopped "
            f"(see the ranks' output above; a hang ends after --timeout-s)")
