"""Boundary polish: deterministic local search of a partition against the simulator.

The exact placers minimise ``sum_k L_k + (m - 1) * max_k L_k`` (``planner.partition.model.objective``). The
1F1B simulator also sees what that formula leaves out: the slowest stage's warm-up forwards hide the
stages after it, and transfers run alongside compute (docs/exact-methods.md, "Limits"). Polish takes any
placer's plan and moves its cuts while the *simulated* step time (``cost.evaluate``) drops, so every
placer's plan can be tuned to what the simulator rewards without changing the exact methods' objective.

The moves, generated in a fixed order for the current partition:

1. *shift*: one cut moves ``k`` blocks left or right (``k = 1 .. max_shift``, so short plateaus are crossed);
2. *transfer*: ``k = 1`` block of work moves from stage ``a`` to a non-adjacent stage ``b``: every cut
   between them moves one block towards ``a``, so the stages in between keep their size but slide. On
   repeated layers this moves one layer's load across the pipeline in one step, which no single shift can;
3. *split* a stage at its time-balanced cut (and the cuts beside it) onto an unused device, the new
   device taking the second half, the first half, or the end of the pipeline (the stages after the split
   sliding one device along, which keeps host boundaries in place), and *merge* two adjacent stages
   (the merged stage on either device, or the pipeline sliding back and freeing its last device);
4. *devices*: swap the devices of two stages of different kinds (type, host and speed; devices of one
   kind are interchangeable unless the cluster file declares pair links, which this skips), or move a
   stage to an unused device of another kind (one representative each).

Moves 3 and 4 need one stage per device; when a device holds several stages (``interleaved-1f1b``) only 1
and 2 are tried. The search is first-improvement local search with a cyclic scan: the moves are tried in
their order, and after a move is taken the scan goes on at the same position of the new plan's list
instead of starting over (so the early moves are not re-tried first every time). A schedule-aware lower
bound on the step time (``_lower_bound_s``) skips moves that cannot win without simulating them. A move
is taken only when the simulated step time drops by more than ``epsilon`` (relative) and every device's peak memory
fits (``cost.check_fits``); the search stops when a full scan finds no such move or after
``max_evaluations`` simulations. Optionally it starts again from the time-balanced split
(``baselines.time_balance``) and keeps the better result (the placer's on ties). Everything is
deterministic: the same problem and start give the same plan. Polish never returns a plan with a larger
simulated step time than its start.

``polish_cuts`` runs the same descent on a *whole* plan, after the placer: only the cut moves (1 and 2, with shifts
of up to ``WIDE_SHIFTS`` blocks), every stage keeping its devices and replicas and the plan its shares, simulated whole
(every replica pipeline, then each stage's all-reduce). It sees what the placers cannot, which place one pipeline
under one recomputation setting: the replicas' all-reduce (a cut that moves parameters off the first stage, whose
sync no backward hides), and, given ``decide``, the stages that stop recomputing (each candidate's recomputation is
decided again before it is simulated, so a stage freed of its second forward takes more blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterable, Iterator

from planner.errors import PlannerError
from planner.formats.plan import GENERATED_ORDER_SCHEDULES, ZERO_BUBBLE_SCHEDULES
from planner.partition.model.cost import stage_backward_halves, stage_fwd_bwd_s, stage_update_s, step_time_s
from planner.partition.model.feasibility import check_fits
from planner.partition.model.problem import Partition, Placed, Problem, StageSpec, by_host_speed, facts_of
from planner.partition.sim.schedules import BWD, BWD_INPUT, device_orders, inflight_counts

__all__ = ["PolishConfig", "PolishResult", "polish", "polish_cuts", "WIDE_SHIFTS", "CUTS_OBJECTIVE"]


@dataclass(frozen=True)
class PolishConfig:
    """Knobs of the boundary polish."""

    max_shift: int = 3
    """Largest number of blocks one *shift* moves a cut."""
    max_evaluations: int = 3000
    """Simulations allowed per start (the search stops there; the count, not the clock, keeps it deterministic)."""
    epsilon: float = 1e-7
    """A move must cut the simulated step time by more than this fraction."""
    restart: bool = True
    """Also polish the time-balanced split and keep the better plan."""

    def __post_init__(self) -> None:
        if self.max_shift < 1 or self.max_evaluations < 1 or not 0 <= self.epsilon < 1:
            raise PlannerError(f"polish needs max_shift >= 1, max_evaluations >= 1 and 0 <= epsilon < 1, found "
                               f"max_shift={self.max_shift!r}, max_evaluations={self.max_evaluations!r}, "
                               f"epsilon={self.epsilon!r}")


@dataclass(frozen=True)
class PolishResult:
    partition: Partition
    record: dict[str, Any]
    """``{"start_step_time_s", "step_time_s", "moves": [{kind, ..., step_time_s}], "evaluations", "stop", "start"}``.

    ``start`` is ``placer`` (the moves apply to the plan given) or ``time-balance`` (the restart won: the
    moves apply to the time-balanced split, and ``placer`` holds what the given plan reached);
    ``restart`` summarises the other descent when the placer's plan won."""


