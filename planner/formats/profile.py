"""The profile file (docs/formats.md): the captured op graph with measured costs.

Binding fields are ``schema_version``, ``model``, and per node ``name``, ``op``, ``inputs``,
``output_bytes``, ``param_bytes`` and ``time_s``. The extra per-node fields written here
(``module_path``, ``saved_bytes``, ``flops``, ``params``, ...) are optional on read, so profiles
written by other tools load too. Unknown fields are kept in ``extra`` and written back unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

from planner.errors import InputFileError
from planner.formats._validate import Checker
from planner.graph import graph_of, topological_violations
from planner.formats.jsonio import read_document, write_json_atomic

SCHEMA_VERSION = 1
INPUT_OP = "input"
SOURCES = ("measured", "estimated")


@dataclass(frozen=True)
class OpTime:
    """Forward and backward time of one node on one device type, per micro-batch."""

    fwd: float
    bwd: float
    source: str  # "measured" | "estimated"
    bwd_weight: float | None = None
    """The weight-gradient part of ``bwd`` (zero-bubble schedules); ``bwd - bwd_weight`` is the input-gradient part.
    ``None``: not split (the planner then splits by ``planner.partition.model.times.weight_shares``'s rule)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"fwd": self.fwd, "bwd": self.bwd, "source": self.source}
        if self.bwd_weight is not None:
            out["bwd_input"] = self.bwd - self.bwd_weight
            out["bwd_weight"] = self.bwd_weight
        return out


@dataclass(frozen=True)
class Node:
    """One op of the captured graph."""

    name: str
    """The captured graph's node name; the runtime maps plans back to the graph by it."""
    op: str
    """The target, e.g. ``aten.addmm.default``; ``input`` for a model input."""
    inputs: tuple[str, ...]
    """Names of producer nodes (earlier in the list); parameters are not nodes."""
    output_bytes: int
    """Bytes of this node's output: what crosses a stage cut."""
    param_bytes: int
    """Bytes of the parameters (and buffers) first used here; each counted once in the profile."""
    time_s: Mapping[str, OpTime]
    """Per device type: forward and backward seconds and whether measured or estimated."""
    saved_bytes: int = 0
    """Bytes this op keeps alive for backward (activation memory per micro-batch in flight)."""
    flops: int = 0
    """Forward FLOPs counted by FlopCounterMode (0 where uncounted or free)."""
    bwd_flops: int = 0
    """Backward FLOPs counted by FlopCounterMode."""
    module_path: str = ""
    """Dotted path of the innermost module that issued this op ("" for the root)."""
    params: tuple[str, ...] = ()
    """Fully qualified names of the parameters and buffers first used here."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields this version does not interpret, kept for round trips."""

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "op": self.op,
            "inputs": list(self.inputs),
            "output_bytes": self.output_bytes,
            "param_bytes": self.param_bytes,
            "time_s": {k: v.to_dict() for k, v in self.time_s.items()},
            "saved_bytes": self.saved_bytes,
            "flops": self.flops,
            "bwd_flops": self.bwd_flops,
            "module_path": self.module_path,
            "params": list(self.params),
        }
        data.update(self.extra)
        return data


