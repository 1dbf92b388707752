"""Checkpoints: per-rank files of named tensors and optimizer state, plus the plan in force.

Layout of one checkpoint, written every N steps::

    DIR/step_00000120/rank00000.pt   # {"tensors": {name: tensor}, "optim": {name: state}} of rank 0
    DIR/step_00000120/rank00001.pt
    DIR/step_00000120/meta.json      # step, world size, the plan in force, rebalancer state

Each rank writes its own file atomically (temp file, fsync, rename); after a barrier rank 0 writes
``meta.json`` the same way, so a checkpoint without ``meta.json`` is incomplete and ignored. Tensors
are keyed by canonical name (``graph_split.canonical_param_names``), not by stage, so a resume under
any plan reshards by name: each rank reads the names it owns under the plan in force from whichever
files hold them (``torch.load(mmap=True)`` maps, rather than reads, the others' files). This needs
the directory to be visible to every rank (one host, or a shared file system). Why not
``torch.distributed.checkpoint``: its load needs every optimizer-state tensor pre-allocated in the
right shape before reading, which a freshly built optimizer does not have; named per-rank files are
short and keep any optimizer's state as it is.
"""

from __future__ import annotations

import io
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from planner.errors import InputFileError, PlannerError
from planner.formats.jsonio import write_bytes_atomic, write_json_atomic

__all__ = ["CheckpointInfo", "save_checkpoint", "latest_checkpoint", "load_owned", "rank_file"]

SCHEMA_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{8})$")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint found on disk."""

    path: Path
    step: int
    """Steps completed when it was written; training resumes at this step."""
    world_size: int
    plan: Mapping[str, Any]
    """The plan in force (a plan document, docs/formats.md)."""
    extra: Mapping[str, Any]
    """Anything else the runtime stored (rebalancer state, round index, losses so far)."""


def rank_file(directory: Path, rank: int) -> Path:
    return directory / f"rank{rank:05d}.pt"


def save_checkpoint(root: str | Path, *, step: int, rank: int, world_size: int, tensors: Mapping[str, torch.Tensor],
                    optim: Mapping[str, Mapping[str, Any]], plan: Mapping[str, Any], extra: Mapping[str, Any] | None = None,
                    keep: int = 2, group: Any = None) -> Path:
    """Collective: every rank saves the tensors it owns; rank 0 then seals the checkpoint with ``meta.json``.

    ``tensors``/``optim`` hold only what this rank owns under ``plan``. Older complete checkpoints
    beyond the newest ``keep`` are removed by rank 0 once the new one is sealed.
    """
    import torch.distributed as dist

    directory = Path(root) / f"step_{step:08d}"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier(group=group)
    directory.mkdir(parents=True, exist_ok=True)
    payload = {"tensors": {k: v.detach().clone() for k, v in sorted(tensors.items())},
               "optim": {k: dict(v) for k, v in sorted(optim.items())}}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    write_bytes_atomic(rank_file(directory, rank), buffer.getvalue())
    dist.barrier(group=group)
    if rank == 0:
        meta = {"schema_version": SCHEMA_VERSION, "step": step, "world_size": world_size,
                "plan": dict(plan), "extra": dict(extra or {})}
        write_json_atomic(directory / "meta.json", meta)
        _prune(Path(root), keep)
    dist.barrier(group=group)
    return directory


def latest_checkpoint(root: str | Path) -> CheckpointInfo | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    for directory in sorted((p for p in root.iterdir() if _STEP_DIR.match(p.name)), reverse=True):
        meta_path = directory / "meta.json"
        if meta_path.is_file():
            return _read_meta(meta_path)
    return None


def load_owned(info: CheckpointInfo, names: Iterable[str]) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """Tensors and optimizer state for ``names`` from whichever rank files of ``info`` hold them."""
    wanted = set(names)
    tensors: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, Any]] = {}
    for rank in range(info.world_size):
        path = rank_file(info.path, rank)
        if not wanted - set(tensors):
            break
        try:
            payload = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except (OSError, RuntimeError) as exc:
            raise InputFileError(f"checkpoint file {str(path)!r} cannot be read ({exc}); "
                                 f"delete {str(info.path)!r} to resume from the one before") from None
        for name in sorted(wanted & set(payload["tensors"]) - set(tensors)):
            tensors[name] = payload["tensors"][name].clone()
            if name in payload["optim"]:
                optim[name] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                               for k, v in payload["optim"][name].items()}
    missing = sorted(wanted - set(tensors))
    if missing:
        raise PlannerError(f"checkpoint {str(info.path)!r} holds no tensor {missing[0]!r} "
                           f"({len(missing)} missing); it was written for another model: remove it or pass "
                           f"another --checkpoint-dir")
    return tensors, optim


def _read_meta(path: Path) -> CheckpointInfo:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if meta.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema_version {meta.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        return CheckpointInfo(path=path.parent, step=int(meta["step"]), world_size=int(meta["world_size"]),
                              plan=meta["plan"], extra=meta.get("extra", {}))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputFileError(f"checkpoint metadata {str(path)!r} is unreadable ({exc}); "
                             f"delete {str(path.parent)!r} to resume from the one before") from None


def _prune(root: Path, keep: int) -> None:
    """Remove complete checkpoints beyond the newest ``keep``, and incomplete ones older than those kept."""
    steps = sorted(p for p in root.iterdir() if _STEP_DIR.match(p.name))
    complete = [p for p in steps if (p / "meta.json").is_file()]
    if keep <= 0 or len(complete) <= keep:
        return
    oldest_kept = complete[-keep]
    for old in steps:
        if old < oldest_kept:
            shutil.rmtree(old, ignore_errors=True)
