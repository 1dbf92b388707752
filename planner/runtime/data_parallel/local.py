"""Local steps between aggregations: ``local-sgd`` (the baseline) and ``adaptive`` (the multi-step delayed update method of docs/methods.md), docs/sync.md.

Both train each replica on its own share for several optimizer steps and then average the replicas' models,
weighting replica ``r`` by its share ``m_r / m`` of the step's micro-batches (with even shares: the plain mean).
Each replica's gradient is the mean over its own micro-batches, so with one local step and a linear optimizer
(plain SGD, or SGD with momentum) an aggregation gives exactly ``ssgd``'s step.

What is averaged, and what is not:

- every parameter, whether or not it has a gradient this step (torch's ``PeriodicModelAverager`` skips
  parameters whose ``.grad`` is ``None`` and averages equally, which uneven shares cannot use; that is why
  this module does its own flat, weighted all-reduce);
- every floating-point buffer (BatchNorm's running mean and variance), with the same weights, so evaluation
  sees one model; integer buffers (``num_batches_tracked``) stay as they are, equal on every replica anyway;
- optimizer state stays local, as in torch's ``PostLocalSGDOptimizer``: momentum and Adam's moments are
  per replica and keep following their replica's gradients.

``adaptive`` adds the three parts of the multi-step delayed update method (docs/methods.md):

1. **the interval** ``H`` is re-chosen every round from the measured step compute, the measured cost of an
   aggregation and the training loss (``planner.partition.search.sync_period``); every rank of the world
   agrees on it, choosing from every rank's figures, which travel in the worker's one round-end exchange;
2. **a parameter correction** between aggregations (off by default, ``elastic = 0``: docs/sync.md says why): an elastic pull (EASGD, Zhang, Choromanska and LeCun,
   NeurIPS 2015) of each local model towards where the global model is expected to be, the last global model
   moved on by the global progress per step of the last interval. Progress the replicas share is not pulled
   back; each replica's own drift ``e`` shrinks by ``(1 - elastic)`` every step, so it stays within
   ``(1 - elastic) / elastic`` times the largest per-step deviation of its updates from the global progress;
   with ``momentum`` > 0 the global model also steps with SlowMo's outer momentum (``_outer_step``);
3. **prioritised sub-tensors**: an aggregation cuts the flat model delta into chunks of ``chunk_bytes`` in
   forward order (the first layer's parameters first, as ByteScheduler and P3 order them), starts one
   asynchronous all-reduce per chunk in that order, and trains on while they travel; the averaged chunks are
   applied, in the same order, before the optimizer update of the ``delay``-th step after the launch, and at the
   latest of the step that launches the next aggregation. The replicas' gradients of those steps are therefore
   taken at the pre-aggregation model (a delay of ``delay`` steps; one step is Overlap Local SGD, Wang et al.
   2020). ``delay`` starts at 1 and grows, at a round's end, by the steps an aggregation still made training
   wait for it (``needed_delay``), so an aggregation slower than a step travels under as many steps as it needs
   instead of blocking; every rank of the world agrees on it as on the interval, and the interval is never
   shorter than the delay. Parameters are final only after the optimizer step, so the aggregation cannot start
   during the same step's backward pass; it overlaps the next steps' forward and backward instead. The time
   the aggregation still blocks is measured (``exposed_s``) beside its full cost (``cost_s``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn

from planner.partition.model.allreduce import CHUNK_FLOOR_BYTES
from planner.partition.search.sync_period import AdaptiveRule, next_period

__all__ = ["QuietRounds", "LocalSGD", "Adaptive", "AdaptiveOptions", "chunk_bounds", "flat_of", "assign_flat",
           "needed_delay"]


@dataclass(frozen=True)
class AdaptiveOptions:
    """``plan run --sync adaptive``'s knobs (docs/sync.md)."""

    rule: AdaptiveRule = AdaptiveRule()
    elastic: float = 0.0
    """Share of its drift a local model gives back every local step (0: no correction)."""
    momentum: float = 0.0
    """The outer momentum of the global model's steps (SlowMo; 0: each aggregation moves the global model by the
    averaged delta)."""
    chunk_bytes: int = CHUNK_FLOOR_BYTES
    """Size of the sub-tensors an aggregation is cut into (``plan run``: from the plan's links unless given,
    ``prepare.auto_chunk_bytes``)."""