Move = tuple[dict[str, Any], list[int], list[str]]
"""What the move does (for the record), the new cuts (``len(stages) + 1`` bounds) and devices."""
Make = Callable[[list[int], list[str]], Partition]
"""The partition a move's cuts and devices make."""
MovesOf = Callable[[Partition], list[Move]]
"""Every move of a partition, in order."""

WIDE_SHIFTS = (*range(1, 17), 24, 32, 48, 64)
"""The blocks one shift of ``polish_cuts`` moves a cut: a cut that frees the first stage of parameters (whose
all-reduce no backward hides) or gives a stage that stopped recomputing its share moves many blocks at once, and the
placer's own polish has crossed the short plateaus already."""
CUTS_OBJECTIVE = "simulated step time: every replica pipeline with its share, then each stage's all-reduce"
"""What ``polish_cuts`` minimises (recorded in its ``objective``)."""


def polish(problem: Problem, partition: Partition, config: PolishConfig = PolishConfig()) -> PolishResult:
    """Local search over ``partition``'s cuts (and devices) that keeps only simulated improvements."""
    first = _descend(problem, partition, config)
    best, record = first, {**first[2], "start": "placer"}
    if config.restart:
        other = _restart_start(problem)
        if other is not None and other != partition:
            second = _descend(problem, other, config)
            record["restart"] = {"start": "time-balance", "start_step_time_s": second[2]["start_step_time_s"],
                                 "step_time_s": second[2]["step_time_s"], "evaluations": second[2]["evaluations"]}
            if second[1] < first[1] * (1 - config.epsilon):
                best = second
                record = {**second[2], "start": "time-balance",
                          "placer": {k: first[2][k] for k in ("start_step_time_s", "step_time_s", "evaluations")}}
                record["start_step_time_s"] = first[2]["start_step_time_s"]
    return PolishResult(best[0], record)


def polish_cuts(problem: Problem, partition: Partition, config: PolishConfig = PolishConfig(),
                decide: Callable[[Partition], Partition] | None = None) -> PolishResult:
    """Shift and transfer moves of a whole plan's cuts (module docstring): the stages keep their devices and replicas,
    the plan its shares and facts; ``decide`` turns each candidate (its stages' ``recompute`` unset, so the problem's)
    into the plan to simulate. The record also names the ``objective``."""
    facts, shares = facts_of(partition), getattr(partition, "shares", None)
    template = tuple(partition)

    def make(bounds: list[int], devices: list[str]) -> Partition:
        stages = tuple(StageSpec(a, b, st.device, st.replicas, None if decide is not None else st.recompute)
                       for a, b, st in zip(bounds, bounds[1:], template))
        candidate = Placed(stages, facts, shares=shares)
        return decide(candidate) if decide is not None else candidate

    def moves(current: Partition) -> list[Move]:
        bounds = [st.start for st in current] + [current[-1].stop]
        devices = [st.device for st in current]
        return list(_shifts(bounds, devices, WIDE_SHIFTS)) + list(_transfers(bounds, devices))

    best, _, record = _descend(problem, partition, config, make, moves)
    return PolishResult(best, {**record, "objective": CUTS_OBJECTIVE})


