"""Probe the links between ranks launched by torchrun and describe them as a cluster file.

Every pair of ranks (a, b), one pair at a time, runs a ping-pong of ``torch.distributed.send``/``recv``
over a sweep of message sizes (gloo on CPU, nccl on GPU); a one-way time is half the median round
trip. Per pair, ``time = latency_s + bytes / bandwidth_Bps`` (the Hockney model) is fitted by least
squares on relative residuals. Pairs on the same host give ``links.intra_host`` and pairs on different hosts
``links.inter_host`` (medians over pairs); a kind with no measured pair is marked as assumed.

With two hosts of two ranks or more, ``k`` ranks of one host then ping-pong the largest message with ``k`` ranks of
the other, all at once. Streams that each keep a network interface of their own take as long as one stream alone;
streams that share ``n`` interfaces take ``k / n`` times as long as the same pairs took one at a time in the
sweep. ``links.inter_host.nics_per_host`` records ``n``
when it is below ``k`` (``nics_from_streams``); otherwise it stays absent (an interface per device, as far as
``k`` streams can tell). A rank's host is its host name, or ``PLANNER_HOST`` where set (containers that share one
name; two emulated hosts on one machine).
"""

from __future__ import annotations

import dataclasses

import datetime
import os
import socket
import statistics
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Sequence

import torch

from planner.errors import DistributedError
from planner.formats.cluster import Cluster, Device, Link
from planner.profile.device import detect_device_type, device_memory_bytes

DEFAULT_SIZES = tuple(2 ** k for k in range(10, 25, 2))
"""Message sizes of the sweep: 1 KiB to 16 MiB, every factor of 4."""
HOST_ENV = "PLANNER_HOST"
"""Names the host a rank reports instead of ``socket.gethostname()``."""
ASSUMED_INTER_HOST = Link(12.5e9, 10e-6, "assumed: no inter-host pair was measured; nominal 100 Gb/s Ethernet")


@dataclass(frozen=True)
class PairFit:
    """The fitted link between ranks ``a < b`` and the samples it was fitted to."""

    a: int
    b: int
    bandwidth_Bps: float
    latency_s: float
    samples: tuple[tuple[int, float], ...]
    """(bytes, one-way seconds) per message size."""


