"""Seeded synthetic profiles and clusters of any size, for placer tests and benchmarks.

``transformer_like`` builds a chain of layers, each a run of ops with a residual edge from the layer's
input to its last op (so values skip ops, as in real models), random per-op costs, and device types
whose speeds differ per op (not by one constant factor). ``synthetic_cluster`` spreads devices of the
given types over hosts. Both are deterministic for a given seed.
"""

from __future__ import annotations

import random
from typing import Any, Mapping, Sequence

from planner.formats.cluster import Cluster, cluster_from_dict
from planner.formats.profile import Profile, profile_from_dict

GIB = 2**30
SLOWDOWN = {"h100-sxm": 1.0, "a100-80g": 2.2, "v100-32g": 4.5, "l4": 6.0, "t4": 9.0, "cpu": 40.0}
"""Typical time of an op on each type relative to an H100 (each op then varies by +-30%)."""


def transformer_like(num_ops: int, *, ops_per_layer: int = 12, device_types: Sequence[str] = ("h100-sxm", "a100-80g"),
                     seed: int = 0, base_time_s: float = 1e-4, activation_bytes: int = 2**21,
                     param_bytes: int = 2**22) -> Profile:
    """``num_ops`` ops (plus one input) in layers of ``ops_per_layer``, module paths ``layers.<i>.op<j>``."""
    rng = random.Random(seed)
    nodes: list[dict[str, Any]] = [_node("x", (), "input", activation_bytes, 0, 0, "", {t: (0.0, 0.0) for t in device_types})]
    layer_input = "x"
    for i in range(num_ops):
        layer, j = divmod(i, ops_per_layer)
        if j == 0:
            layer_input = nodes[-1]["name"]
        inputs = (nodes[-1]["name"],)
        if j == ops_per_layer - 1 and layer_input != nodes[-1]["name"]:
            inputs = (nodes[-1]["name"], layer_input)
        fwd = base_time_s * rng.uniform(0.2, 2.0)
        times = {t: _scaled(fwd, t, rng) for t in device_types}
        out = int(activation_bytes * rng.choice((0.5, 1, 1, 2, 4)))
        params = param_bytes if j % 3 == 1 else 0
        nodes.append(_node(f"op{i}", inputs, "aten.mm.default", out, params, out, f"layers.{layer}.op{j}", times))
    return profile_from_dict({"schema_version": 1, "nodes": nodes,
                              "model": {"name": f"synthetic-{num_ops}", "source": "synthetic", "microbatch_size": 1}})


def _scaled(fwd: float, device_type: str, rng: random.Random) -> tuple[float, float]:
    factor = SLOWDOWN.get(device_type, 3.0) * rng.uniform(0.7, 1.3)
    return fwd * factor, 2 * fwd * factor


def _node(name: str, inputs: Sequence[str], op: str, out: int, params: int, saved: int, module_path: str,
          times: Mapping[str, tuple[float, float]]) -> dict[str, Any]:
    return {"name": name, "op": op, "inputs": list(inputs), "output_bytes": out, "param_bytes": params,
            "saved_bytes": saved, "module_path": module_path,
            "time_s": {t: {"fwd": f, "bwd": b, "source": "measured"} for t, (f, b) in times.items()}}


def synthetic_cluster(num_devices: int, *, device_types: Sequence[str] = ("h100-sxm", "a100-80g"),
                      per_host: int = 8, memory_bytes: int = 80 * GIB) -> Cluster:
    """``num_devices`` devices, ``per_host`` per host; each host holds one type, types taking turns by host."""
    devices = [{"id": f"h{i // per_host}-d{i % per_host}", "type": device_types[(i // per_host) % len(device_types)],
                "host": f"h{i // per_host}", "memory_bytes": memory_bytes} for i in range(num_devices)]
    return cluster_from_dict({
        "schema_version": 1, "name": f"synthetic-{num_devices}", "devices": devices,
        "links": {"intra_host": {"bandwidth_Bps": 300e9, "latency_s": 3e-6},
                  "inter_host": {"bandwidth_Bps": 25e9, "latency_s": 5e-6}},
    })
