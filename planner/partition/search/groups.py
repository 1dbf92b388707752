"""Which devices form the replica pipelines of a hybrid shape (``search/hybrid.py`` simulates each grouping).

- *Dealings* (``pipelines_of``): the devices, in an order, dealt into ``d`` pipelines of ``k = devices // d``:
  ``pipeline-local`` (consecutive devices form a pipeline) or ``stage-local`` (consecutive devices replicate a stage).
- *Class counts* (``class_groupings``, Metis's search over device-type counts, Um et al., USENIX ATC 2024): every
  way to give the pipelines their devices by how many of each device class each takes, screened with the greedy
  placer, the fastest ``CLASS_GROUPINGS_KEPT`` going on to the plan's placer (``screened_first``).

``per_class_sequence`` lets a search place a pipeline once per sequence of device classes.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Callable, Mapping, Sequence

from planner.errors import PlannerError
from planner.partition.model.objective import DeviceClass
from planner.partition.model.problem import Partition, Problem, host_speed_order, with_schedule

__all__ = ["GROUPINGS", "PlaceFn", "pipelines_of", "class_groupings", "screened_first", "per_class_sequence",
           "CLASS_GROUPINGS_KEPT"]

GROUPINGS = ("pipeline-local", "stage-local")

PlaceFn = Callable[[Problem, Mapping[str, float]], Partition]
"""The placer (with its options bound): a sub-problem and its devices' weights -> a pure pipeline."""
SCREEN_SCHEDULES = ("gpipe", "1f1b")
"""The schedules the class-count screen simulates under: the plan's own when it is one of these, else 1F1B."""
BestFor = Callable[[Problem, PlaceFn, Mapping[str, float], list[list[str]]], tuple[float, Partition] | None]
"""``hybrid._best_for``: the fastest hybrid over given pipelines with a placer, and its step time."""


def pipelines_of(devices: Sequence[str], degree: int, grouping: str) -> list[list[str]]:
    """``devices`` (in order) dealt into ``degree`` pipelines of ``len(devices) // degree`` (see module docstring)."""
    k = len(devices) // degree
    if grouping == "pipeline-local":
        return [list(devices[r * k:(r + 1) * k]) for r in range(degree)]
    if grouping == "stage-local":
        return [[devices[i * degree + r] for i in range(k)] for r in range(degree)]
    raise PlannerError(f"unknown grouping {grouping!r}; expected one of {', '.join(GROUPINGS)}")


CLASS_GROUPINGS_KEPT = 2
"""How many of the class-count groupings (over every degree) the cheap screen ranks first go on to the placer."""


def screened_first(counted: list[tuple[dict[str, Any], list[list[str]]]]
                    ) -> list[tuple[dict[str, Any], list[list[str]]]]:
    """The ``CLASS_GROUPINGS_KEPT`` groupings the screen found fastest (ties: the lower degree, then enumeration
    order), without the screen's time in their records."""
    ranked = sorted(range(len(counted)), key=lambda i: (counted[i][0]["screened_s"], i))[:CLASS_GROUPINGS_KEPT]
    return [({k: v for k, v in counted[i][0].items() if k != "screened_s"}, counted[i][1]) for i in ranked]


