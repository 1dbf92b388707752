"""The registry of placers: method name -> ``fn(problem, *, weights, **options) -> Partition``.

Placer modules register themselves at import time with ``register("name", fn)``. This module
imports none of them at the top, so a placer module may import ``register`` from here without a
cycle; the modules named in ``PLACER_MODULES`` are imported on the first lookup instead. A module
listed there that does not exist (yet) is skipped; any other import failure is a bug and propagates.

Public: ``register``, ``METHODS``, ``get``, ``names``, ``takes_weights``, ``Placed``, ``facts_of``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from planner.errors import PlannerError, UsageError
from planner.partition.problem import Partition, Problem

Placer = Callable[..., Partition]
"""``fn(problem: Problem, *, weights: Mapping[str, float], **options) -> Partition``."""

PLACER_MODULES = (
    "planner.partition.greedy",
    "planner.partition.baselines",
    "planner.partition.ilp",
    "planner.partition.dp",
)
"""Modules that register placers when imported, in the order their methods are listed."""


@dataclass(frozen=True)
class Method:
    name: str
    fn: Placer
    takes_weights: bool
    """Whether the placer reads the per-device weights (seed 003 S3); only those can be refined."""


class Placed(tuple):  # type: ignore[type-arg]
    """A ``Partition`` (it *is* the tuple of ``StageSpec``) that also carries top-level plan fields.

    A placer may return ``Placed(stages, {"solver": {...}})`` where a plain partition would do; every
    caller treats it as a partition, and ``partition()`` copies ``facts`` into the plan (the ILP's
    solver status, bound and gap).
    """

    facts: Mapping[str, Any]

    def __new__(cls, stages: Partition, facts: Mapping[str, Any]) -> "Placed":
        obj = super().__new__(cls, stages)
        obj.facts = dict(facts)
        return obj


def facts_of(partition: Partition) -> Mapping[str, Any]:
    """The plan fields a placer attached to ``partition`` (empty for a plain partition)."""
    return getattr(partition, "facts", {})


_registry: dict[str, Method] = {}
_loaded = False


def register(name: str, fn: Placer, *, takes_weights: bool = False) -> Placer:
    """Add placer ``fn`` under ``name`` (re-registering a name replaces it); returns ``fn``."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise PlannerError(f"method names are non-empty words (letters, digits, '-', '_'), found {name!r}")
    _registry[name] = Method(name, fn, takes_weights)
    return fn


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in PLACER_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


class _Methods(Mapping[str, Placer]):
    """Read-only, lazily loaded view of the registry: ``METHODS["greedy"]`` is the greedy placer."""

    def __getitem__(self, name: str) -> Placer:
        _load()
        return _registry[name].fn

    def __iter__(self) -> Iterator[str]:
        _load()
        return iter(sorted(_registry))

    def __len__(self) -> int:
        _load()
        return len(_registry)


METHODS: Mapping[str, Placer] = _Methods()


def names() -> tuple[str, ...]:
    """Registered method names, sorted."""
    return tuple(METHODS)


def get(name: str) -> Method:
    """The registered method ``name``; a one-line ``UsageError`` listing the methods otherwise."""
    _load()
    if name not in _registry:
        raise UsageError(f"unknown partition method {name!r}; expected one of {', '.join(names())}")
    return _registry[name]


def takes_weights(name: str) -> bool:
    return get(name).takes_weights


def call(name: str, problem: Problem, weights: Mapping[str, float], options: Mapping[str, Any]) -> Partition:
    """Run placer ``name`` on ``problem``."""
    return get(name).fn(problem, weights=weights, **options)
