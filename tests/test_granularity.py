"""Granularity: blocks are contiguous module runs, every op in one block, no edge backwards."""

from __future__ import annotations

import random

import pytest

from planner.errors import PlannerError, UsageError
from planner.formats.profile import Node, OpTime, Profile
from planner.partition.model.granularity import groups_for, parse_granularity

_T = {"cpu": OpTime(1e-3, 2e-3, "measured")}


def _node(name: str, path: str, inputs: tuple[str, ...] = (), op: str = "aten.mm.default") -> Node:
    return Node(name=name, op=op, inputs=inputs, output_bytes=8, param_bytes=0, time_s=_T, module_path=path)


def _chain(paths: list[str]) -> Profile:
    nodes = [_node("x", "", op="input")]
    for i, path in enumerate(paths):
        nodes.append(_node(f"n{i}", path, (nodes[-1].name,)))
    return Profile(model={"name": "toy"}, nodes=tuple(nodes))


def _names(groups: list[list[str]]) -> list[list[str]]:
    return [list(g) for g in groups]


def test_layer_groups_follow_repeated_modules_and_glue_joins_the_next_block() -> None:
    profile = _chain(["wte", "h.0.attn", "h.0.mlp", "", "h.1.attn", "h.1.mlp", "ln_f", "lm_head"])
    assert _names(groups_for(profile, "layer")) == [
        ["x", "n0"], ["n1", "n2"], ["n3", "n4", "n5"], ["n6"], ["n7"]]


def test_depth_groups_cut_paths_at_n_components() -> None:
    profile = _chain(["wte", "h.0.attn.q", "h.0.attn.k", "h.0.mlp", "h.1.attn.q"])
    assert _names(groups_for(profile, "depth:1")) == [["x", "n0"], ["n1", "n2", "n3", "n4"]]
    assert _names(groups_for(profile, "depth:3")) == [["x", "n0"], ["n1", "n2"], ["n3"], ["n4"]]


def test_non_contiguous_module_runs_become_separate_blocks() -> None:
    # a shared layer called twice (weight tying, recurrent use) appears in two runs
    profile = _chain(["enc.0", "shared", "enc.1", "shared"])
    groups = groups_for(profile, "layer")
    assert _names(groups) == [["x", "n0"], ["n1"], ["n2"], ["n3"]]


def test_op_and_count_granularity() -> None:
    profile = _chain(["a", "b", "c", "d", "e", "f"])
    assert len(groups_for(profile, "op")) == 7
    assert [len(g) for g in groups_for(profile, "count:3")] == [3, 2, 2]
    assert len(groups_for(profile, "count:100")) == 7


def test_trailing_unnamed_nodes_join_the_last_block() -> None:
    profile = _chain(["a", "", ""])
    assert _names(groups_for(profile, "layer")) == [["x", "n0", "n1", "n2"]]
    assert _names(groups_for(_chain(["", ""]), "layer")) == [["x", "n0", "n1"]]


@pytest.mark.parametrize("bad", ["", "layers", "depth", "depth:0", "depth:x", "count:-1", "count:", "ops:3"])
def test_bad_granularity_is_one_line_usage_error(bad: str) -> None:
    with pytest.raises(UsageError) as info:
        parse_granularity(bad)
    assert "\n" not in str(info.value)
    assert "expected" in str(info.value) or "needs" in str(info.value)


def test_parse_accepts_case_and_spaces() -> None:
    assert parse_granularity(" Depth:2 ") == ("depth", 2)
    assert parse_granularity("LAYER") == ("layer", 0)


def _random_dag(seed: int) -> Profile:
    """A random DAG in topological order with module paths that repeat non-contiguously."""
    rng = random.Random(seed)
    paths = ["", "emb", "h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp", "head", "shared.a", "shared.b"]
    nodes = [_node("in0", "", op="input"), _node("in1", "", op="input")]
    for i in range(40):
        k = rng.randint(1, 3)
        inputs = tuple(sorted({rng.choice(nodes).name for _ in range(k)}))
        nodes.append(_node(f"v{i}", rng.choice(paths), inputs))
    return Profile(model={"name": f"dag{seed}"}, nodes=tuple(nodes))


@pytest.mark.parametrize("granularity", ["op", "layer", "depth:1", "depth:2", "depth:3", "count:1", "count:7"])
@pytest.mark.parametrize("seed", range(5))
def test_every_grouping_is_a_valid_op_level_plan(granularity: str, seed: int) -> None:
    profile = _random_dag(seed)
    groups = groups_for(profile, granularity)
    flat = [name for group in groups for name in group]
    assert flat == [node.name for node in profile.nodes]  # every op exactly once, in order
    assert all(groups)
    block = {name: b for b, group in enumerate(groups) for name in group}
    for node in profile.nodes:
        for src in node.inputs:
            assert block[src] <= block[node.name]  # no edge runs backwards


def test_groups_are_accepted_by_build_problem() -> None:
    build_problem = pytest.importorskip("planner.partition.model.problem").build_problem
    from planner.formats.cluster import Cluster, Device, Link

    profile = _random_dag(0)
    link = Link(1e10, 1e-6)
    cluster = Cluster("c", (Device("d0", "cpu", "h", 10**9),), link, link)
    for granularity in ("layer", "depth:2", "count:5"):
        groups = groups_for(profile, granularity)
        problem = build_problem(profile, cluster, microbatches=4, schedule="gpipe", groups=groups)
        assert [b.nodes for b in problem.blocks] == [tuple(g) for g in groups]
    with pytest.raises(PlannerError):
        build_problem(profile, cluster, microbatches=4, schedule="gpipe", groups=[["v0"]])