def aggregation_report(period: int, aggregations: int, total_s: float, exposed_s: float) -> dict[str, Any]:
    """What a run summary says about a mode's aggregations (``sync`` in the summary)."""
    return {"period": period, "aggregations": aggregations, "aggregation_s": total_s, "exposed_s": exposed_s,
            "hidden_fraction": 1.0 - exposed_s / total_s if total_s > 0 else None}


SUMMED = ("aggregations", "aggregation_s", "exposed_s", "copy_s")
"""Report fields that count over a run: a sync that replaces another (a re-plan) adds to them."""


def whole_run_report(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One report for the syncs a run used in turn (each re-plan installs a new one, counting from zero): the counts
    and seconds summed, the intervals in force joined, the rest (``period``, figures) as the last one has them."""
    out: dict[str, Any] = dict(reports[-1]) if reports else {}
    for key in SUMMED:
        if key in out:
            out[key] = sum(r.get(key, 0) for r in reports)
    for key in ("periods", "delays"):
        if key in out:
            out[key] = [p for r in reports for p in r.get(key, [])]
    if "hidden_fraction" in out:
        total, exposed = out["aggregation_s"], out["exposed_s"]
        out["hidden_fraction"] = 1.0 - exposed / total if total > 0 else None
    return out


def chunk_bounds(numel: int, element_size: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` element ranges of a flat tensor of ``numel`` elements cut into chunks of at most
    ``chunk_bytes`` bytes (at least one element each), in order: the send order, first layers first."""
    per = max(1, chunk_bytes // max(element_size, 1))
    return [(start, min(start + per, numel)) for start in range(0, numel, per)]


def flat_of(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors concatenated into one flat float32 copy (in the given order)."""
    if not tensors:
        return torch.zeros(0)
    return torch.cat([t.detach().reshape(-1).to(torch.float32) for t in tensors])


def _pieces(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each tensor with its part of ``flat`` (as laid out by ``flat_of``), shaped like it."""
    out, offset = [], 0
    for t in tensors:
        out.append((t, flat[offset:offset + t.numel()].view_as(t)))
        offset += t.numel()
    return out


def assign_flat(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` (as made by ``flat_of``) back into ``tensors``."""
    with torch.no_grad():
        for t, part in _pieces(tensors, flat):
            t.copy_(part.to(t.dtype))


LATE = 0.1
"""A scheduled landing that waits longer than this share of a step asks for a longer delay (``needed_delay``);
shorter waits are the collectives' own completion and the timer's noise."""


def needed_delay(delay: int, waited_s: float, step_s: float) -> int:
    """The steps an aggregation should travel under so that landing it does not wait: ``delay`` (what it travelled
    under) and the steps the longest wait of a scheduled landing at that delay would have covered, ``waited_s``
    (0: none waited) over a step's compute ``step_s``."""
    if step_s <= 0.0 or waited_s <= LATE * step_s:
        return delay
    return delay + math.ceil(waited_s / step_s - LATE)


class QuietRounds:
    """What a replicas' sync does between rounds when it learns nothing from them (all but ``adaptive``): no figures
    to exchange, nothing to carry over a re-plan, nothing in flight when training ends (its aggregations block), and
    nothing to report unless it says so."""

    def round_figures(self, compute_s: float) -> tuple[float, ...]:
        return ()

    def after_round(self, losses: Sequence[float], figures: Sequence[Sequence[float]]) -> None:
        return None

    def finish(self, params: Mapping[str, nn.Parameter]) -> None:
        return None

    def carry(self, previous: Any) -> None:
        return None

    def report(self) -> dict[str, Any]:
        return {}


class LocalSGD(QuietRounds):
    """``local-sgd``: ``period`` local optimizer steps, then the replicas' parameters and float buffers averaged,
    weighted by their shares (module docstring)."""

    mode = "local-sgd"
    reduces_in_backward = True
    """``after_backward`` turns the summed gradients into this replica's own mean (the worker does not)."""
    moves_weights = True
    """Aggregations (and ``adaptive``'s pull) set the parameters."""

    def __init__(self, group: Any, share: int, microbatches: int, period: int,
                 buffers: Sequence[torch.Tensor] = ()) -> None:
        self.group = group
        self.share = share
        self.weight = share / microbatches
        self.period = period
        self.buffers = [b for b in buffers if b.is_floating_point()]
        self.since = 0
        """Local steps since the last aggregation."""
        self.aggregations = 0
        self.cost_s = 0.0
        """Seconds the aggregations took from start to finish."""
        self.exposed_s = 0.0
        """Of those, the seconds training waited for them."""
        self.periods: list[int] = []
        """The interval in force at each aggregation."""

    def state(self, params: Mapping[str, nn.Parameter]) -> list[torch.Tensor]:
        """What an aggregation averages, in forward order: the parameters, then the float buffers."""
        return [p.data for p in params.values()] + [b.data for b in self.buffers]

    def after_backward(self, params: Mapping[str, nn.Parameter]) -> None:
        for p in params.values():
            if p.grad is not None:
                p.grad.div_(self.share)

    def after_step(self, params: Mapping[str, nn.Parameter]) -> None:
        self.since += 1
        if self.since < self.period:
            return
        began = time.perf_counter()
        tensors = self.state(params)
        flat = flat_of(tensors).mul_(self.weight)
        dist.all_reduce(flat, group=self.group)
        assign_flat(tensors, flat)
        spent = time.perf_counter() - began
        self.cost_s += spent
        self.exposed_s += spent
        self.aggregations += 1
        self.periods.append(self.period)
        self.since = 0

    def report(self) -> dict[str, Any]:
        """What the run summary says about the aggregations."""
        return {**aggregation_report(self.period, self.aggregations, self.cost_s, self.exposed_s),
                "periods": list(self.periods)}


class Adaptive(LocalSGD):
    """``adaptive`` (docs/sync.md): the interval adapts, an elastic correction keeps local models near the expected
    global one, and aggregations travel as prioritised asynchronous chunks (module docstring)."""

    mode = "adaptive"

    def __init__(self, group: Any, share: int, microbatches: int, period: int, buffers: Sequence[torch.Tensor] = (),
                 options: AdaptiveOptions = AdaptiveOptions()) -> None:
        super().__init__(group, share, microbatches, period, buffers)
        self.options = options
        self.anchor: torch.Tensor | None = None
        """The last global model (flat)."""
        self.velocity: torch.Tensor | None = None
        """The global model's progress per local step over the last interval."""
        self.outer: torch.Tensor | None = None
        """SlowMo's outer momentum buffer over the parameters (``options.momentum > 0``)."""
        self.pending: list[Any] = []
        """The in-flight chunks' work handles, in send order (``order``)."""
        self.sent: torch.Tensor | None = None
        self.snapshot: torch.Tensor | None = None
        self.launched_at = 0.0
        self.order: list[tuple[int, int]] = []
        """The chunk ranges of the last aggregation, in the order they were sent."""
        self.loss_start: float | None = None
        self.last_exposed_s: float | None = None
        """What the last aggregation took from training: the wait for it and its copies (the rule's cost)."""
        self.copy_s = 0.0
        self.copy_total_s = 0.0
        """Seconds spent copying and combining the flat models (not waiting)."""
        self.step_mark: float | None = None
        """When the last local step's ``after_step`` ended (None at a round's start: its bookkeeping is no step)."""
        self.landed_s = 0.0
        """What landing took in the step under way (wait and copies), 0 when nothing landed in it."""
        self.busy: list[float] = []
        """This round's compute of the first steps after a launch, which the collectives' own work slows (their wall
        time less any landing)."""
        self.clean: list[float] = []
        """This round's compute of the other steps (with a delay above one step an aggregation may still travel
        under them, counted as the first step's cost only)."""
        self.clean_s: float | None = None
        self.delay = 1
        """Local steps an aggregation travels under before it lands (module docstring)."""
        self.delays: list[int] = []
        """The delay each aggregation landed after."""
        self.late_s = 0.0
        """This round's longest wait of a landing at its scheduled step (not one that ``finish`` forced early)."""
        self.interference_s = 0.0
        """What a travelling aggregation adds to the compute of the first step under it (the cores that run the
        collective are the cores that compute, on CPU ranks): the busy steps' median less the clean ones'."""

    def after_backward(self, params: Mapping[str, nn.Parameter]) -> None:
        super().after_backward(params)
        if self.pending and self.since + 1 >= min(self.delay, self.period):  # its delay, or the next launch, is due
            self._land(self.state(params), scheduled=True)

    def after_step(self, params: Mapping[str, nn.Parameter]) -> None:
        now = time.perf_counter()
        if self.step_mark is not None:
            # no local step since the last launch: this step is the first the collectives' own work slowed
            (self.busy if self.since == 0 else self.clean).append(now - self.step_mark - self.landed_s)
        self.landed_s = 0.0
        tensors = self.state(params)
        if self.anchor is None:
            self.anchor = flat_of(tensors)
        self.since += 1
        if self.since < self.period:
            self._pull(tensors)
        else:
            self._launch(tensors)
        self.step_mark = time.perf_counter()

    def finish(self, params: Mapping[str, nn.Parameter]) -> None:
        """Land an aggregation still in flight (before evaluating, re-planning or saving)."""
        if self.pending:
            self._land(self.state(params))

    def carry(self, previous: Any) -> None:
        """After a re-plan the interval rule goes on where the replaced sync left it: its interval, the loss it
        started from (AdaComm's ``F_0``: taking the loss at the re-plan instead would lengthen the interval again),
        the delay, and the last aggregation's measured cost and interference. The step compute is measured afresh
        (the new stages compute differently), and the global model's anchor is taken again from the weights as they
        are."""
        if not isinstance(previous, Adaptive):
            return
        self.period = previous.period
        self.delay = previous.delay
        self.loss_start = previous.loss_start
        self.last_exposed_s = previous.last_exposed_s
        self.interference_s = previous.interference_s

    def _pull(self, tensors: list[torch.Tensor]) -> None:
        """The elastic correction: towards the anchor moved on by the global velocity."""
        alpha = self.options.elastic
        if alpha <= 0.0 or self.anchor is None:
            return
        expected = self.anchor if self.velocity is None else self.anchor + self.velocity * self.since
        with torch.no_grad():  # in place, tensor by tensor: no copy of the whole model on every local step
            for t, target in _pieces(tensors, expected):
                t.sub_((t - target.to(t.dtype)).mul_(alpha))

    def _launch(self, tensors: list[torch.Tensor]) -> None:
        assert self.anchor is not None
        self.launched_at = time.perf_counter()
        self.snapshot = flat_of(tensors)
        self.sent = self.snapshot.sub(self.anchor).mul_(self.weight)
        self.order = chunk_bounds(self.sent.numel(), self.sent.element_size(), self.options.chunk_bytes)
        self.pending = [dist.all_reduce(self.sent[a:b], group=self.group, async_op=True) for a, b in self.order]
        self.periods.append(self.period)
        self.since = 0
        self.copy_s = time.perf_counter() - self.launched_at

    def _land(self, tensors: list[torch.Tensor], *, scheduled: bool = False) -> None:
        """Wait for the chunks in send order and move the local model by (global delta - own delta); ``scheduled``:
        at the step its delay (or the next launch) chose, so its wait tells whether the delay is long enough."""
        assert self.anchor is not None and self.snapshot is not None and self.sent is not None
        waited = time.perf_counter()
        for work in self.pending:
            work.wait()
        done = time.perf_counter()
        self.pending = []
        # self.sent now holds the weighted sum, the global delta: the new global model is anchor + sent, and
        # the local model keeps the progress it made since the snapshot on top of it.
        self._outer_step(self.sent)
        self.anchor.add_(self.sent)
        assign_flat(tensors, flat_of(tensors).sub_(self.snapshot).add_(self.anchor))
        self.velocity = self.sent.div_(max(self.periods[-1], 1))
        self.snapshot = None
        self.delays.append(self.since + 1 if scheduled else self.since)
        if scheduled:
            self.late_s = max(self.late_s, done - waited)
        copied = self.copy_s + time.perf_counter() - done
        self.exposed_s += done - waited
        self.copy_total_s += copied
        if scheduled or self.last_exposed_s is None:  # an early landing (evaluation, re-plan) says nothing of the rule
            self.last_exposed_s = done - waited + copied
        self.landed_s = time.perf_counter() - waited
        self.cost_s += done - self.launched_at
        self.aggregations += 1

    def _outer_step(self, delta: torch.Tensor) -> None:
        """SlowMo's outer step (Wang, Tantia, Ballas and Rabbat, ICLR 2020, with outer learning rate 1): the
        parameters' part of the averaged ``delta`` becomes ``u <- momentum u + delta`` in place, the step the
        global model takes. Every replica holds the same ``u`` (it sums the same all-reduced deltas). The float
        buffers' part (running statistics) stays the plain average."""
        beta = self.options.momentum
        if beta <= 0.0:
            return
        part = delta[:delta.numel() - sum(b.numel() for b in self.buffers)]
        if self.outer is None:
            self.outer = torch.zeros_like(part)
        self.outer.mul_(beta).add_(part)
        part.copy_(self.outer)

    def report(self) -> dict[str, Any]:
        return {**super().report(), "copy_s": self.copy_total_s, "interference_s": self.interference_s,
                "chunk_bytes": self.options.chunk_bytes, "delay": self.delay, "delays": list(self.delays)}

    def round_figures(self, compute_s: float) -> tuple[float, ...]:
        """This rank's figures for the interval rule: the step compute without an aggregation in flight (``compute_s``,
        the round's mean, until a clean step was measured), an aggregation's cost to training (the wait once the
        overlap has hidden what it can, the copies that combine the models, and what the travelling chunks added to
        the compute of the first step under them; -1 before the first aggregation), and the delay this round's
        landings asked for (``needed_delay``)."""
        if self.clean:
            self.clean_s = statistics.median(self.clean)
        if self.busy and self.clean_s is not None:
            self.interference_s = max(statistics.median(self.busy) - self.clean_s, 0.0)
        self.busy, self.clean, self.step_mark = [], [], None
        step_s = compute_s if self.clean_s is None else self.clean_s
        cost = -1.0 if self.last_exposed_s is None else self.last_exposed_s + self.interference_s
        delay = needed_delay(self.delay, self.late_s, step_s)
        self.late_s = 0.0
        return (step_s, cost, float(delay))

    def after_round(self, losses: Sequence[float], figures: Sequence[Sequence[float]]) -> None:
        """Re-choose the delay and the interval from the world's largest figures (``round_figures`` of every rank,
        exchanged by the worker), so every rank chooses the same; the interval is at least the delay."""
        loss = sum(losses) / len(losses) if losses else None
        if self.loss_start is None:
            self.loss_start = loss
        step_s, cost_s, delay = (max(column) for column in zip(*figures))
        if cost_s < 0.0:
            return  # nothing aggregated yet: keep the plan's first interval
        rule = self.options.rule
        self.delay = min(int(delay), rule.max_period)  # each rank asked for at least the delay they share
        self.period = max(next_period(step_s, cost_s, self.loss_start, loss, rule), self.delay)