def _restart_start(problem: Problem) -> Partition | None:
    """The time-balanced split (torchgpipe's objective, solved exactly) with its stages on the devices in
    ``host_speed_order`` (the baseline reads the file's order, so the same devices listed in another order would
    start, and end, elsewhere), when it fits in memory."""
    from planner.partition.placers.baselines import time_balance

    start = time_balance(by_host_speed(problem))
    return start if _fits(problem, start) else None


def _descend(problem: Problem, start: Partition, config: PolishConfig, make: Make | None = None,
             moves_of: MovesOf | None = None) -> tuple[Partition, float, dict[str, Any]]:
    """First-improvement descent with a cyclic scan; returns the plan, its step time and the record. ``make`` and
    ``moves_of`` (``polish_cuts``): the partition a move makes and the moves of a partition; without them, the stages
    on their devices and every move of the module docstring, screened by the lower bound (which assumes a pure
    pipeline of the problem's micro-batches)."""
    bounded = make is None
    make = make or _stages
    moves_of = moves_of or (lambda partition: _moves(problem, partition, range(1, config.max_shift + 1)))
    current = start if not bounded else tuple(start)
    value = _step_s(problem, current)
    record: dict[str, Any] = {"start_step_time_s": value, "moves": []}
    if value is None or not _fits(problem, current):
        record.update(step_time_s=value, evaluations=1, stop="start does not fit or cannot be simulated")
        return current, float("inf"), record  # any fitting plan of the restart beats it
    evaluations, position, stale, stop = 1, 0, 0, "local optimum"
    moves = moves_of(current)
    while stale < len(moves):
        if evaluations >= config.max_evaluations:
            stop = "max_evaluations"
            break
        what, bounds, devices = moves[position % len(moves)]
        position, stale = position + 1, stale + 1
        if bounded and _lower_bound_s(problem, bounds, devices) >= value * (1 - config.epsilon):
            continue  # cannot improve: no simulation needed
        candidate = make(bounds, devices)
        evaluations += 1
        time_s = _step_s(problem, candidate)
        if time_s is None or time_s >= value * (1 - config.epsilon) or not _fits(problem, candidate):
            continue
        current, value, stale = candidate, time_s, 0
        record["moves"].append({**what, "step_time_s": time_s})
        moves = moves_of(current)
    record.update(step_time_s=value, evaluations=evaluations, stop=stop)
    return current, value, record


def _step_s(problem: Problem, partition: Partition) -> float | None:
    try:
        return step_time_s(problem, partition)
    except PlannerError:
        return None


