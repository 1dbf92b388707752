"""The placer table: method name -> ``fn(problem, *, weights, **options) -> Partition``.

The built-in placers are listed explicitly in ``BUILTIN``, in the order the CLI lists them; importing
this module imports them all, so a broken placer fails loudly at import instead of making a later
lookup say "unknown method". ``register`` adds a placer at run time (tests and extensions use it); it
never replaces a built-in one.

Public: ``Method``, ``BUILTIN``, ``PEER_BASELINES``, ``register``, ``METHODS``, ``get``, ``names``, ``takes_weights``,
``call``,
and ``Placed``/``facts_of`` (re-exported from ``planner.partition.model.problem``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping

from planner.errors import PlannerError, UsageError
from planner.partition.model.problem import Partition, Placed, Problem, facts_of
from planner.partition.placers import baselines, dp, greedy, ilp

__all__ = ["Method", "BUILTIN", "PEER_BASELINES", "METHODS", "Placed", "facts_of", "register", "get", "names",
           "takes_weights", "call"]

Placer = Callable[..., Partition]
"""``fn(problem: Problem, *, weights: Mapping[str, float], **options) -> Partition``."""


@dataclass(frozen=True)
class Method:
    name: str
    fn: Placer
    takes_weights: bool
    """Whether the placer reads the per-device weights (the rebalancing patent's S3); only those can be refined."""


BUILTIN: Mapping[str, Method] = MappingProxyType({m.name: m for m in (
    Method("greedy", greedy.place, takes_weights=True),
    Method("uniform", baselines.uniform, takes_weights=False),
    Method("params", baselines.params, takes_weights=False),
    Method("time-balance", baselines.time_balance, takes_weights=False),
    Method("ilp", ilp.ilp_placer, takes_weights=False),
    Method("dp", dp.dp_placer, takes_weights=False),
)})
"""The built-in placers."""

_extra: dict[str, Method] = {}


PEER_BASELINES = ("uniform", "params", "time-balance")
"""The peers' methods (docs/placers.md, "The peers' baselines"): a plan of theirs is the split those tools make, so
``partition`` never moves its cuts afterwards (the whole plan's cut polish is for our methods)."""


def register(name: str, fn: Placer, *, takes_weights: bool = False) -> Placer:
    """Add placer ``fn`` under ``name`` (re-registering an added name replaces it); returns ``fn``."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise PlannerError(f"method names are non-empty words (letters, digits, '-', '_'), found {name!r}")
    if name in BUILTIN:
        raise PlannerError(f"method {name!r} is built in and cannot be replaced; register it under another name")
    _extra[name] = Method(name, fn, takes_weights)
    return fn


def _all() -> dict[str, Method]:
    return {**BUILTIN, **_extra}


class _Methods(Mapping[str, Placer]):
    """Read-only view of the table: ``METHODS["greedy"]`` is the greedy placer."""

    def __getitem__(self, name: str) -> Placer:
        return _all()[name].fn

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(_all()))

    def __len__(self) -> int:
        return len(_all())


METHODS: Mapping[str, Placer] = _Methods()


def names() -> tuple[str, ...]:
    """Method names, sorted."""
    return tuple(METHODS)


def get(name: str) -> Method:
    """The method ``name``; a one-line ``UsageError`` listing the methods otherwise."""
    methods = _all()
    if name not in methods:
        raise UsageError(f"unknown partition method {name!r}; expected one of {', '.join(names())}")
    return methods[name]


def takes_weights(name: str) -> bool:
    return get(name).takes_weights


def call(name: str, problem: Problem, weights: Mapping[str, float], options: Mapping[str, Any]) -> Partition:
    """Run placer ``name`` on ``problem``."""
    return get(name).fn(problem, weights=weights, **options)
