"""Granularity: how the profile's ops are grouped into the blocks that placers never split.

Exact placers (ILP, DP) scale with the number of blocks, so they work on coarser units than ops.
A granularity is one of:

- ``op``: one block per node (the finest; what ``build_problem`` does without groups).
- ``layer``: consecutive nodes with the same ``layer_of(module_path)`` (``h.3.attn.c_attn`` -> ``h.3``).
- ``depth:N``: consecutive nodes whose module paths agree on their first ``N`` components.
- ``count:N``: ``N`` contiguous blocks of (as nearly as possible) equal numbers of nodes.

Every grouping is a list of *contiguous* runs of the profile's nodes in its topological order, so
every node lies in exactly one block and no edge runs backwards, whatever the placer does with the
blocks. A module whose ops are not contiguous in that order (say a shared layer called twice) becomes
several blocks, one per run. Nodes without a module path (model inputs, root-level glue) join the
block that follows them, or the last block at the end of the graph, so they never make blocks of
their own that no placer would want.
"""

from __future__ import annotations

from typing import Callable

from planner.errors import UsageError
from planner.formats.profile import Profile
from planner.partition.model.problem import layer_of

__all__ = ["GRANULARITIES", "groups_for", "parse_granularity"]

GRANULARITIES = ("op", "layer", "depth:N", "count:N")
"""The accepted spellings, for help texts."""


def parse_granularity(granularity: str) -> tuple[str, int]:
    """Split ``depth:3`` into ``("depth", 3)``; ``op`` and ``layer`` carry 0. Raises ``UsageError``."""
    text = granularity.strip().lower()
    if text in ("op", "layer"):
        return text, 0
    kind, sep, number = text.partition(":")
    if sep and kind in ("depth", "count"):
        if number.isdigit() and int(number) >= 1:
            return kind, int(number)
        raise UsageError(f"--granularity {granularity!r}: {kind}:N needs a positive integer N, found {number!r}; "
                         f"e.g. {kind}:2")
    raise UsageError(f"--granularity {granularity!r} is not recognised; expected one of {', '.join(GRANULARITIES)} "
                     f"(e.g. layer, depth:2, count:32)")


def groups_for(profile: Profile, granularity: str) -> list[list[str]]:
    """Contiguous node groups for ``build_problem(groups=...)`` at the given granularity."""
    kind, number = parse_granularity(granularity)
    names = [node.name for node in profile.nodes]
    if kind == "op":
        return [[name] for name in names]
    if kind == "count":
        return _even_runs(names, number)
    key = _module_key(kind, number)
    return _runs_by_key(names, [key(node.module_path) for node in profile.nodes])


def _module_key(kind: str, depth: int) -> Callable[[str], str]:
    if kind == "layer":
        return layer_of
    return lambda path: ".".join(path.split(".")[:depth]) if path else ""


def _runs_by_key(names: list[str], keys: list[str]) -> list[list[str]]:
    """Maximal runs of equal non-empty keys; empty-key nodes join the next run (the last one at the end)."""
    groups: list[list[str]] = []
    pending: list[str] = []
    current: str | None = None
    for name, key in zip(names, keys):
        if not key:
            pending.append(name)
            continue
        if key == current:
            groups[-1].extend(pending)  # unnamed glue inside one module's run keeps the run whole
            groups[-1].append(name)
        else:
            groups.append(pending + [name])
        pending, current = [], key
    if pending:
        if groups:
            groups[-1].extend(pending)
        else:
            groups.append(pending)
    return groups


def _even_runs(names: list[str], count: int) -> list[list[str]]:
    """``count`` contiguous runs whose sizes differ by at most one (fewer when there are fewer nodes)."""
    count = min(count, len(names))
    base, extra = divmod(len(names), count)
    groups, start = [], 0
    for i in range(count):
        stop = start + base + (1 if i < extra else 0)
        groups.append(names[start:stop])
        start = stop
    return groups