def _lower_bound_s(problem: Problem, bounds: list[int], devices: list[str]) -> float:
    """A step time that the partition with these cuts and devices cannot beat in the simulator (0 when a device holds several stages).

    With one stage per device, stage ``s`` runs ``n_s`` forwards before its first backward (``min(m, p - s)``
    under 1F1B, ``m`` under GPipe; read from the schedule's order). It cannot start before micro-batch 0
    has gone forward through the stages before it; its first backward waits for micro-batch 0 to go
    through the stages after it and back; then it still has ``m (F_s + B_s) - n_s F_s`` of work; after its
    last backward the stages before it run theirs while it steps its optimizer:
    ``sum_{k<s} F_k + max(n_s F_s, F_s + sum_{k>s} (F_k + B_k)) + m (F_s + B_s) - n_s F_s
    + max(U_s, sum_{k<s} B_k)``. Transfers and per-pass overheads only add to it, so a move whose bound
    is not below the current step time needs no simulation. Zero-bubble schedules: the first input gradient waits
    for ``sum_{k>s} (F_k + I_k)`` only, and the stages before may overlap their input gradients with this stage's
    held-back weight gradients, so the tail is ``U_s`` alone. ``zb-planned``'s order may run a backward whole, which
    costs the fused backward, less than its halves apart (``simulate._fused``): its bound prices every backward so.
    """
    p, m = len(devices), problem.microbatches
    if len(set(devices)) < p:
        return 0.0
    tables = problem.tables
    times = [stage_fwd_bwd_s(tables, d, a, b) for d, a, b in zip(devices, bounds, bounds[1:])]
    split = problem.schedule in ZERO_BUBBLE_SCHEDULES
    inputs = [bwd for _, bwd in times]
    if split:  # the halves as the simulator charges them
        halves = [stage_backward_halves(tables, d, a, b, bwd, first=s == 0)
                  for s, ((_, bwd), d, a, b) in enumerate(zip(times, devices, bounds, bounds[1:]))]
        if problem.schedule in GENERATED_ORDER_SCHEDULES:  # its order may run a backward whole, at the fused price
            halves = [(fused, weight * fused / whole if whole > 0 else 0.0)
                      for (_, fused), (whole, weight) in zip(times, halves)]
        times = [(fwd, bwd) for (fwd, _), (bwd, _) in zip(times, halves)]
        inputs = [bwd - weight for bwd, weight in halves]
    after = [0.0] * (p + 1)
    for s in range(p - 1, -1, -1):
        after[s] = after[s + 1] + times[s][0] + inputs[s]
    best, before_f, before_b = 0.0, 0.0, 0.0
    for s, (fwd, bwd) in enumerate(times):
        n = _forwards_first(problem.schedule, p, m, s)
        update = stage_update_s(problem, devices[s], bounds[s], bounds[s + 1])
        tail = update if split else max(update, before_b)
        best = max(best, before_f + max(n * fwd, fwd + after[s + 1]) + m * (fwd + bwd) - n * fwd + tail)
        before_f, before_b = before_f + fwd, before_b + bwd
    return best


