"""Per-device operation orders of the pipeline schedules, shared by the cost model and the simulator.

A schedule is, for every device, a fixed order of forward (``F``) and backward (``B``) passes of
(stage, micro-batch) pairs; the device runs them in that order as soon as their inputs arrive.

- ``gpipe`` (Huang et al., 2019, GPipe): all forwards, then all backwards, micro-batches in order.
- ``1f1b`` (Narayanan et al., 2021, PipeDream-flush as in Megatron-LM): stage ``s`` of ``p`` warms up
  with ``p - 1 - s`` forwards, alternates one forward and one backward, and drains the backwards.
- ``interleaved-1f1b`` (Narayanan et al., 2021, Megatron-LM's interleaved schedule, as
  ``torch.distributed.pipelining.ScheduleInterleaved1F1B`` orders it): each device holds ``v`` model
  chunks, stages assigned round-robin (stage ``c * p + r`` on device rank ``r``). Forwards run chunk by
  chunk over rounds of ``g`` micro-batches (``g = p`` when ``m`` is a multiple of ``p``, ``g = m`` when
  ``m < p``); the warm-up is ``2 (p - 1 - r) + (v - 1) g`` forwards, then one forward / one backward, then
  the remaining backwards. With ``v = 1`` it is ``1f1b``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping, Sequence

from planner.errors import PlannerError
from planner.formats.plan import SCHEDULES

FWD = "F"
BWD = "B"
Op = tuple[str, int, int]
"""(FWD or BWD, stage index, micro-batch index)."""


def pipeline_layout(devices: Sequence[str], schedule: str) -> tuple[tuple[str, ...], int]:
    """Distinct devices in pipeline order and ``v``, the number of stages each holds.

    Raises ``PlannerError`` when a device holds several stages under a schedule that cannot run them,
    or when the stages of an interleaved plan are not round-robin over its devices.
    """
    if schedule not in SCHEDULES:
        raise PlannerError(f"unknown schedule {schedule!r}; expected one of {', '.join(SCHEDULES)}")
    if not devices:
        raise PlannerError("a pipeline needs at least one stage, found none")
    ranks = tuple(dict.fromkeys(devices))
    if len(ranks) == len(devices):
        return ranks, 1
    if schedule != "interleaved-1f1b":
        first: dict[str, int] = {}
        for i, dev in enumerate(devices):
            if dev in first:
                raise PlannerError(
                    f"device {dev!r} holds stages {first[dev]} and {i}, but schedule {schedule!r} runs one stage "
                    f"per device; use --schedule interleaved-1f1b or give each stage its own device"
                )
            first[dev] = i
    p = len(ranks)
    for s, dev in enumerate(devices):
        if len(devices) % p or dev != ranks[s % p]:
            raise PlannerError(
                f"interleaved-1f1b needs stages assigned round-robin over the devices ({', '.join(ranks)}) with "
                f"the same number of stages on each; stage {s} is on {dev!r}. Reorder the stages or use 1f1b"
            )
    return ranks, len(devices) // p


@lru_cache(maxsize=256)
def device_orders(schedule: str, num_devices: int, chunks: int, microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """The order of passes on each device rank (stage ``c * num_devices + r`` is chunk ``c`` of rank ``r``).

    Cached: every simulation and memory check asks for it, and the polish asks thousands of times for
    the same few layouts; the result is immutable.
    """
    p, v, m = num_devices, chunks, microbatches
    if schedule == "gpipe":
        if v != 1:
            raise PlannerError("gpipe runs one stage per device")
        return tuple(tuple([(FWD, r, j) for j in range(m)] + [(BWD, r, j) for j in range(m)]) for r in range(p))
    if schedule == "1f1b" or v == 1:
        if v != 1:
            raise PlannerError("1f1b runs one stage per device")
        return tuple(_one_f_one_b([(r, j) for j in range(m)], [(r, j) for j in range(m)], min(p - 1 - r, m))
                     for r in range(p))
    group = interleaved_group_size(p, m)
    return tuple(_interleaved(r, p, v, m, group) for r in range(p))


def interleaved_group_size(num_devices: int, microbatches: int) -> int:
    """Micro-batches per round of the interleaved schedule, as ``torch.distributed.pipelining`` counts them.

    ``rounds = max(1, m // p)`` and ``m`` must split evenly into them (``ScheduleInterleaved1F1B``'s rule);
    a round is ``p`` micro-batches when ``m`` is a multiple of ``p``, all ``m`` when ``m < p``.
    """
    rounds = max(1, microbatches // num_devices)
    if microbatches % rounds:
        fits = sorted({k * num_devices for k in range(1, rounds + 2)} | set(range(1, num_devices + 1)))
        nearest = min(fits, key=lambda k: (abs(k - microbatches), k))
        raise PlannerError(
            f"interleaved-1f1b on {num_devices} devices needs a micro-batch count that splits into "
            f"{rounds} equal rounds (torch.distributed.pipelining's rule), found {microbatches}; "
            f"use --microbatches {nearest}"
        )
    return microbatches // rounds


def _one_f_one_b(fwds: Sequence[tuple[int, int]], bwds: Sequence[tuple[int, int]], warmup: int) -> tuple[Op, ...]:
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    ops: list[Op] = [(FWD, s, j) for s, j in fwds[:warmup]]
    steady = len(fwds) - warmup
    for i in range(steady):
        ops.append((FWD, *fwds[warmup + i]))
        ops.append((BWD, *bwds[i]))
    ops.extend((BWD, s, j) for s, j in bwds[steady:])
    return tuple(ops)


def _interleaved(rank: int, p: int, v: int, m: int, group: int) -> tuple[Op, ...]:
    fwds: list[tuple[int, int]] = []
    bwds: list[tuple[int, int]] = []
    for first in range(0, m, group):
        members = range(first, first + group)
        fwds.extend((c * p + rank, j) for c in range(v) for j in members)
        bwds.extend((c * p + rank, j) for c in reversed(range(v)) for j in members)
    warmup = min(2 * (p - 1 - rank) + (v - 1) * group, m * v)
    return _one_f_one_b(fwds, bwds, warmup)


def inflight_counts(order: Sequence[Op]) -> dict[int, int]:
    """Per stage in ``order``: the most micro-batches forwarded but not yet backwarded at once."""
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for kind, stage, _ in order:
        live[stage] = live.get(stage, 0) + (1 if kind == FWD else -1)
        peak[stage] = max(peak.get(stage, 0), live[stage])
    return peak


def peak_activation_bytes(order: Sequence[Op], activation_bytes: Mapping[int, int]) -> int:
    """Largest sum of live activations on a device running ``order`` (allocated at F, freed after B)."""
    live = peak = 0
    for kind, stage, _ in order:
        if kind == FWD:
            live += activation_bytes[stage]
            peak = max(peak, live)
        else:
            live -= activation_bytes[stage]
    return peak
