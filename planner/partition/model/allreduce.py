"""The cost of synchronising a stage's replicas: one all-reduce of its gradients over the real links.

- **Within one host**: a ring all-reduce (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for
  clusters of workstations", JPDC 69(2), 2009; what NCCL's ring and gloo's ``ring`` algorithms do). ``d``
  devices move ``2 (d - 1)`` chunks of ``n / d`` bytes one after another, each over its ring neighbour's
  link, so ``t = 2 (d - 1) (latency + (n / d) / bandwidth)`` with the slowest link of the ring.
- **Across hosts**: the hierarchical all-reduce (Jia et al., "Highly scalable deep learning training system
  with mixed-precision", arXiv:1807.11205, 2018; Horovod's and NCCL's tree/ring over NICs): a reduce-scatter
  inside each host (``(g - 1)`` chunks of ``n / g`` bytes over the intra-host links, ``g`` the most replicas
  on one host), a ring all-reduce of each ``n / g`` shard across the ``h`` hosts (``2 (h - 1)`` chunks of
  ``n / (g h)`` bytes over the slowest inter-host link), and an all-gather inside each host (as the
  reduce-scatter). With one replica per host this is the ring across hosts. The ``g`` shard rings of a host
  run at once, one stream per device: with a NIC per device (the default) each has the inter-host
  bandwidth, but a host whose devices share ``k < g`` NICs (``links.inter_host.nics_per_host``) gives each
  stream ``k / g`` of it.

- **Through a parameter server** (the ``bsp``, ``asp``, ``ssp`` and ``dasp`` modes): the server rank sits
  beside the first replica's device; every worker pushes its gradients and pulls the parameters over its link
  to that device (a worker on the server's device uses the link to the nearest other device), and the server
  serves the workers one after another: ``t = sum_w 2 (latency_w + n / bandwidth_w + n x pass_byte_overhead_s)``.

Every chunk step also pays the runtime's cost per byte moved (``Cluster.pass_byte_overhead_s``, probed inside a
running pipeline, the figure the simulator charges point-to-point sends): in each step of a ring a device sends
one chunk and receives another, so the step takes ``2 x chunk bytes x pass_byte_overhead_s`` longer. On CPU ranks
that is most of the cost: gloo's copies and reductions run on the ranks' own cores. Measured here (2 gloo ranks
on one host, 24 MiB): the link's figures alone gave 4.7 ms, with the per-byte cost 20.5 ms, measured 23.1 ms.

- **In sub-tensors** (``adaptive``'s prioritised aggregation, docs/sync.md): the flat model is all-reduced as
  ``k = ceil(n / c)`` collectives of at most ``c`` bytes, one after another on the same links, so the bytes cost
  what one all-reduce's do and every latency is paid ``k`` times. ``c`` is chosen from the ring's slowest link
  (``sync_chunk_bytes``): the least size at which a ring step's latency is at most ``CHUNK_LATENCY_SHARE`` of the
  step, ``c >= d x bandwidth x latency x (1 - share) / share``, and at least ``CHUNK_FLOOR_BYTES``. A chunk much
  smaller than the link's bandwidth-delay product spends the link waiting: on a 5 ms, 1e8 B/s link, 256 KiB chunks
  of a 6.7 MB model pay 26 latencies of 5 ms per ring step, against 33 ms for the bytes.

Gradients have the parameters' size (``n`` = the stage's parameter bytes). The runtime all-reduces after
the replica's last backward (``planner.runtime.data_parallel``), so the simulator starts the sync when every
replica of the stage has finished its backward passes; see docs/cost-model.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Sequence

from planner.formats.cluster import Link

__all__ = ["allreduce_s", "server_exchange_s", "chunk_bytes_for", "sync_chunk_bytes", "CHUNK_LATENCY_SHARE",
           "CHUNK_FLOOR_BYTES"]

CHUNK_LATENCY_SHARE = 0.2
"""The largest share of a ring step the link's latency may take when an aggregation is cut into sub-tensors."""
CHUNK_FLOOR_BYTES = 1 << 18
"""The smallest automatic sub-tensor (256 KiB, ByteScheduler's order of magnitude on fast links)."""


def chunk_bytes_for(latency_s: float, bandwidth_Bps: float, ranks: int) -> int:
    """The sub-tensor size for a ring of ``ranks`` over a link of ``latency_s`` and ``bandwidth_Bps``: the least at
    which a ring step's latency is at most ``CHUNK_LATENCY_SHARE`` of it (each of the ``2 (d - 1)`` steps moves
    ``c / d`` bytes), at least ``CHUNK_FLOOR_BYTES``."""
    share = CHUNK_LATENCY_SHARE
    wanted = max(ranks, 1) * bandwidth_Bps * latency_s * (1.0 - share) / share
    return max(CHUNK_FLOOR_BYTES, int(math.ceil(wanted)))


