"""The handwritten digits that scikit-learn ships inside its package (1,797 images of 8x8 pixels, 10
classes): a real classification task that needs no download (``pip install 'planner[data]'``).

``batches`` follows the ``--data`` factory contract (docs/run.md): ``batches(seed, step, batch_size,
split="train")`` returns ``(images, labels)``, images ``float32 (batch, 1, 8, 8)`` scaled to ``[0, 1]``,
labels ``int64 (batch,)``. The split is fixed: a permutation drawn with seed 0 puts 1,500 images in
``train`` and the other 297 in ``val``. Training batches walk a fresh permutation of the training images
every epoch (drawn from ``seed`` and the epoch), so a batch is a pure function of ``(seed, step)``;
validation batch ``step`` holds validation images ``step * batch_size ...`` in a fixed order (wrapping).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from pathlib import Path
from typing import Any

import torch

from planner.errors import UsageError

__all__ = ["batches", "load", "split_indices", "TRAIN", "CLASSES"]

TRAIN = 1500
"""Images in the training split (the remaining 297 are the validation split)."""
CLASSES = 10


@functools.lru_cache(maxsize=1)
def load() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((train_images, train_labels), (val_images, val_labels))``, the fixed split."""
    pixels, target = _read_digits()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(target, dtype=torch.int64)
    train, val = split_indices(len(labels))
    return (images[train], labels[train]), (images[val], labels[val])


def _read_digits() -> tuple[Any, Any]:
    """The 1,797 images (64 pixels each, 0 to 16) and their labels, as numpy arrays.

    Read from the file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``: 64 pixels and the label per
    row), found without importing scikit-learn, as its own ``load_digits`` reads it: importing ``sklearn.datasets``
    took 2.3 s of a core, paid by every rank of a run (0.1 s to read the file). Where the file is not there (a
    scikit-learn that keeps it elsewhere), ``load_digits`` gives the same arrays."""
    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise UsageError("the digits data set comes with scikit-learn, which is not installed; install it with "
                         "pip install 'planner[data]' (or pip install scikit-learn)")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if path.is_file():
        with gzip.open(path, "rt") as rows:
            table = np.loadtxt(rows, delimiter=",")
        return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.data, digits.target


def split_indices(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the training and validation images: one permutation drawn with seed 0, cut at ``TRAIN``."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    return order[:TRAIN], order[TRAIN:]


def batches(seed: int, step: int, batch_size: int, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """The ``--data`` factory: batch ``step`` of ``split`` (``train`` or ``val``)."""
    (train_x, train_y), (val_x, val_y) = load()
    if split == "val":
        rows = (torch.arange(batch_size) + step * batch_size) % len(val_y)
        return val_x[rows], val_y[rows]
    if split != "train":
        raise UsageError(f"split must be 'train' or 'val', found {split!r}")
    n = len(train_y)
    first = step * batch_size
    rows = []
    for position in range(first, first + batch_size):
        epoch, index = divmod(position, n)
        rows.append(int(_permutation(seed, epoch, n)[index]))
    return train_x[rows], train_y[rows]


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
