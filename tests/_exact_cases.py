"""Hand-made problems with known optima for the exact placers' golden tests (tests/test_dp.py, test_ilp.py)."""

from __future__ import annotations

from types import MappingProxyType

from planner.formats.cluster import Cluster, Device, Link
from planner.partition.model.problem import Block, Problem

FAST, SLOW = "fast", "slow"
"""Device types: ``slow`` takes three times as long as ``fast`` on every block."""


def blocks(times: list[float], *, param_bytes: int = 1, saved_bytes: int = 0) -> tuple[Block, ...]:
    """Blocks whose backward takes twice the forward: a block of ``t`` costs ``3 t`` per micro-batch on ``fast``."""
    return tuple(Block(f"b{i}", (f"n{i}",), param_bytes, saved_bytes,
                       MappingProxyType({FAST: (t, 2 * t), SLOW: (3 * t, 6 * t)})) for i, t in enumerate(times))


def cluster(*devices: tuple[str, str, int], inter_Bps: float = 1e12) -> Cluster:
    """Devices given as ``(id, type, memory_bytes)`` on one host with an (effectively free) link."""
    link = Link(inter_Bps, 0.0)
    return Cluster("hand", tuple(Device(i, t, "h", mem) for i, t, mem in devices), link, link)


def problem(times: list[float], devices: Cluster, *, microbatches: int = 4, schedule: str = "gpipe",
            param_bytes: int = 1, saved_bytes: int = 0, cut_bytes: int = 0) -> Problem:
    n = len(times)
    cuts = (cut_bytes,) * (n - 1)
    return Problem(blocks(times, param_bytes=param_bytes, saved_bytes=saved_bytes), cuts, cuts, devices,
                   microbatches, schedule, "sgd")


BIG = 10**9


def identical_two() -> Problem:
    """Four equal blocks on two identical devices: two blocks each, latencies (6, 6): 12 + 3 * 6 = 30."""
    return problem([1.0] * 4, cluster(("d0", FAST, BIG), ("d1", FAST, BIG)))


def fast_and_slow() -> Problem:
    """Four equal blocks, one fast and one slow device: three blocks on the fast one, latencies (9, 9): 45."""
    return problem([1.0] * 4, cluster(("slow0", SLOW, BIG), ("fast0", FAST, BIG)))


def memory_bound() -> Problem:
    """As ``fast_and_slow`` but the fast device holds one block's weights and gradients only (2 x 10 bytes
    each under SGD): the optimum leaves it under-used: latencies (3, 27): 30 + 3 * 27 = 111."""
    return problem([1.0] * 4, cluster(("slow0", SLOW, BIG), ("fast0", FAST, 25)), param_bytes=10)


def small_device_last() -> Problem:
    """1F1B keeps 2 micro-batches in flight on the first of two stages, 1 on the last. ``tiny`` holds one
    micro-batch of one block's activations only, so it must run the last stage (and a single block)."""
    return problem([1.0] * 3, cluster(("tiny", FAST, 2 + 10), ("roomy", FAST, BIG)), schedule="1f1b",
                   param_bytes=1, saved_bytes=10)