def class_groupings(problem: Problem, weights: Mapping[str, float], classes: Sequence[DeviceClass],
                    degree: int, dealt: list[tuple[dict[str, Any], list[list[str]]]], best_for: BestFor
                    ) -> list[tuple[dict[str, Any], list[list[str]]]]:
    """Metis's search over device-type counts (Um et al., USENIX ATC 2024), for clusters of up to
    ``EVERY_DEGREE_UP_TO`` devices in several classes (``objective.device_classes``: type, host, memory, speed,
    links): every way to give ``degree`` pipelines ``devices // degree`` devices each, by how many of each class
    each pipeline takes (pipelines unordered; a class's devices taken by id, each pipeline's listed in
    ``host_speed_order`` so that stage slots pair like with like). The ones the two dealings already tried are left
    out; the others are screened with the greedy placer alone (no guard, no polish: milliseconds each; under 1F1B
    when the plan's schedule is neither GPipe nor 1F1B, whose simulations cost several times more), and returned
    with their screened step time (``screened_first`` keeps the fastest over every degree for the placer), recorded
    with ``grouping: class-counts`` and their ``counts`` (devices per class, classes in ``host_speed_order``)."""
    if len(classes) < 2:
        return []
    from planner.partition.placers import registry

    order = {device: i for i, device in enumerate(host_speed_order(problem))}
    ranked = sorted(range(len(classes)), key=lambda c: min(order[d] for d in classes[c].devices))
    counts = [classes[c].count for c in ranked]
    of = _class_index(classes)
    done = {_counts_key(of, len(classes), pipelines) for _, pipelines in dealt}
    greedy = registry.get("greedy").fn
    screen = per_class_sequence(lambda sub, sub_weights: greedy(sub, weights=sub_weights), classes)
    proxy = problem if problem.schedule in SCREEN_SCHEDULES else with_schedule(problem, SCREEN_SCHEDULES[1])
    screened = []
    for grouping in _count_groupings(tuple(counts), degree, len(order) // degree):
        taken = [0] * len(ranked)
        pipelines = []
        for composition in grouping:
            members = []
            for slot, (c, n) in enumerate(zip(ranked, composition)):
                members += classes[c].devices[taken[slot]:taken[slot] + n]
                taken[slot] += n
            pipelines.append(sorted(members, key=order.__getitem__))
        if _counts_key(of, len(classes), pipelines) in done:
            continue
        found = best_for(proxy, screen, weights, pipelines)
        if found is not None:
            screened.append(({"degree": degree, "grouping": "class-counts", "counts": [list(c) for c in grouping],
                              "screened_s": found[0]}, pipelines))
    return screened


def per_class_sequence(place: PlaceFn, classes: Sequence[DeviceClass]) -> PlaceFn:
    """``place``, run once per sequence of device classes (with the devices' weights, the micro-batches and the
    sync each device's stage would pay, ``Problem.replica_sync``): a
    sub-problem on devices of the same classes in the same order gets the stages placed for the first one, on its own
    devices position for position (devices of a class are interchangeable, links included:
    ``objective.device_classes``). Without classes (clusters above 16 devices), ``place`` itself."""
    if not classes:
        return place
    of = _class_index(classes)
    placed: dict[tuple[Any, ...], tuple[tuple[str, ...], Partition]] = {}

    def remembered(sub: Problem, sub_weights: Mapping[str, float]) -> Partition:
        ids = sub.cluster.device_ids
        key = (tuple(of[d] for d in ids), tuple(sub_weights.get(d) for d in ids), sub.microbatches,
               tuple(sub.replica_sync.get(d) for d in ids))
        if key not in placed:
            placed[key] = (ids, place(sub, sub_weights))
        first, stages = placed[key]
        rename = dict(zip(first, ids))
        return tuple(replace(st, device=rename[st.device]) for st in stages)

    return remembered


def _count_groupings(counts: tuple[int, ...], degree: int, size: int) -> list[tuple[tuple[int, ...], ...]]:
    """Every multiset of ``degree`` compositions (devices per class, each summing to ``size``) within ``counts``, in
    a fixed order."""
    compositions = [c for c in itertools.product(*(range(min(n, size) + 1) for n in counts)) if sum(c) == size]
    out: list[tuple[tuple[int, ...], ...]] = []

    def extend(left: tuple[int, ...], start: int, chosen: list[tuple[int, ...]]) -> None:
        if len(chosen) == degree:
            out.append(tuple(chosen))
            return
        for i in range(start, len(compositions)):
            if all(x <= y for x, y in zip(compositions[i], left)):
                extend(tuple(y - x for x, y in zip(compositions[i], left)), i, [*chosen, compositions[i]])

    extend(counts, 0, [])
    return out


def _class_index(classes: Sequence[DeviceClass]) -> dict[str, int]:
    """Device id -> the index of its class."""
    return {device: c for c, cls in enumerate(classes) for device in cls.devices}


def _counts_key(of: Mapping[str, int], count: int, pipelines: list[list[str]]) -> tuple[tuple[int, ...], ...]:
    """A grouping up to interchangeable devices: each pipeline's devices per class (``of``: a device's class among
    ``count``), sorted."""
    return tuple(sorted(tuple(sum(1 for d in p if of[d] == c) for c in range(count)) for p in pipelines))