@lru_cache(maxsize=256)
def _forwards_first(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Forwards that ``stage`` runs before its first backward (one stage per device); for ``zb-planned``, whose order
    depends on the times, the most it may run: the largest in-flight cap it may use, ``zb-h2``'s where that fits
    (``simulate.planned_orders``)."""
    if schedule in GENERATED_ORDER_SCHEDULES:
        return min(microbatches, inflight_counts(device_orders("zb-h2", stages, 1, microbatches)[stage])[stage])
    order = device_orders(schedule, stages, 1, microbatches)[stage]
    return next(i for i, (kind, _, _) in enumerate(order) if kind in (BWD, BWD_INPUT))


def _fits(problem: Problem, partition: Partition) -> bool:
    try:
        check_fits(problem, partition)
    except PlannerError:
        return False
    return True


# --- moves -----------------------------------------------------------------------------------------

def _moves(problem: Problem, partition: Partition, sizes: Iterable[int]) -> list[Move]:
    """Every move of the current partition, in the fixed order of the module docstring."""
    bounds = [st.start for st in partition] + [partition[-1].stop]
    devices = [st.device for st in partition]
    out = list(_shifts(bounds, devices, sizes)) + list(_transfers(bounds, devices))
    if len(set(devices)) == len(devices):
        kind = _kinds(problem)
        unused = _unused(problem, devices, kind)
        out += list(_resizes(problem, bounds, devices, unused)) + list(_device_moves(bounds, devices, kind, unused))
    return out


def _stages(bounds: list[int], devices: list[str]) -> Partition:
    return tuple(StageSpec(a, b, d) for a, b, d in zip(bounds, bounds[1:], devices))


def _shifts(bounds: list[int], devices: list[str], sizes: Iterable[int]) -> Iterator[Move]:
    """Each cut moved by each of ``sizes`` blocks, left then right, where it stays between its neighbours."""
    for cut in range(1, len(bounds) - 1):
        for k in sizes:
            for step in (-k, k):
                moved = bounds[cut] + step
                if bounds[cut - 1] < moved < bounds[cut + 1]:
                    new = [*bounds[:cut], moved, *bounds[cut + 1:]]
                    yield {"kind": "shift", "cut": cut, "blocks": step}, new, devices


def _transfers(bounds: list[int], devices: list[str]) -> Iterator[Move]:
    """One block of work from stage ``a`` to stage ``b`` (``|a - b| >= 2``): the cuts between slide towards ``a``."""
    p = len(devices)
    for a in range(p):
        for b in range(p):
            if abs(a - b) < 2 or bounds[a + 1] - bounds[a] < 2:
                continue
            new = list(bounds)
            for cut in (range(a + 1, b + 1) if a < b else range(b + 1, a + 1)):
                new[cut] += -1 if a < b else 1
            yield {"kind": "transfer", "from": a, "to": b}, new, devices


def _kinds(problem: Problem) -> dict[str, tuple[str, str, float]]:
    """Device id -> its kind: (type, host, speed factor)."""
    return {d.id: (d.type, d.host, problem.speed_factors.get(d.id, 1.0)) for d in problem.cluster.devices}


def _unused(problem: Problem, devices: list[str], kind: dict[str, tuple[str, str, float]]) -> list[str]:
    """One unused device per kind, the first by id (not the file's order, so that permuting the file changes nothing;
    devices of one kind differ only where the file declares pair links)."""
    used, seen, out = set(devices), set(), []
    for d in sorted(problem.cluster.devices, key=lambda d: d.id):
        if d.id not in used and kind[d.id] not in seen:
            seen.add(kind[d.id])
            out.append(d.id)
    return out


def _resizes(problem: Problem, bounds: list[int], devices: list[str], unused: list[str]) -> Iterator[Move]:
    """Splits onto an unused device, then merges of adjacent stages."""
    p = len(devices)
    for i in range(p):
        for cut in _split_cuts(problem, bounds[i], bounds[i + 1], devices[i]):
            new = [*bounds[:i + 1], cut, *bounds[i + 1:]]
            for u in unused:
                for where, devs in (("after", [*devices[:i + 1], u, *devices[i + 1:]]),
                                    ("before", [*devices[:i], u, *devices[i:]]),
                                    ("end", [*devices, u])):
                    if where == "end" and i == p - 1:
                        continue  # the same as "after"
                    yield {"kind": "split", "stage": i, "cut": cut, "device": u, "new": where}, new, devs
    for i in range(p - 1):
        new = [*bounds[:i + 1], *bounds[i + 2:]]
        for keep, devs in (("first", [*devices[:i + 1], *devices[i + 2:]]), ("second", [*devices[:i], *devices[i + 1:]]),
                           ("slide", devices[:-1])):
            if keep == "slide" and i == p - 2:
                continue  # the same as "first"
            yield {"kind": "merge", "stage": i, "device": keep}, new, devs


def _split_cuts(problem: Problem, start: int, stop: int, device: str) -> list[int]:
    """The cut of ``[start, stop)`` that best balances its halves' compute on ``device``, and the cuts beside it."""
    if stop - start < 2:
        return []
    tables = problem.tables

    def imbalance(c: int) -> float:
        left, right = sum(stage_fwd_bwd_s(tables, device, start, c)), sum(stage_fwd_bwd_s(tables, device, c, stop))
        return abs(left - right)

    best = min(range(start + 1, stop), key=lambda c: (imbalance(c), c))
    return [c for c in (best, best - 1, best + 1) if start < c < stop]


def _device_moves(bounds: list[int], devices: list[str], kind: dict[str, tuple[str, str, float]],
                  unused: list[str]) -> Iterator[Move]:
    """Swaps of two stages' devices, then moves of one stage to an unused device of another kind."""
    p = len(devices)
    for i in range(p):
        for j in range(i + 1, p):
            if kind[devices[i]] != kind[devices[j]]:
                devs = list(devices)
                devs[i], devs[j] = devs[j], devs[i]
                yield {"kind": "swap", "stages": [i, j]}, bounds, devs
    for i in range(p):
        for u in unused:
            if kind[u] != kind[devices[i]]:
                yield {"kind": "device", "stage": i, "device": u}, bounds, [*devices[:i], u, *devices[i + 1:]]
