"""The op graph of a profile as a networkx ``DiGraph``: one node per profile node, one edge per input read.

Built once (``op_graph``) and used wherever a graph algorithm is needed: the values live across a cut
(``last_reader``, for the bytes a cut carries), edges that skip stages (``skip_edges``), edges that run
backwards in a plan (``backward_edges``), and the profile's order checked as a topological order
(``topological_violations``). Pure: no torch, no files.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import networkx as nx

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # formats.profile checks its node order with this module
    from planner.formats.profile import Profile

__all__ = ["op_graph", "graph_of", "last_reader", "skip_edges", "backward_edges", "topological_violations"]


def op_graph(profile: "Profile") -> nx.DiGraph:
    """Nodes carry ``position`` (index in the profile), ``op``, ``output_bytes`` and ``grad`` (whether a
    gradient flows back along the value: model inputs and ``requires_grad=False`` outputs carry none)."""
    return graph_of(profile.nodes)


def graph_of(nodes: Sequence[Any]) -> nx.DiGraph:
    """``op_graph`` of a sequence of profile ``Node`` s (before a ``Profile`` exists: its validation uses it)."""
    graph = nx.DiGraph()
    for position, node in enumerate(nodes):
        graph.add_node(node.name, position=position, op=node.op, output_bytes=node.output_bytes,
                       grad=node.op != "input" and bool(node.extra.get("requires_grad", True)))
    for node in nodes:
        graph.add_edges_from((src, node.name) for src in node.inputs)
    return graph


def last_reader(graph: nx.DiGraph, group_of: Mapping[str, int]) -> dict[str, int]:
    """Per node that is read: the index of the last group (stage, block) that reads its value. A value
    produced in group ``i`` is live across cuts ``i .. last_reader - 1``."""
    return {name: max(group_of[reader] for reader in graph.successors(name))
            for name in graph.nodes if graph.out_degree(name)}


def skip_edges(graph: nx.DiGraph, group_of: Mapping[str, int]) -> list[tuple[str, str]]:
    """Edges whose value crosses more than one cut (routed through the groups in between)."""
    return [(u, v) for u, v in graph.edges if group_of[v] - group_of[u] > 1]


def backward_edges(graph: nx.DiGraph, group_of: Mapping[str, int]) -> list[tuple[str, str]]:
    """Edges ``u -> v`` with ``group(u) > group(v)``: a plan must have none. Nodes outside ``group_of`` are skipped."""
    return [(u, v) for u, v in graph.edges if u in group_of and v in group_of and group_of[u] > group_of[v]]


def topological_violations(graph: nx.DiGraph, order: Sequence[str]) -> list[tuple[str, str]]:
    """Edges ``u -> v`` where ``u`` does not come before ``v`` in ``order`` (empty: ``order`` is topological)."""
    position = {name: i for i, name in enumerate(order)}
    return [(u, v) for u, v in graph.edges if position.get(u, len(order)) >= position.get(v, -1)]