def fit_latency_bandwidth(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Weighted least-squares fit of ``t = latency + bytes / bandwidth``; returns ``(bandwidth_Bps, latency_s)``.

    Weights are ``1 / t**2``, i.e. the fit minimises *relative* residuals, so the microsecond
    latencies of small messages count as much as the milliseconds of large ones (plain least squares
    lets the largest message decide the intercept). A non-positive slope (noise) falls back to the
    largest transfer's rate; a negative intercept is clamped to zero.
    """
    if len(samples) < 2:
        raise ValueError(f"need at least two (bytes, seconds) samples to fit a link, found {len(samples)}")
    xs = [float(x) for x, _ in samples]
    ys = [max(float(y), 1e-12) for _, y in samples]
    ws = [1.0 / (y * y) for y in ys]
    total = sum(ws)
    mx = sum(w * x for w, x in zip(ws, xs)) / total
    my = sum(w * y for w, y in zip(ws, ys)) / total
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (y - my) for w, x, y in zip(ws, xs, ys)) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        big = max(samples)
        return big[0] / max(big[1], 1e-12), max(0.0, min(ys))
    return 1.0 / slope, max(0.0, my - slope * mx)


def world_from_env() -> tuple[int, int]:
    """``(rank, world_size)`` from the torchrun environment; ``DistributedError`` for fewer than two ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        raise DistributedError(
            f"link probing needs at least 2 ranks, found world size {world}; launch it under torchrun, "
            f"e.g. `torchrun --nproc-per-node 2 --no-python plan profile --probe-links -o cluster.json`"
        )
    return int(os.environ.get("RANK", "0")), world


def rank_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU. ``DistributedError`` where
    the host runs more ranks than it has GPUs (see :func:`check_gpus_per_host`)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    check_gpus_per_host(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def check_gpus_per_host(local_ranks: int) -> None:
    """Refuse, in one line, more ranks on this host than it has GPUs. Each rank owns one GPU: NCCL refuses two
    ranks on one device (``invalid usage`` at the first collective, seen with NCCL 2.28.9 on one H200)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus and local_ranks > gpus:
        raise DistributedError(
            f"{local_ranks} ranks would share this host's {gpus} GPU(s), but each rank needs a GPU of its own "
            f"(NCCL refuses two ranks on one device); plan for a cluster with at most {gpus} device(s) on this "
            f"host, or run on a host with {local_ranks} GPUs")


def process_group_backend(device: torch.device) -> str:
    """The process group's backend for ranks on ``device``: on GPUs nccl moves CUDA tensors and gloo the CPU ones
    (the runtime's small control messages: rebalancing decisions, summaries, the parameter server's clocks); a
    bare "nccl" group fails those with "No backend type associated with device type cpu" (seen on an H200)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def probe_links(sizes: Sequence[int] = DEFAULT_SIZES, repeats: int = 5, name: str = "probed",
                timeout_s: float = 300.0) -> Cluster:
    """Probe every pair of ranks and return the cluster (the same object on every rank)."""
    import torch.distributed as dist

    from planner.runtime.probe import probe_runtime  # local: planner.runtime builds on planner.profile

    rank, world = world_from_env()
    started = not dist.is_initialized()
    device = rank_device()
    if started:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            dist.init_process_group(process_group_backend(device), timeout=datetime.timedelta(seconds=timeout_s))
        except Exception as exc:
            raise DistributedError(f"cannot start the process group for link probing: {exc}; check the torchrun "
                                   f"rendezvous settings (MASTER_ADDR, MASTER_PORT)") from None
    try:
        host = os.environ.get(HOST_ENV) or socket.gethostname()
        info = {"rank": rank, "host": host, "type": detect_device_type(device),
                "memory_bytes": device_memory_bytes(device), "cores": usable_cores()}
        infos: list[Any] = [None] * world
        dist.all_gather_object(infos, info)
        fits = []
        for a in range(world):
            for b in range(a + 1, world):
                if rank in (a, b):
                    samples = _sweep(dist, rank, b if rank == a else a, rank == a, sizes, repeats, device)
                    if rank == a:
                        bw, lat = fit_latency_bandwidth(samples)
                        fits.append(PairFit(a, b, bw, lat, tuple(samples)))
                dist.barrier()
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, fits)
        all_fits = sorted((f for part in gathered for f in part), key=lambda f: (f.a, f.b))
        streams = _concurrent_streams(dist, rank, infos, max(sizes), repeats, device)
        cluster = build_cluster(name, sorted(infos, key=lambda i: i["rank"]), all_fits, streams)
        runtime = probe_runtime(rank, device, cluster.link("rank0", "rank1"))  # collective: ranks 0 and 1 run it
    finally:
        if started:
            dist.destroy_process_group()
    return dataclasses.replace(cluster, pass_overhead_s=runtime.pass_overhead_s, pass_overhead_source=runtime.source,
                               pass_byte_overhead_s=runtime.pass_byte_overhead_s,
                               pass_compute_overhead_s=runtime.pass_compute_overhead_s,
                               schedule_runtime_pass_overhead_s=runtime.schedule_runtime_pass_overhead_s)


def _sweep(dist: Any, rank: int, peer: int, leader: bool, sizes: Sequence[int], repeats: int,
           device: torch.device) -> list[tuple[int, float]]:
    """Ping-pong ``repeats`` times per size; the leader returns (bytes, one-way seconds) per size."""
    samples = []
    for size in sizes:
        buf = torch.zeros(size, dtype=torch.uint8, device=device)
        times = []
        for i in range(repeats + 1):  # the first round trip warms the connection up
            begin = time.perf_counter()
            if leader:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:
                times.append((time.perf_counter() - begin) / 2)
        samples.append((size, statistics.median(times)))
    return samples


@dataclass(frozen=True)
class ConcurrentStreams:
    """Cross-host ping-pongs run at once: the rank pairs, the message size and the median one-way seconds."""

    pairs: tuple[tuple[int, int], ...]
    bytes: int
    one_way_s: float


def _concurrent_streams(dist: Any, rank: int, infos: Sequence[dict[str, Any]], size: int, repeats: int,
                        device: torch.device) -> ConcurrentStreams | None:
    """The first two hosts (by their lowest rank) pair their ranks in order, and every pair ping-pongs ``size`` bytes
    at once; None (nothing run) when either host has a single rank. Collective: every rank calls it."""
    hosts: dict[str, list[int]] = {}
    for info in sorted(infos, key=lambda i: i["rank"]):
        hosts.setdefault(info["host"], []).append(info["rank"])
    if len(hosts) < 2:
        return None
    first, second = list(hosts.values())[:2]
    pairs = tuple(zip(first, second))
    if len(pairs) < 2:
        return None
    mine = next((pair for pair in pairs if rank in pair), None)
    dist.barrier()
    one_way = None
    if mine is not None:
        leader = rank == mine[0]
        one_way = _sweep(dist, rank, mine[1] if leader else mine[0], leader, [size], repeats, device)[0][1]
    times: list[Any] = [None] * len(infos)
    dist.all_gather_object(times, one_way)
    return ConcurrentStreams(pairs=pairs, bytes=size, one_way_s=statistics.median(times[a] for a, _ in pairs))


def nics_from_streams(streams: int, alone_s: float, together_s: float) -> int:
    """Network interfaces that ``streams`` concurrent cross-host transfers shared: each took ``together_s`` where one
    alone takes ``alone_s``, so together they moved ``streams * alone_s / together_s`` streams' worth of bytes.
    0 when that is ``streams`` (rounded): they did not slow each other, an interface each as far as they can tell."""
    if streams < 2 or alone_s <= 0 or together_s <= 0:
        raise ValueError(f"need 2 or more streams and positive times, found {streams}, {alone_s}, {together_s}")
    shared = max(1, min(streams, round(streams * alone_s / together_s)))
    return 0 if shared >= streams else shared


def build_cluster(name: str, infos: Sequence[dict[str, Any]], fits: Sequence[PairFit],
                  streams: ConcurrentStreams | None = None) -> Cluster:
    """Cluster from per-rank device facts, fitted pairs and the concurrent cross-host streams (pure: no
    torch.distributed here); the runtime figures are added by ``probe_links``."""
    devices = tuple(Device(f"rank{i['rank']}", i["type"], i["host"], int(i["memory_bytes"]),
                           MappingProxyType({"rank": i["rank"]})) for i in infos)
    host = {i["rank"]: i["host"] for i in infos}
    pairs = {(f"rank{f.a}", f"rank{f.b}"): Link(f.bandwidth_Bps, f.latency_s, "measured") for f in fits}
    intra = [f for f in fits if host[f.a] == host[f.b]]
    inter = [f for f in fits if host[f.a] != host[f.b]]
    intra_link = _median_link(intra, "intra-host")
    inter_link = _median_link(inter, "inter-host")
    if inter_link is None:
        base = intra_link or ASSUMED_INTER_HOST
        inter_link = Link(min(base.bandwidth_Bps, ASSUMED_INTER_HOST.bandwidth_Bps),
                          max(base.latency_s, ASSUMED_INTER_HOST.latency_s), ASSUMED_INTER_HOST.source)
    if intra_link is None:
        intra_link = Link(inter_link.bandwidth_Bps, inter_link.latency_s,
                          "assumed: no intra-host pair was measured; copied from inter_host")
    samples = [{"a": f"rank{f.a}", "b": f"rank{f.b}", "bytes": [s for s, _ in f.samples],
                "one_way_s": [t for _, t in f.samples]} for f in fits]
    cores = 0
    if all(i["type"] == "cpu" for i in infos):  # gloo between CPU processes: the ranks copy the bytes
        intra_link, inter_link = (dataclasses.replace(link, host_copy=True) for link in (intra_link, inter_link))
        pairs = {key: dataclasses.replace(link, host_copy=True) for key, link in pairs.items()}
        cores = min((int(i["cores"]) for i in infos if i.get("cores")), default=0)  # the ranks share these
    extra: dict[str, Any] = {"probe_samples": samples}
    nics = 0
    if streams is not None:
        # the same pairs at the same size, measured one pair at a time by the sweep
        sweep = {(f.a, f.b): dict(f.samples) for f in fits}
        alone = statistics.median(sweep[min(a, b), max(a, b)][streams.bytes] for a, b in streams.pairs)
        nics = nics_from_streams(len(streams.pairs), alone, streams.one_way_s)
        extra["probe_streams"] = {"pairs": [[f"rank{a}", f"rank{b}"] for a, b in streams.pairs],
                                  "bytes": streams.bytes, "one_way_s": streams.one_way_s, "alone_s": alone}
    return Cluster(name=name, devices=devices, intra_host=intra_link, inter_host=inter_link,
                   pairs=MappingProxyType(pairs), extra=MappingProxyType(extra), host_cores=cores, nics_per_host=nics)


def usable_cores() -> int:
    """Processor cores this process may run on (its affinity mask where the platform has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _median_link(fits: Sequence[PairFit], kind: str) -> Link | None:
    if not fits:
        return None
    bandwidth = statistics.median(f.bandwidth_Bps for f in fits)
    latency = statistics.median(f.latency_s for f in fits)
    return Link(bandwidth, latency, f"measured: median of {len(fits)} {kind} pair(s), least-squares fit")
