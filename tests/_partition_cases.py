"""Hand-made profiles and clusters shared by the cost-model and simulator tests."""

from __future__ import annotations

from typing import Any, Sequence

from planner.formats.cluster import Cluster, cluster_from_dict
from planner.formats.profile import Profile, profile_from_dict

GIB = 2**30


def node(name: str, inputs: Sequence[str] = (), *, op: str = "aten.mm.default", out: int = 100, params: int = 0,
         saved: int = 0, times: dict[str, tuple[float, float]] | None = None, module_path: str = "",
         **extra: Any) -> dict[str, Any]:
    times = times if times is not None else {"cpu": (1.0, 2.0)}
    return {"name": name, "op": op, "inputs": list(inputs), "output_bytes": out, "param_bytes": params,
            "saved_bytes": saved, "module_path": module_path,
            "time_s": {t: {"fwd": f, "bwd": b, "source": "measured"} for t, (f, b) in times.items()}, **extra}


def profile(*nodes: dict[str, Any]) -> Profile:
    return profile_from_dict({"schema_version": 1, "model": {"name": "toy", "source": "t:f", "microbatch_size": 1},
                              "nodes": list(nodes)})


def chain(n: int, *, fwd: float = 1.0, bwd: float = 2.0, out: int = 100, params: int = 10, saved: int = 7,
          types: Sequence[str] = ("cpu",)) -> Profile:
    """An input followed by ``n`` ops in a chain, each with the same costs."""
    nodes = [node("x", op="input", out=out, times={t: (0.0, 0.0) for t in types})]
    for i in range(n):
        nodes.append(node(f"op{i}", [nodes[-1]["name"]], out=out, params=params, saved=saved,
                          times={t: (fwd, bwd) for t in types}, module_path=f"layers.{i}.mlp"))
    return profile(*nodes)


def cluster(n: int, *, dev_type: str = "cpu", hosts: int = 1, bandwidth_Bps: float = 1e9, latency_s: float = 0.0,
            inter_bandwidth_Bps: float | None = None, inter_latency_s: float | None = None,
            memory_bytes: int = 16 * GIB, types: Sequence[str] | None = None,
            pairs: Sequence[dict[str, Any]] = ()) -> Cluster:
    """``n`` devices ``d0..`` spread round-robin over ``hosts`` hosts."""
    devices = [{"id": f"d{i}", "type": types[i] if types else dev_type, "host": f"h{i % hosts}",
                "memory_bytes": memory_bytes} for i in range(n)]
    inter_bw = bandwidth_Bps if inter_bandwidth_Bps is None else inter_bandwidth_Bps
    inter_lat = latency_s if inter_latency_s is None else inter_latency_s
    return cluster_from_dict({
        "schema_version": 1, "name": "test", "devices": devices,
        "links": {"intra_host": {"bandwidth_Bps": bandwidth_Bps, "latency_s": latency_s},
                  "inter_host": {"bandwidth_Bps": inter_bw, "latency_s": inter_lat},
                  "pairs": list(pairs)},
    })


FREE = 1e30
"""A bandwidth that makes transfers free for textbook cases."""
