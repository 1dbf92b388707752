"""The cluster file (docs/formats.md): devices, their types and hosts, and the links between them."""

from __future__ import annotations

from collections import Counter

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from planner.errors import InputFileError
from planner.formats._validate import Checker
from planner.formats.jsonio import read_document, write_json_atomic
from planner.formats.plan import SCHEDULE_RUNTIME_SCHEDULES

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Link:
    """A point-to-point link: a transfer of ``n`` bytes costs ``latency_s + n / bandwidth_Bps``."""

    bandwidth_Bps: float
    latency_s: float
    source: str = ""
    """Where the figure comes from (datasheet, measurement); informational."""
    host_copy: bool = False
    """The endpoints' own processors move the bytes (gloo over TCP between CPU processes): each end
    spends ``n / bandwidth_Bps`` of its time on a transfer, which cannot overlap its compute, and the
    link adds ``latency_s``. False (the default): DMA engines move them (NCCL on GPUs) while the
    devices compute."""

    def transfer_s(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_Bps

    def copy_s(self, nbytes: float) -> float:
        """Seconds each endpoint spends moving ``nbytes`` itself (0 unless ``host_copy``)."""
        return nbytes / self.bandwidth_Bps if self.host_copy and nbytes > 0 else 0.0

    def slowed(self, bandwidth_Bps: float, latency_s: float) -> "Link":
        """This link followed by another of ``bandwidth_Bps`` and ``latency_s`` (``--emulate-link``): the
        latencies add, and so do the seconds per byte."""
        return Link(1.0 / (1.0 / self.bandwidth_Bps + 1.0 / bandwidth_Bps), self.latency_s + latency_s,
                    f"{self.source or 'link'} + emulated {bandwidth_Bps:.3g} B/s, {latency_s:g} s", self.host_copy)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"bandwidth_Bps": self.bandwidth_Bps, "latency_s": self.latency_s}
        if self.host_copy:
            data["host_copy"] = True
        if self.source:
            data["source"] = self.source
        return data


LOCAL = Link(bandwidth_Bps=math.inf, latency_s=0.0, source="same device")


@dataclass(frozen=True)
class Device:
    id: str
    type: str
    host: str
    memory_bytes: int
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data = {"id": self.id, "type": self.type, "host": self.host, "memory_bytes": self.memory_bytes}
        data.update(self.extra)
        return data


