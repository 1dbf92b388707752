"""A small U-Net (Ronneberger et al., 2015): an encoder, a decoder, and long skip connections that
carry each encoder level's activations across the bottleneck to the matching decoder level."""

from __future__ import annotations

import torch
from torch import nn


def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.SiLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.SiLU())


class UNet(nn.Module):
    def __init__(self, channels: int = 3, widths: tuple[int, ...] = (16, 32, 64)) -> None:
        super().__init__()
        self.down = nn.ModuleList()
        c_in = channels
        for width in widths:
            self.down.append(_double_conv(c_in, width))
            c_in = width
        self.mid = _double_conv(widths[-1], widths[-1] * 2)
        self.up = nn.ModuleList()
        self.dec = nn.ModuleList()
        c_in = widths[-1] * 2
        for width in reversed(widths):
            self.up.append(nn.ConvTranspose2d(c_in, width, 2, stride=2))
            self.dec.append(_double_conv(2 * width, width))
            c_in = width
        self.out = nn.Conv2d(widths[0], channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = nn.functional.max_pool2d(x, 2)
        x = self.mid(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def unet_small() -> tuple[UNet, tuple[torch.Tensor]]:
    """Three levels (16/32/64 channels), batch 4 of 3x64x64 images; the output has the input's shape."""
    torch.manual_seed(0)
    return UNet(), (torch.randn(4, 3, 64, 64),)