def sync_chunk_bytes(devices: Sequence[str], link: Callable[[str, str], Link]) -> int:
    """``chunk_bytes_for`` on the slowest link of the ring through ``devices`` (in their order)."""
    slowest = _slowest(devices, link)
    return chunk_bytes_for(slowest.latency_s, slowest.bandwidth_Bps, len(devices))


def allreduce_s(devices: Sequence[str], nbytes: float, link: Callable[[str, str], Link],
                host: Mapping[str, str], nics_per_host: int = 0, byte_overhead_s: float = 0.0,
                chunk_bytes: float = 0.0) -> float:
    """Seconds to all-reduce ``nbytes`` over ``devices`` (see the module docstring for the formula);
    ``nics_per_host`` 0 means a NIC per device; ``byte_overhead_s``: the runtime's cost per byte a device sends or
    receives (``Cluster.pass_byte_overhead_s``); ``chunk_bytes`` > 0: as sub-tensors of that size, one after
    another (every latency paid once per sub-tensor)."""
    d = len(devices)
    if d < 2 or nbytes <= 0:
        return 0.0
    pieces = max(1, math.ceil(nbytes / chunk_bytes)) if chunk_bytes > 0 else 1
    if pieces > 1:  # the bytes cost what one all-reduce's do; every link's latency comes once per piece
        link = _latency_times(link, pieces)
    by_host: dict[str, list[str]] = {}
    for dev in devices:
        by_host.setdefault(host[dev], []).append(dev)
    if len(by_host) == 1:
        return _ring_s(list(devices), nbytes, link, byte_overhead_s)
    groups = list(by_host.values())
    g, h = max(len(x) for x in groups), len(groups)
    inside = min((_slowest(x, link) for x in groups if len(x) > 1), key=lambda k: (k.bandwidth_Bps, -k.latency_s),
                 default=None)
    leaders = [x[0] for x in groups]
    across = _slowest(leaders, link)
    scatter = (g - 1) * _chunk_s(inside, nbytes / g, byte_overhead_s) if inside is not None else 0.0
    share = min(1.0, nics_per_host / g) if nics_per_host else 1.0  # g streams over the host's NICs
    shard = nbytes / (g * h)
    return 2 * scatter + 2 * (h - 1) * (across.latency_s + shard / (across.bandwidth_Bps * share)
                                        + 2 * shard * byte_overhead_s)


def _latency_times(link: Callable[[str, str], Link], pieces: int) -> Callable[[str, str], Link]:
    """``link`` with every latency ``pieces`` times over (``pieces`` transfers one after another)."""
    def slower(a: str, b: str) -> Link:
        one = link(a, b)
        return dataclasses.replace(one, latency_s=one.latency_s * pieces)

    return slower


def _ring_s(devices: list[str], nbytes: float, link: Callable[[str, str], Link], byte_overhead_s: float) -> float:
    d = len(devices)
    return 2 * (d - 1) * _chunk_s(_slowest(devices, link), nbytes / d, byte_overhead_s)


def _slowest(ring: Sequence[str], link: Callable[[str, str], Link]) -> Link:
    """The ring's slowest link (each device to the next, the last to the first): least bandwidth, then most latency."""
    links = [link(ring[i], ring[(i + 1) % len(ring)]) for i in range(len(ring))]
    return min(links, key=lambda k: (k.bandwidth_Bps, -k.latency_s))


def _chunk_s(link: Link, nbytes: float, byte_overhead_s: float = 0.0) -> float:
    """One ring step: a chunk over ``link``, and the runtime's per-byte cost of sending one and receiving one."""
    return link.latency_s + nbytes / link.bandwidth_Bps + 2 * nbytes * byte_overhead_s


def server_exchange_s(devices: Sequence[str], nbytes: float, link: Callable[[str, str], Link],
                      byte_overhead_s: float = 0.0) -> float:
    """Seconds for a parameter server beside ``devices[0]`` to take every worker's gradients and hand back the
    parameters, one worker after another (the module docstring); each transfer also pays the runtime's cost per
    byte (``byte_overhead_s``), the server's and the worker's at once."""
    if len(devices) < 2 or nbytes <= 0:
        return 0.0
    home = devices[0]
    total = 0.0
    for dev in devices:
        via = link(home, dev) if dev != home else min((link(home, x) for x in devices[1:]),
                                                       key=lambda k: (-k.bandwidth_Bps, k.latency_s))
        total += 2 * (via.latency_s + nbytes / via.bandwidth_Bps + nbytes * byte_overhead_s)
    return total
