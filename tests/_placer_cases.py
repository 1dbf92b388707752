"""Hand-made profiles for the placer tests: ops with chosen times, params and module paths."""

from __future__ import annotations

from typing import Sequence

from _partition_cases import FREE, GIB, cluster, node, profile
from planner.formats.cluster import Cluster
from planner.formats.plan import Plan
from planner.formats.profile import Profile

__all__ = ["FREE", "GIB", "cluster", "devices", "free_cluster", "layered", "mixed_cluster", "ops", "sizes"]


def ops(times: Sequence[float], *, types: Sequence[str] = ("cpu",), speed: dict[str, float] | None = None,
        params: Sequence[int] | None = None, saved: int = 0, out: int = 100) -> Profile:
    """An input then one op per entry of ``times`` (forward; backward is twice that), in a chain.

    ``speed`` divides a type's times (``{"fast": 2.0}`` halves them); op ``i`` is in module ``layers.i``.
    """
    speed = speed or {}
    nodes = [node("x", op="input", out=out, times={t: (0.0, 0.0) for t in types})]
    for i, fwd in enumerate(times):
        nodes.append(node(f"op{i}", [nodes[-1]["name"]], out=out, params=params[i] if params else 0, saved=saved,
                          times={t: (fwd / speed.get(t, 1.0), 2 * fwd / speed.get(t, 1.0)) for t in types},
                          module_path=f"layers.{i}.fc"))
    return profile(*nodes)


def layered(layers: int, *, ops_per_layer: int = 2, head: bool = True, embed: bool = True,
            params_per_op: int = 10, fwd: float = 1.0) -> Profile:
    """``embed`` op, ``layers`` repeated blocks (``h.<i>``) of ``ops_per_layer`` ops, then a ``head`` op."""
    nodes = [node("x", op="input", times={"cpu": (0.0, 0.0)})]
    def add(name: str, path: str) -> None:
        nodes.append(node(name, [nodes[-1]["name"]], params=params_per_op, times={"cpu": (fwd, 2 * fwd)},
                          module_path=path))
    if embed:
        add("embed", "wte")
    for i in range(layers):
        for j in range(ops_per_layer):
            add(f"l{i}_{j}", f"h.{i}.op{j}")
    if head:
        add("head", "lm_head")
    return profile(*nodes)


def sizes(plan: Plan) -> list[int]:
    """Nodes per stage."""
    return [len(stage.nodes) for stage in plan.stages]


def devices(plan: Plan) -> list[str]:
    return [stage.device for stage in plan.stages]


def free_cluster(n: int, **kwargs: object) -> Cluster:
    """``n`` devices with free transfers (bandwidth ~infinite, no latency)."""
    return cluster(n, bandwidth_Bps=FREE, **kwargs)  # type: ignore[arg-type]


def mixed_cluster(*specs: tuple[str, str, int], bandwidth_Bps: float = FREE, latency_s: float = 0.0) -> Cluster:
    """Devices given as ``(id, type, memory_bytes)`` on one host."""
    from planner.formats.cluster import cluster_from_dict

    link = {"bandwidth_Bps": bandwidth_Bps, "latency_s": latency_s}
    return cluster_from_dict({"schema_version": 1, "name": "mixed-test",
                              "devices": [{"id": i, "type": t, "host": "h0", "memory_bytes": m} for i, t, m in specs],
                              "links": {"intra_host": link, "inter_host": link}})