@dataclass(frozen=True)
class Profile:
    """A whole profile: model description, nodes in topological order, and run-level facts."""

    model: Mapping[str, Any]
    nodes: tuple[Node, ...]
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Top-level fields such as ``device_type``, ``whole_model``, ``tied_parameters``, ``uncounted_flops``."""

    @property
    def device_types(self) -> tuple[str, ...]:
        """Device types that have a time for every node, sorted."""
        if not self.nodes:
            return ()
        common = set(self.nodes[0].time_s)
        for node in self.nodes[1:]:
            common &= set(node.time_s)
        return tuple(sorted(common))

    def node_index(self) -> dict[str, int]:
        return {node.name: i for i, node in enumerate(self.nodes)}

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "model": dict(self.model)}
        data.update({k: v for k, v in self.extra.items() if k not in ("nodes",)})
        data["nodes"] = [node.to_dict() for node in self.nodes]
        return data


_NODE_KEYS = {"name", "op", "inputs", "output_bytes", "param_bytes", "time_s", "saved_bytes", "flops",
              "bwd_flops", "module_path", "params"}


def profile_from_dict(data: dict[str, Any], what: str = "profile") -> Profile:
    """Validate a profile document and build a ``Profile``; raises ``InputFileError`` naming the broken rule."""
    check = Checker(what)
    check.schema_version(data, SCHEMA_VERSION)
    model = check.get(data, "model", dict)
    raw_nodes = check.get(data, "nodes", list)
    if not raw_nodes:
        check.fail("nodes", "a non-empty list", raw_nodes, "profile a model with at least one op")
    nodes: list[Node] = []
    seen: set[str] = set()
    for i, raw in enumerate(raw_nodes):
        if not isinstance(raw, dict):
            check.fail(f"nodes[{i}]", "an object", raw)
        node = _node_from_dict(raw, f"nodes[{i}]", check)
        if node.name in seen:
            check.fail(f"nodes[{i}].name", "unique", node.name)
        seen.add(node.name)
        nodes.append(node)
    graph = graph_of(nodes)
    order = [node.name for node in nodes]
    for src, dst in topological_violations(graph, order):
        raise InputFileError(f"{what}: node {dst!r} reads {src!r}, which is not an earlier node; "
                             f"nodes must be listed in topological order with every input defined")
    extra = {k: v for k, v in data.items() if k not in ("schema_version", "model", "nodes")}
    return Profile(model=MappingProxyType(dict(model)), nodes=tuple(nodes), extra=MappingProxyType(extra))


def _bwd_weight(t: dict[str, Any], bwd: float, where: str, check: Checker) -> float | None:
    """The optional split of ``bwd`` (design.md section 5): ``bwd_input`` and ``bwd_weight`` together, summing to it."""
    present = [k for k in ("bwd_input", "bwd_weight") if k in t]
    if not present:
        return None
    if len(present) == 1:
        check.fail(f"{where}.{present[0]}", "bwd_input and bwd_weight together (or neither)", t[present[0]])
    part_i = float(check.get(t, "bwd_input", float, f"{where}.bwd_input"))
    part_w = float(check.get(t, "bwd_weight", float, f"{where}.bwd_weight"))
    check.non_negative(part_i, f"{where}.bwd_input")
    check.non_negative(part_w, f"{where}.bwd_weight")
    if abs(part_i + part_w - bwd) > 1e-6 * max(bwd, 1e-9):
        check.fail(f"{where}.bwd_input + bwd_weight", f"their sum to equal bwd ({bwd!r})", part_i + part_w)
    return min(part_w, bwd)


def _node_from_dict(raw: dict[str, Any], where: str, check: Checker) -> Node:
    name = check.get(raw, "name", str, f"{where}.name")
    inputs = check.get(raw, "inputs", list, f"{where}.inputs")
    if not all(isinstance(x, str) for x in inputs):
        check.fail(f"{where}.inputs", "a list of node names", inputs)
    ints = {}
    for key in ("output_bytes", "param_bytes", "saved_bytes", "flops", "bwd_flops"):
        value = check.get(raw, key, int, f"{where}.{key}") if key in ("output_bytes", "param_bytes") else check.opt(raw, key, int, 0, f"{where}.{key}")
        check.non_negative(value, f"{where}.{key}")
        ints[key] = value
    times_raw = check.get(raw, "time_s", dict, f"{where}.time_s")
    times = {}
    for dev_type, t in sorted(times_raw.items()):
        tw = f"{where}.time_s.{dev_type}"
        if not isinstance(t, dict):
            check.fail(tw, "an object with fwd, bwd and source", t)
        fwd = float(check.get(t, "fwd", float, f"{tw}.fwd"))
        bwd = float(check.get(t, "bwd", float, f"{tw}.bwd"))
        check.non_negative(fwd, f"{tw}.fwd")
        check.non_negative(bwd, f"{tw}.bwd")
        source = check.get(t, "source", str, f"{tw}.source")
        if source not in SOURCES:
            check.fail(f"{tw}.source", "'measured' or 'estimated'", source)
        times[dev_type] = OpTime(fwd, bwd, source, _bwd_weight(t, bwd, tw, check))
    params = check.opt(raw, "params", list, [], f"{where}.params")
    return Node(
        name=name,
        op=check.get(raw, "op", str, f"{where}.op"),
        inputs=tuple(inputs),
        output_bytes=ints["output_bytes"],
        param_bytes=ints["param_bytes"],
        time_s=MappingProxyType(times),
        saved_bytes=ints["saved_bytes"],
        flops=ints["flops"],
        bwd_flops=ints["bwd_flops"],
        module_path=check.opt(raw, "module_path", str, "", f"{where}.module_path"),
        params=tuple(str(p) for p in params),
        extra=MappingProxyType({k: v for k, v in raw.items() if k not in _NODE_KEYS}),
    )


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file."""
    return profile_from_dict(read_document(path, "profile"), f"profile {str(path)!r}")


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write a profile atomically."""
    return write_json_atomic(path, profile.to_dict())
