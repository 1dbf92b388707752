"""What the report needs from a simulated event, and how tracks (devices, links) are ordered.

The simulator (``planner.partition.sim.simulate``) produces the events; this module only reads their
``resource``, ``kind``, ``stage``, ``microbatch``, ``start_s`` and ``end_s`` attributes, so the
timeline and trace can be tested with hand-made events.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight", "send_fwd", "send_bwd", "sync", "update")
COMPUTE_KINDS = ("fwd", "bwd", "bwd_input", "bwd_weight")
"""A device's passes over a micro-batch: a forward, a whole backward, or a zero-bubble schedule's halves of one."""
_SHORT = {"fwd": "F", "bwd": "B", "bwd_input": "I", "bwd_weight": "W", "send_fwd": "sF", "send_bwd": "sB", "sync": "AR",
          "update": "U"}


class TimedEvent(Protocol):
    """One busy interval on one resource (a device or a link)."""

    @property
    def resource(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def stage(self) -> int: ...
    @property
    def microbatch(self) -> int: ...
    @property
    def start_s(self) -> float: ...
    @property
    def end_s(self) -> float: ...


def event_label(ev: TimedEvent) -> str:
    """Short name: ``F3`` (forward of micro-batch 3), ``B3``, ``sF3``/``sB3`` (sends), ``U`` (the optimizer
    step, once per step), ``AR`` (the all-reduce over a stage's replicas); stage in brackets."""
    if ev.kind in ("update", "sync"):
        return f"{_SHORT[ev.kind]} [s{ev.stage}]"
    return f"{_SHORT.get(ev.kind, ev.kind)}{ev.microbatch} [s{ev.stage}]"


def split_tracks(events: Sequence[TimedEvent], device_order: Sequence[str]) -> tuple[list[str], list[str]]:
    """Device tracks in ``device_order`` (every device, busy or not), then link tracks.

    A resource that is not a device is a link (``"a->b"``); links appear only when they carry a
    transfer, ordered by the pipeline positions of their ends (``d0->d1``, ``d1->d0``, ``d1->d2``, ...).
    """
    devices = list(dict.fromkeys(device_order))
    position = {d: i for i, d in enumerate(devices)}

    def key(link: str) -> tuple[int, int, str]:
        src, _, dst = link.partition("->")
        return position.get(src, len(position)), position.get(dst, len(position)), link

    links = sorted({ev.resource for ev in events} - set(devices), key=key)
    return devices, links


def memory_timeline(
    events: Sequence[TimedEvent],
    static_bytes: Mapping[str, int],
    activation_bytes: Mapping[int, int],
) -> dict[str, list[tuple[float, int]]]:
    """Per device, ``(time_s, bytes)`` samples of its memory over the step.

    As in the simulator: a device holds its stages' static bytes throughout; a stage's activations
    for a micro-batch are allocated when its forward starts and freed when its backward ends (a zero-bubble
    schedule's weight-gradient half, which ends it).
    ``static_bytes`` is per device, ``activation_bytes`` per stage.
    """
    changes: dict[str, list[tuple[float, int, int]]] = {d: [] for d in static_bytes}
    for ev in events:
        if ev.resource not in changes or ev.kind not in ("fwd", "bwd", "bwd_weight"):
            continue
        delta = activation_bytes.get(ev.stage, 0)
        # at equal times frees (order 0) come before allocations (order 1), as the simulator frees first
        changes[ev.resource].append((ev.start_s, 1, delta) if ev.kind == "fwd" else (ev.end_s, 0, -delta))
    out: dict[str, list[tuple[float, int]]] = {}
    for device, steps in changes.items():
        level = static_bytes[device]
        samples = [(0.0, level)]
        for time_s, _, delta in sorted(steps):
            level += delta
            if samples[-1][0] == time_s:
                samples[-1] = (time_s, level)
            else:
                samples.append((time_s, level))
        out[device] = samples
    return out
