"""``planner.graph``: the op graph and the graph questions the planner asks of it, on hand-made graphs."""

from __future__ import annotations

from _partition_cases import node, profile

from planner.graph import backward_edges, last_reader, op_graph, skip_edges, topological_violations


def _skip_net():  # type: ignore[no-untyped-def]
    """x -> a -> b -> c, plus a skip a -> c and a model-input read x -> b."""
    return profile(node("x", op="input"), node("a", ["x"]), node("b", ["a", "x"]), node("c", ["b", "a"]))


def test_nodes_and_edges_follow_the_profile() -> None:
    graph = op_graph(_skip_net())
    assert list(graph.nodes) == ["x", "a", "b", "c"]
    assert sorted(graph.edges) == [("a", "b"), ("a", "c"), ("b", "c"), ("x", "a"), ("x", "b")]
    assert graph.nodes["x"]["grad"] is False and graph.nodes["a"]["grad"] is True
    assert [graph.nodes[n]["position"] for n in graph.nodes] == [0, 1, 2, 3]


def test_last_reader_and_skips_across_groups() -> None:
    graph = op_graph(_skip_net())
    group_of = {"x": 0, "a": 0, "b": 1, "c": 2}
    assert last_reader(graph, group_of) == {"x": 1, "a": 2, "b": 2}
    assert skip_edges(graph, group_of) == [("a", "c")]


def test_backward_edges_name_the_offending_pair() -> None:
    graph = op_graph(_skip_net())
    assert backward_edges(graph, {"x": 0, "a": 1, "b": 0, "c": 1}) == [("a", "b")]
    assert backward_edges(graph, {"x": 0, "a": 0, "b": 1, "c": 1}) == []


def test_topological_order_check() -> None:
    graph = op_graph(_skip_net())
    assert topological_violations(graph, ["x", "a", "b", "c"]) == []
    assert topological_violations(graph, ["x", "b", "a", "c"]) == [("a", "b")]
