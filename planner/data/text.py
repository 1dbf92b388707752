"""A byte-level text corpus built from the Python standard library's own source files, which every
machine with Python has: real text for the GPT-style model that needs no download.

The corpus is the top-level ``*.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``), sorted by name and concatenated, cut at ``CORPUS_BYTES``. Its
SHA-256 (``fingerprint()``) is recorded with a run: another Python version gives another corpus, and
the fingerprint says so. The last ``VAL_FRACTION`` of the bytes is the validation split.

``batches(seed, step, batch_size, split="train", seq=SEQ)`` follows the ``--data`` factory contract:
inputs are ``int64 (batch, seq)`` byte values, the target is the next byte at every position. Training
windows start at positions drawn from ``(seed, step)``; validation batch ``step`` has windows at fixed
positions (drawn from the step alone), so every run evaluates on the same bytes.
"""

from __future__ import annotations

import functools
import hashlib
import sysconfig
from pathlib import Path

import torch

from planner.errors import UsageError

__all__ = ["batches", "corpus", "fingerprint", "SEQ", "VOCAB"]

CORPUS_BYTES = 4_000_000
VAL_FRACTION = 0.05
SEQ = 64
"""Bytes per training sequence (the example model's context)."""
VOCAB = 256


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """``(train_bytes, val_bytes)`` as ``uint8`` tensors."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for path in sorted(root.glob("*.py")):
        data += path.read_bytes()
        if len(data) >= CORPUS_BYTES:
            break
    data = data[:CORPUS_BYTES]
    if len(data) < 100_000:
        raise UsageError(f"the standard library at {root} holds only {len(data)} bytes of Python source; the text "
                         f"corpus needs at least 100000")
    values = torch.frombuffer(data, dtype=torch.uint8).clone()
    cut = int(len(values) * (1 - VAL_FRACTION))
    return values[:cut], values[cut:]


def fingerprint() -> str:
    """SHA-256 of the corpus bytes (train then validation), first 16 hex digits."""
    train, val = corpus()
    return hashlib.sha256(train.numpy().tobytes() + val.numpy().tobytes()).hexdigest()[:16]


def batches(seed: int, step: int, batch_size: int, split: str = "train",
            seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``--data`` factory: ``(bytes, next bytes)``, each ``int64 (batch_size, seq)``."""
    train, val = corpus()
    if split not in ("train", "val"):
        raise UsageError(f"split must be 'train' or 'val', found {split!r}")
    source = train if split == "train" else val
    stream = seed * 1_000_003 + step if split == "train" else 7_777_777 + step
    starts = torch.randint(0, len(source) - seq - 1, (batch_size,), generator=torch.Generator().manual_seed(stream))
    windows = torch.stack([source[s: s + seq + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
