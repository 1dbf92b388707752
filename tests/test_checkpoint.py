"""Checkpoints: per-rank files sealed by meta.json, resharded by name on load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.errors import PlannerError
from planner.runtime.checkpoint import latest_checkpoint, load_owned, save_checkpoint
from tests._gloo import run_ranks

OWNED = [["a", "b"], ["c"]]


def _values(name: str) -> torch.Tensor:
    return torch.arange(4, dtype=torch.float32) + {"a": 0, "b": 10, "c": 20}[name]


def _save(rank: int, world: int, root: str) -> None:
    for step in (2, 4, 6):
        tensors = {n: _values(n) * step for n in OWNED[rank]}
        optim = {n: {"step": torch.tensor(float(step)), "exp_avg": _values(n) + 0.5} for n in OWNED[rank]}
        plan = {"stages": [{"index": 0, "device": "cpu0"}], "step": step}
        save_checkpoint(root, step=step, rank=rank, world_size=world, tensors=tensors, optim=optim, plan=plan,
                        extra={"round": step // 2}, keep=2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two gloo ranks save checkpoints at steps 2, 4 and 6 (keeping 2), once for the module."""
    root = tmp_path_factory.mktemp("ckpt")
    run_ranks(_save, 2, str(root), timeout_s=100)
    return root


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_checkpoints_are_sealed_pruned_and_reshard_by_name(saved: Path) -> None:
    tmp_path = saved
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["step_00000004", "step_00000006"]
    info = latest_checkpoint(tmp_path)
    assert info is not None and info.step == 6 and info.world_size == 2
    assert info.plan["step"] == 6 and info.extra["round"] == 3
    # A different owner layout: one rank wants "c" (written by rank 1) and "a" (written by rank 0).
    tensors, optim = load_owned(info, ["c", "a"])
    assert torch.equal(tensors["a"], _values("a") * 6) and torch.equal(tensors["c"], _values("c") * 6)
    assert float(optim["c"]["step"]) == 6.0 and torch.equal(optim["a"]["exp_avg"], _values("a") + 0.5)


def test_unsealed_checkpoints_are_ignored(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none") is None
    (tmp_path / "step_00000010").mkdir()
    (tmp_path / "step_00000010" / "rank00000.pt").write_bytes(b"half")
    assert latest_checkpoint(tmp_path) is None


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_missing_names_and_bad_meta_fail_with_one_clear_message(saved: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(saved, tmp_path / "copy")
    tmp_path = tmp_path / "copy"
    info = latest_checkpoint(tmp_path)
    assert info is not None
    with pytest.raises(PlannerError, match="holds no tensor 'zz'"):
        load_owned(info, ["a", "zz"])
    (info.path / "meta.json").write_text("{not json")
    with pytest.raises(PlannerError, match="unreadable"):
        latest_checkpoint(tmp_path)
