"""The messages between a parameter server and its workers (gloo point-to-point, ``torch.distributed``).

A worker's **push** is two messages: a float64 header ``PUSH`` (its clock, the model version its gradient was
computed on, the iteration's loss, its compute seconds and the seconds it last waited for the server) and one
flat float32 payload: the gradients of every parameter, in ``named_parameters`` order, then its floating-point
buffers (BatchNorm's running statistics). The server receives the header from any source -- gloo's ``recv``
without a source returns the sender's rank -- then the payload from that sender.

The server's **reply** is a float64 header ``REPLY`` (the model version, and 1 to stop) followed, unless it says
stop, by one flat float32 payload: the parameters, then the float buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Push", "PUSH_FIELDS", "REPLY_FIELDS", "ModelTensors", "send_push", "recv_push_header", "send_reply",
           "recv_reply"]

PUSH_FIELDS = 5
REPLY_FIELDS = 2


@dataclass(frozen=True)
class Push:
    """A push's header."""

    clock: int
    """Pushes this worker made before this one."""
    version: int
    """The model version the gradient was computed on."""
    loss: float
    compute_s: float
    waited_s: float
    """How long the worker waited for the server's reply before this iteration."""


class ModelTensors:
    """A model's parameters and float buffers as one flat vector (what a push and a reply carry)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for _, p in module.named_parameters()]
        self.buffers = [b for _, b in module.named_buffers() if b.is_floating_point()]
        self.param_numel = sum(p.numel() for p in self.params)
        self.numel = self.param_numel + sum(b.numel() for b in self.buffers)

    def empty(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32)

    def _flat(self, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        offset = 0
        for t in tensors:
            out[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
            offset += t.numel()
        return out

    def grads_and_buffers(self, out: torch.Tensor) -> torch.Tensor:
        """Gradients (zeros where a parameter has none) and buffers into ``out``."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self._flat(grads, out[:self.param_numel])
        self._flat(self.buffers, out[self.param_numel:])
        return out

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """Parameters and buffers into ``out``."""
        self._flat(self.params, out[:self.param_numel])
        self._flat(self.buffers, out[self.param_numel:])
        return out

    def load(self, flat: torch.Tensor) -> None:
        """Parameters and buffers from ``flat``."""
        offset = 0
        with torch.no_grad():
            for t in [*self.params, *self.buffers]:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def set_grads(self, flat: torch.Tensor) -> None:
        """Each parameter's ``.grad`` from the gradient part of ``flat``."""
        offset = 0
        for p in self.params:
            p.grad = flat[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def set_buffers(self, flat: torch.Tensor) -> None:
        """The buffers from the buffer part of ``flat``."""
        offset = self.param_numel
        with torch.no_grad():
            for b in self.buffers:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()


def send_push(server: int, push: Push, payload: torch.Tensor) -> None:
    header = torch.tensor([push.clock, push.version, push.loss, push.compute_s, push.waited_s], dtype=torch.float64)
    dist.send(header, dst=server)
    dist.send(payload, dst=server)


def recv_push_header() -> tuple[int, Push]:
    """The next push's header from any worker, and that worker's rank (its payload follows from the same rank)."""
    header = torch.zeros(PUSH_FIELDS, dtype=torch.float64)
    source = dist.recv(header)
    clock, version, loss, compute_s, waited_s = header.tolist()
    return int(source), Push(int(clock), int(version), loss, compute_s, waited_s)


def send_reply(worker: int, version: int, payload: torch.Tensor | None) -> None:
    """The current model (``payload``), or ``None``: stop."""
    dist.send(torch.tensor([version, 1.0 if payload is None else 0.0], dtype=torch.float64), dst=worker)
    if payload is not None:
        dist.send(payload, dst=worker)


def recv_reply(server: int, into: torch.Tensor) -> int | None:
    """The model version received into ``into``, or ``None`` when the server says stop."""
    header = torch.zeros(REPLY_FIELDS, dtype=torch.float64)
    dist.recv(header, src=server)
    version, stop = header.tolist()
    if stop:
        return None
    dist.recv(into, src=server)
    return int(version)
