"""Small models for the digits data set (``planner.data.digits``): 8x8 grey images, 10 classes.

``forward(images)`` maps ``float32 (batch, 1, 8, 8)`` to logits ``(batch, 10)``; with integer labels
as targets ``plan run`` trains them with cross-entropy and reports accuracy.
"""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions (16 and 32 channels), a 2x2 max-pool, and a two-layer classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class DigitsMLP(nn.Module):
    """64 -> 128 -> 128 -> 10 with ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                                 nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _build(model: nn.Module, batch: int = 16) -> tuple[nn.Module, tuple[torch.Tensor]]:
    return model, (torch.rand(batch, 1, 8, 8, generator=torch.Generator().manual_seed(0)),)


def digits_cnn() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The CNN, seeded, with an example micro-batch of 16 images."""
    torch.manual_seed(0)
    return _build(DigitsCNN())


def digits_mlp() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The MLP, seeded, with an example micro-batch of 16 images."""
    torch.manual_seed(0)
    return _build(DigitsMLP())