@dataclass(frozen=True)
class Cluster:
    name: str
    devices: tuple[Device, ...]
    intra_host: Link
    inter_host: Link
    pairs: Mapping[tuple[str, str], Link] = field(default_factory=dict)
    """Measured or declared links for specific pairs, keyed by sorted (a, b)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    pass_overhead_s: float = 0.0
    """``runtime.pass_overhead_s``: what the pipeline runtime adds to every forward and backward pass beyond
    the stage's ops and its transfers (the schedule's Python, posting and completing its point-to-point
    operations); probed by ``plan profile --probe-links``. 0 when the file gives none."""
    pass_overhead_source: str = ""
    nics_per_host: int = 0
    """``links.inter_host.nics_per_host``: how many network interfaces a host's devices share for traffic to other
    hosts, each at ``inter_host``'s bandwidth. 0 (absent): one per device, as DGX-class hosts have, so every
    device of a host reaches the other hosts at the full bandwidth at once. The all-reduce across hosts, whose
    streams run from every device of a host at once, divides the bandwidth when fewer NICs than streams."""
    host_cores: int = 0
    """``runtime.host_cores``: how many processors the devices of one host share, for devices that are processes
    on a host's CPU cores (CPU ranks). 0 (absent): every device computes on its own processor, as GPUs do. When
    a host's ranks need more processor-seconds per step than its cores give, the cost model stretches their work
    until it fits (``planner.partition.sim.step``)."""
    pass_byte_overhead_s: float = 0.0
    """``runtime.pass_byte_overhead_s``: seconds per byte that a pass sends or receives across devices, paid by
    the sending and the receiving pass on top of the link's own figures. A ping-pong between idle ranks
    (the links' figures) misses what moving activations costs inside a running pipeline (on CPU ranks,
    gloo's copies through the kernel compete with the compute for the same cores); probed by
    ``plan profile --probe-links`` with large messages. 0 when the file gives none."""
    pass_compute_overhead_s: float = 0.0
    """``runtime.pass_compute_overhead_s``: the part of ``pass_overhead_s`` the runtime spends inside the pass methods
    it times as a rank's compute (``forward_one_chunk``, ``backward_one_chunk``: the stage's inputs and outputs, the
    autograd call), at most ``pass_overhead_s``. The simulator charges ``pass_overhead_s`` whole; calibration adds
    this part to the cost model's compute before comparing it with a rank's measured compute, which holds it
    (``RoundModel.predicted_compute_s``). Probed by ``plan profile --probe-links``; 0 when the file gives none."""
    schedule_runtime_pass_overhead_s: float = 0.0
    """``runtime.schedule_runtime_pass_overhead_s``: ``pass_overhead_s`` for the schedules torch runs through its
    ``_PipelineScheduleRuntime`` (``SCHEDULE_RUNTIME_SCHEDULES``: interleaved 1F1B and the zero-bubble ones), which
    every pass of theirs pays (``F``, ``B``, ``I``, ``W``). That runtime takes each send and receive as an action of its
    own and splits a backward with two autograd calls, so a pass costs it more than a pass of ``Schedule1F1B``.
    Probed by ``plan profile --probe-links`` (under ``zb-h1``); 0 (absent): ``pass_overhead_s``, as files written
    before it was probed say."""

    def pass_overhead_for(self, schedule: str) -> float:
        """What the runtime adds to every pass of ``schedule`` (``schedule_runtime_pass_overhead_s`` under a schedule
        of ``SCHEDULE_RUNTIME_SCHEDULES`` where the file gives it, else ``pass_overhead_s``)."""
        if schedule in SCHEDULE_RUNTIME_SCHEDULES and self.schedule_runtime_pass_overhead_s:
            return self.schedule_runtime_pass_overhead_s
        return self.pass_overhead_s

    @cached_property
    def content_key(self) -> str:
        """Equal for clusters that hold the same (every field, as ``repr`` writes it): what results computed from a
        cluster are remembered by, so that a copy made by ``dataclasses.replace`` finds them."""
        return repr(self)

    @cached_property
    def _by_id(self) -> dict[str, Device]:
        """Device id -> its device (the first listed, as ids are unique in a file)."""
        return {dev.id: dev for dev in reversed(self.devices)}

    def device(self, device_id: str) -> Device:
        dev = self._by_id.get(device_id)
        if dev is not None:
            return dev
        known = ", ".join(d.id for d in self.devices)
        raise InputFileError(f"device {device_id!r} is not in cluster {self.name!r} (devices: {known})")

    @property
    def device_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.devices)

    def most_on_one_host(self, device_type: str | None = None) -> int:
        """The most devices (of ``device_type``, or of any type) one host holds: the ranks that share its cores."""
        counts = Counter(d.host for d in self.devices if device_type is None or d.type == device_type)
        return max(counts.values(), default=0)

    def link(self, a: str, b: str) -> Link:
        """The link between devices ``a`` and ``b``: an explicit pair, else intra- or inter-host."""
        if a == b:
            return LOCAL
        pair = self.pairs.get((a, b) if a < b else (b, a))
        if pair is not None:
            return pair
        return self.intra_host if self.device(a).host == self.device(b).host else self.inter_host

    def transfer_s(self, a: str, b: str, nbytes: float) -> float:
        return self.link(a, b).transfer_s(nbytes)

    def slowed(self, bandwidth_Bps: float, latency_s: float) -> "Cluster":
        """The same cluster with every link between devices followed by an emulated one (``Link.slowed``)."""
        return replace(self, intra_host=self.intra_host.slowed(bandwidth_Bps, latency_s),
                       inter_host=self.inter_host.slowed(bandwidth_Bps, latency_s),
                       pairs={k: v.slowed(bandwidth_Bps, latency_s) for k, v in self.pairs.items()})

    def to_dict(self) -> dict[str, Any]:
        links: dict[str, Any] = {"intra_host": self.intra_host.to_dict(), "inter_host": self.inter_host.to_dict()}
        if self.nics_per_host:
            links["inter_host"]["nics_per_host"] = self.nics_per_host
        if self.pairs:
            links["pairs"] = [{"a": a, "b": b, **link.to_dict()} for (a, b), link in sorted(self.pairs.items())]
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "name": self.name}
        data.update(self.extra)
        data["devices"] = [d.to_dict() for d in self.devices]
        data["links"] = links
        if self.pass_overhead_s or self.pass_overhead_source or self.pass_byte_overhead_s or self.host_cores:
            data["runtime"] = {"pass_overhead_s": self.pass_overhead_s}
            if self.pass_byte_overhead_s:
                data["runtime"]["pass_byte_overhead_s"] = self.pass_byte_overhead_s
            if self.pass_compute_overhead_s:
                data["runtime"]["pass_compute_overhead_s"] = self.pass_compute_overhead_s
            if self.schedule_runtime_pass_overhead_s:
                data["runtime"]["schedule_runtime_pass_overhead_s"] = self.schedule_runtime_pass_overhead_s
            if self.host_cores:
                data["runtime"]["host_cores"] = self.host_cores
            if self.pass_overhead_source:
                data["runtime"]["source"] = self.pass_overhead_source
        return data


def cluster_from_dict(data: dict[str, Any], what: str = "cluster") -> Cluster:
    """Validate a cluster document; raises ``InputFileError`` naming the broken rule."""
    check = Checker(what, "fix that field in the cluster file (the fields are in docs/formats.md)")
    check.schema_version(data, SCHEMA_VERSION)
    name = check.get(data, "name", str)
    raw_devices = check.get(data, "devices", list)
    if not raw_devices:
        check.fail("devices", "a non-empty list", raw_devices, "list at least one device")
    devices = []
    for i, raw in enumerate(raw_devices):
        where = f"devices[{i}]"
        if not isinstance(raw, dict):
            check.fail(where, "an object", raw)
        memory = check.get(raw, "memory_bytes", (int, float), f"{where}.memory_bytes")
        if isinstance(memory, float) and not memory.is_integer():
            check.fail(f"{where}.memory_bytes", "a whole number of bytes", memory)
        memory = int(memory)  # 80e9 in a hand-written file is a whole number of bytes
        if memory <= 0:
            check.fail(f"{where}.memory_bytes", "positive", memory)
        devices.append(Device(
            id=check.get(raw, "id", str, f"{where}.id"),
            type=check.get(raw, "type", str, f"{where}.type"),
            host=check.get(raw, "host", str, f"{where}.host"),
            memory_bytes=memory,
            extra=MappingProxyType({k: v for k, v in raw.items() if k not in ("id", "type", "host", "memory_bytes")}),
        ))
    ids = [d.id for d in devices]
    if len(set(ids)) != len(ids):
        check.fail("devices[].id", "unique", sorted({i for i in ids if ids.count(i) > 1}))
    links = check.get(data, "links", dict)
    pairs: dict[tuple[str, str], Link] = {}
    for i, raw in enumerate(check.opt(links, "pairs", list, [], "links.pairs")):
        where = f"links.pairs[{i}]"
        if not isinstance(raw, dict):
            check.fail(where, "an object", raw)
        a = check.get(raw, "a", str, f"{where}.a")
        b = check.get(raw, "b", str, f"{where}.b")
        for end in (a, b):
            if end not in ids:
                check.fail(where, f"a pair of known device ids ({', '.join(ids)})", end)
        pairs[(a, b) if a < b else (b, a)] = _link(raw, where, check)
    extra = {k: v for k, v in data.items() if k not in ("schema_version", "name", "devices", "links", "runtime")}
    runtime = check.opt(data, "runtime", dict, {})
    overhead = float(check.opt(runtime, "pass_overhead_s", (int, float), 0.0, "runtime.pass_overhead_s"))
    check.non_negative(overhead, "runtime.pass_overhead_s")
    per_byte = float(check.opt(runtime, "pass_byte_overhead_s", (int, float), 0.0, "runtime.pass_byte_overhead_s"))
    check.non_negative(per_byte, "runtime.pass_byte_overhead_s")
    inner = float(check.opt(runtime, "pass_compute_overhead_s", (int, float), 0.0, "runtime.pass_compute_overhead_s"))
    check.non_negative(inner, "runtime.pass_compute_overhead_s")
    if inner > overhead:
        check.fail("runtime.pass_compute_overhead_s", f"at most runtime.pass_overhead_s ({overhead:g}), of which it is a "
                   f"part", inner, "probe again with plan profile --probe-links, or lower it")
    schedule_runtime = float(check.opt(runtime, "schedule_runtime_pass_overhead_s", (int, float), 0.0,
                                       "runtime.schedule_runtime_pass_overhead_s"))
    check.non_negative(schedule_runtime, "runtime.schedule_runtime_pass_overhead_s")
    cores = check.opt(runtime, "host_cores", int, 0, "runtime.host_cores")
    if "host_cores" in runtime and (isinstance(cores, bool) or cores < 1):
        check.fail("runtime.host_cores", "a whole number of processor cores per host, 1 or more", cores,
                   "give how many cores a host's CPU ranks share (omit it for GPUs)")
    intra = _link(check.get(links, "intra_host", dict, "links.intra_host"), "links.intra_host", check)
    hosts = sorted({d.host for d in devices})
    if "inter_host" in links or len(hosts) > 1:
        if "inter_host" not in links:
            check.fail("links.inter_host", "present (an object with bandwidth_Bps and latency_s)", "nothing",
                       f"the devices sit on {len(hosts)} hosts ({', '.join(hosts[:4])}), so say how they connect")
        inter = _link(check.get(links, "inter_host", dict, "links.inter_host"), "links.inter_host", check)
    else:
        inter = intra  # one host: no transfer ever crosses hosts
    inter_raw = links.get("inter_host") if isinstance(links.get("inter_host"), dict) else {}
    nics = check.opt(inter_raw, "nics_per_host", int, 0, "links.inter_host.nics_per_host")
    if "nics_per_host" in inter_raw and (isinstance(nics, bool) or nics < 1):
        check.fail("links.inter_host.nics_per_host", "a whole number of network interfaces per host, 1 or more", nics,
                   "give how many NICs a host's devices share (omit it when every device has its own)")
    return Cluster(
        name=name,
        devices=tuple(devices),
        intra_host=intra,
        inter_host=inter,
        pairs=MappingProxyType(pairs),
        extra=MappingProxyType(extra),
        pass_overhead_s=overhead,
        pass_overhead_source=str(runtime.get("source", "")),
        nics_per_host=int(nics),
        pass_byte_overhead_s=per_byte,
        pass_compute_overhead_s=inner,
        schedule_runtime_pass_overhead_s=schedule_runtime,
        host_cores=int(cores),
    )


def _link(raw: dict[str, Any], where: str, check: Checker) -> Link:
    bandwidth = float(check.get(raw, "bandwidth_Bps", float, f"{where}.bandwidth_Bps"))
    latency = float(check.get(raw, "latency_s", float, f"{where}.latency_s"))
    if bandwidth <= 0:
        check.fail(f"{where}.bandwidth_Bps", "positive", bandwidth)
    check.non_negative(latency, f"{where}.latency_s")
    host_copy = raw.get("host_copy", False)
    if not isinstance(host_copy, bool):
        check.fail(f"{where}.host_copy", "true or false", host_copy)
    return Link(bandwidth, latency, str(raw.get("source", "")), host_copy)


def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster file (JSON, or YAML by extension)."""
    return cluster_from_dict(read_document(path, "cluster"), f"cluster {str(path)!r}")


def save_cluster(cluster: Cluster, path: str | Path) -> Path:
    return write_json_atomic(path, cluster.to_dict())
