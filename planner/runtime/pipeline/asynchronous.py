"""Seed 000's asynchronous pipeline (``async-1f1b``, ``2bw``): 1F1B with no flush between steps (docs/async.md).

torch's schedules drain the pipeline at the end of every step, so ``(p - 1) / (m + p - 1)`` of it is idle.
Here each rank runs its stage's passes in ``planner.partition.sim.schedules.async_orders``'s order over a
whole round of steps: the next step's forwards fill the slots the drain would have left empty, and the
stage's optimizer steps after every ``m``-th backward of its own, without waiting for the other stages.
The pipeline drains only at round ends, where evaluation, rebalancing and checkpoints act.

Delayed gradients are handled, never ignored:

* **weight stashing** (PipeDream): a forward runs on a *version* of the stage's weights (``Version``: detached
  tensors, kept while a micro-batch in flight uses them) and the micro-batch's backward differentiates the
  same tensors, so every gradient is the true gradient of some version. Which version is
  ``forward_version``'s rule (async-1f1b: the newest; 2bw: one update old for a whole step);
* **weight prediction** (PipeOptim, Guan et al. 2023; XPipe, Guan et al. 2019), the correction for the
  staleness that remains: a forward whose gradient will join an update ``tau`` updates after its version
  runs on ``W_v + tau * (W_v - W_{v-1})``, the version extrapolated by its known delay along the optimizer's
  last step (for SGD exactly ``-lr * tau * g_last``; for Adam ``tau`` times its last step). The backward
  differentiates the predicted weights, and the gradient updates the live ones.
* **a synchronous warm-up** (``async.warmup``): the first steps drain one by one (``async_spans``), each on its own
  step's weights, before the steps overlap; a gradient late in the first steps, when the optimizer moves the weights
  most, costs far more than one late later (docs/async.md, "The synchronous warm-up").

Messages are point-to-point (``isend``/``irecv`` on the default group) between consecutive stages' ranks: a forward
sends its outputs, a backward its inputs' gradients; shapes travel once, in a header, on the first message. A
receive is posted when the rank is about to wait for it on gloo, as torch's schedules post theirs, and one message
ahead on other backends (``receives_ahead``). With replicas (``data_parallel.sync`` ``ssgd``) every replica pipeline
runs its own share this way, and each stage's update first sums its gradient with the same stage's replicas (a
blocking all-reduce on the ``dp`` group of the plan's ``DeviceMesh``; every replica reaches the same update), so the
replicas keep one set of weights. Every wait is bounded by the process group's timeout (``plan run --timeout-s``). The
optimizer and the live parameters are ``RankRun``'s, so evaluation, checkpoints and the summary see the weights as
they are after the round's last update.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.func import functional_call

from planner.errors import UsageError
from planner.formats.plan import ASYNC_CORRECTIONS, Plan
from planner.partition.sim.schedules import (FWD, UPD, async_orders, async_spans, async_violation, forward_version,
                                             inflight_depth, tied_grace)
from planner.runtime.data_parallel import UpdateSync, sync_of
from planner.runtime.pipeline.graph_split import StageGraph, canonical_param_names
from planner.runtime.pipeline.stages import RankStages
from planner.runtime.pipeline.versions import Version, predict_weights

__all__ = ["AsyncEngine", "check_async", "correction_of", "predict_weights", "receives_ahead",
           "train_async_reference", "Version"]


_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool)
_HEADER = 16
"""int64 slots of a tensor's header: dtype code, rank, then the shape."""

Batch = Callable[[int], tuple[tuple[torch.Tensor, ...], torch.Tensor]]


def correction_of(plan: Plan) -> str:
    """The plan's correction for delayed gradients (``async.correction``; ``predict`` when absent)."""
    return str((plan.extra.get("async") or {}).get("correction", "predict"))


def check_async(plan: Plan) -> None:
    """Raise ``UsageError`` unless the runtime can run ``plan``'s asynchronous schedule as it is."""
    shape = plan.shape()
    found = async_violation(plan.schedule, len(plan.stages), len({s.device for s in plan.stages}), min(shape.shares),
                            shape.degree, shape.sync)
    if found:
        raise UsageError(f"the plan cannot run: {found}")
    if any(plan.recomputed()):
        raise UsageError(f"the plan cannot run: it recomputes activations under {plan.schedule}, which runs its stages "
                         f"on stashed weight versions without recomputation; re-partition with --recompute off or a "
                         f"flushing schedule (1f1b, gpipe)")


@dataclass
class _InFlight:
    """A micro-batch between its forward and its backward on this stage."""

    version: Version
    weights: dict[str, torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    outputs: tuple[torch.Tensor, ...]
    loss: torch.Tensor | None


class AsyncEngine:
    """One rank's stage under an asynchronous schedule (module docstring); ``run_round`` trains some steps."""

    def __init__(self, stages: RankStages, optimizer: torch.optim.Optimizer, criterion: Callable[..., torch.Tensor],
                 correction: str = "predict", inflight: int | None = None, record_versions: bool = False,
                 before: "AsyncEngine | None" = None, sync: UpdateSync | None = None,
                 clock: Callable[[], float] = time.perf_counter, receives: str = "auto") -> None:
        plan = stages.plan
        check_async(plan)
        if correction not in ASYNC_CORRECTIONS:
            raise UsageError(f"the plan's async.correction must be one of {', '.join(ASYNC_CORRECTIONS)}, found "
                             f"{correction!r}; re-partition with --async-correction")
        self.stages = stages
        self.clock = clock
        """Times its passes and updates (``runtime.timing.device_clock``: after the device's queued work on a GPU)."""
        self.schedule = plan.schedule
        self.optimizer = optimizer
        self.criterion = criterion
        self.correction = correction
        self.inflight = inflight
        self.warmup = plan.async_warmup
        """Steps before this one run synchronously, each drained (``async_spans``)."""
        self.m = stages.microbatches  # this replica's share: its order and its versions follow it
        self.total = plan.microbatches  # the step's micro-batches over every replica: the gradient's divisor
        self.sync = sync if sync is not None else sync_of(stages)
        """How every update combines with the stage's replicas' (``plan run`` passes its own, which also ends its
        rounds)."""
        self.p = len(plan.stages)
        self.stage = next(g.index for g in stages.graphs if stages.rank_of_stage[g.index] == stages.rank)
        graph: StageGraph = stages.graphs[self.stage]
        self.module = graph.module
        self.names = _stage_names(graph, {id(p): c for c, p in stages.params.items()})
        self.slots = [(graph.module.get_submodule(path)._parameters, attr, c)
                      for name, c in self.names for path, _, attr in [name.rpartition(".")]]
        """Where the stage module holds each parameter (every name, a tied one's too), for ``_running_on``."""
        self.params = {c: stages.params[c] for _, c in self.names}
        self.prev = stages.rank_of_stage[self.stage - 1] if self.stage > 0 else None
        self.next = stages.rank_of_stage[self.stage + 1] if self.stage + 1 < self.p else None
        self.versions: dict[int, Version] = {}
        self.newest = self._snapshot(0, None)
        self.updates = 0
        self.acc: dict[str, torch.Tensor] = {c: torch.zeros_like(p) for c, p in self.params.items()}
        self.pending: dict[int, _InFlight] = {}
        self.sends: list[Any] = []
        self.tied_pending: dict[str, tuple[Any, torch.Tensor]] = {}
        """Tied weights' all-reduces in flight, by name (``_exchange_tied``)."""
        self.sums_at_once = plan.shape().degree == 1
        """One pipeline: a tied weight steps with its update's own sum (``_exchange_tied``); replicas: with the
        previous update's."""
        self.tie_leader = {tie.name: _tie_leader(tie, stages.rank_of_stage) for tie in stages.tied
                           if tie.group is not None}
        """Each tied weight this rank holds with another rank: the first stage holding it."""
        followed = [leader for leader in self.tie_leader.values() if leader != self.stage]
        self.tied_late = self.sums_at_once and bool(followed)
        """This rank holds a tied weight after its first holder's stage, and applies the sums late."""
        self.grace = min((tied_grace(leader, self.p, inflight) for leader in followed), default=0)
        """This rank applies its tied weights' sums before its forward of a step's micro-batch ``grace``."""
        ahead = receives_ahead(receives, dist.get_backend())
        self.activations = _Inbox(self.prev, ahead) if self.prev is not None else None
        self.grads = _Inbox(self.next, ahead) if self.next is not None else None
        self.headed: set[int] = set()
        """Ranks this rank has sent its shapes to (once, before the first message)."""
        self.log: list[tuple[int, int, int, int]] | None = [] if record_versions else None
        """(micro-batch, forward's version, backward's version, staleness) when ``record_versions``."""
        self.started = False
        """Whether ``run_round`` has run: the first call starts the versions at its step (``_rebase``)."""
        self.compute_s = before.compute_s if before is not None else 0.0
        self.update_s = before.update_s if before is not None else 0.0
        self.stash_peak = before.stash_peak if before is not None else 1
        self.waited_before = before.wait_s if before is not None else 0.0
        """``before``: the engine this one replaces on this rank (a re-plan); the report counts the whole run."""
        if before is not None:
            self.updates = before.updates
        self.timer: Any = None
        """A ``planner.runtime.timing.RankTimer`` the rebalancing hooks set: passes run under its ``compute()``
        (which also stretches them by an emulated slowdown) and receives under its ``blocked()``."""

    # -- versions ---------------------------------------------------------------------------------------------
    def _snapshot(self, index: int, previous: Version | None,
                  delta: dict[str, torch.Tensor] | None = None) -> Version:
        version = self.versions[index] = Version.of(index, self.params, previous, delta)
        return version

    def _rebase(self, step: int) -> None:
        """A new engine starting at ``step`` (a resume, or a re-plan mid-run): the live weights are version ``step``
        and, for 2bw's first step, also the version one update old (its delay starts again, as at step 0)."""
        self.newest.index = self.updates = step
        self.versions = {step: self.newest}
        if self.schedule == "2bw":
            self.versions[step - 1] = self.newest

    def _release(self, version: Version) -> None:
        version.users -= 1
        self._drop_unused()

    def _drop_unused(self) -> None:
        keep = {self.newest.index, max(0, self.updates - 1)} if self.schedule == "2bw" else {self.newest.index}
        for index in [i for i, v in self.versions.items() if v.users == 0 and i not in keep]:
            del self.versions[index]

    # -- the round ----------------------------------------------------------------------------------------------
    def run_round(self, first_step: int, steps: int, batch: Batch) -> list[float | None]:
        """Train steps ``first_step .. first_step + steps - 1`` without a flush between them (but for the steps of
        the synchronous warm-up, which drain one by one: ``async_spans``); return per step the micro-batch losses
        over the step's micro-batch count on the last stage's rank (None elsewhere; summed over the replicas' last
        stages, the step's mean loss)."""
        if not self.started and first_step > 0:
            self._rebase(first_step)
        self.started = True
        losses: list[float | None] = []
        for start, count in async_spans(first_step, steps, self.warmup):
            losses += self._run_span(start, count, batch)
        return losses

    def _run_span(self, first_step: int, steps: int, batch: Batch) -> list[float | None]:
        """``run_round``'s steps from ``first_step`` in one order with no flush, then drained."""
        m, base = self.m, first_step * self.m
        losses = [0.0] * steps
        cache: dict[int, tuple[tuple[torch.Tensor, ...], torch.Tensor]] = {}
        order = async_orders(self.p, m, steps, self.inflight)[self.stage]
        for inbox in (self.activations, self.grads):
            if inbox is not None:
                inbox.expect(steps * m)
        for kind, _, j in order:
            if kind == UPD:
                self._update()
                continue
            k = base + j
            step = k // m
            if kind != FWD:
                loss = self._backward(k)
                if loss is not None:
                    losses[step - first_step] += loss / self.total
                continue
            if step not in cache:  # forwards come in micro-batch order: a step's batch is drawn once, by its first
                cache.clear()
                inputs, target = batch(step)
                cache[step] = (tuple(x.chunk(m) for x in inputs), target.chunk(m))
            chunks, targets = cache[step]
            self._forward(k, base, tuple(c[k % m] for c in chunks), targets[k % m])
        self._drain_sends(wait=True)
        self._apply_tied_sums()  # evaluation, a re-plan or a checkpoint after the round sees equal copies
        return losses if self.next is None else [None] * steps

    def _forward(self, k: int, round_start: int, inputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> None:
        if self.prev is not None:
            inputs = self._recv_activations()
        inputs = tuple(x.requires_grad_(True) if self.prev is not None and x.is_floating_point() else x
                       for x in inputs)
        if self.tied_late and k % self.m >= self.grace:
            self._apply_tied_sums()
        index = forward_version(self.schedule, self.stage, self.p, self.m, k, round_start=round_start,
                                inflight=self.inflight, warmup=self.warmup)
        if self.schedule == "async-1f1b" and index != self.newest.index:
            raise AssertionError(f"stage {self.stage}: forward of micro-batch {k} expects version {index}, "
                                 f"the newest is {self.newest.index}")  # the rule and the order disagree
        version = self.versions[index]
        tau = k // self.m - index
        weights = predict_weights(version, tau) if self.correction == "predict" else version.weights
        version.users += 1
        self.stash_peak = max(self.stash_peak, len(self.versions))
        start = self.clock()
        with self._computing(), torch.enable_grad(), self._running_on(weights):
            out = self.module(*inputs)
            outputs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            loss = self.criterion(outputs[0], target) if self.next is None else None
        self.compute_s += self.clock() - start
        self.pending[k] = _InFlight(version, weights, inputs, outputs, loss)
        if self.next is not None:
            self._send(outputs, self.next)
        if self.log is not None:
            self.log.append((k, version.index, -1, tau))

    def _backward(self, k: int) -> float | None:
        item = self.pending.pop(k)
        if self.next is None:
            assert item.loss is not None
            roots: list[torch.Tensor] = [item.loss]
            grads: list[torch.Tensor | None] = [None]
        else:
            received = self._recv_grads(item.outputs)
            pairs = [(o, g) for o, g in zip(item.outputs, received) if o.requires_grad]
            roots, grads = [o for o, _ in pairs], [g for _, g in pairs]
        wanted = [item.weights[c] for c in self.params] + [x for x in item.inputs if x.requires_grad]
        start = self.clock()
        with self._computing():
            found = torch.autograd.grad(roots, wanted, grads, allow_unused=True) if roots else [None] * len(wanted)
        self.compute_s += self.clock() - start
        for (c, acc), g in zip(self.acc.items(), found):
            if g is not None:
                acc.add_(g)
        if self.prev is not None:
            back = iter(found[len(self.params):])
            self._send_grads(tuple((next(back) if x.requires_grad else None) for x in item.inputs), item.inputs)
        if self.log is not None:
            self.log.append((k, -1, item.version.index, -1))
        self._release(item.version)
        return float(item.loss.detach()) if item.loss is not None else None

    def _exchange_tied(self) -> dict[str, tuple[Any, torch.Tensor]]:
        """A weight tied across ranks (an LM head and its embedding) steps with its holders' summed gradient, and no
        holder waits at its update for another to finish its step (a blocking all-reduce there would put back a
        bubble of one backward per step):

        * its first holder (the lowest stage, ``_tie_leader``) finishes its step last, so the others' parts of this
          update's sum are already posted: it steps its other weights while the sum travels, then the tied weight
          with the sum (returned here, name -> (all-reduce, tensor); ``_update`` steps them with ``_step_alone``);
        * every later holder posts its part and steps without the weight; it applies the same sum with the same
          optimizer (``_apply_tied_sums``) before its forward of the next step's micro-batch ``tied_grace``, the
          first that needs the first holder's post-update outputs, so the wait costs nothing. Its first forwards of a
          step run on the weight one sum behind (stashed, so their backward matches). Both copies take the same
          steps in the same order.

        With replicas (a later holder could not apply its sum after a ``local-sgd`` or ``adaptive`` averaging, and
        the reference rule keeps one set of weights for ``ssgd`` replicas) every holder steps with the previous
        update's sum instead, one update late for the whole weight, which costs convergence (docs/async.md)."""
        awaited: dict[str, tuple[Any, torch.Tensor]] = {}
        for tie in self.stages.tied:
            if tie.group is None:
                continue
            param = self.params[tie.name]
            mine = param.grad  # this update's accumulator: _update starts a fresh one
            work = dist.all_reduce(mine, group=tie.group, async_op=True)
            if self.sums_at_once:
                param.grad = None  # skipped by this step
                if self.tie_leader[tie.name] == self.stage:
                    awaited[tie.name] = (work, mine)  # stepped right after it (_update)
                else:
                    self.tied_pending[tie.name] = (work, mine)  # applied by _apply_tied_sums
                continue
            previous = self.tied_pending.pop(tie.name, None)
            if previous is None:
                param.grad = torch.zeros_like(param)
            else:
                done, summed = previous
                done.wait()
                param.grad = summed
            self.tied_pending[tie.name] = (work, mine)
        return awaited

    def _apply_tied_sums(self) -> None:
        """A later holder's tied weights step with the sums posted at its last update (``_exchange_tied``): the
        optimizer steps them alone, and the newest version is taken again (the micro-batches in flight keep theirs)."""
        if not (self.tied_late and self.tied_pending):
            return
        self._step_alone(self.tied_pending)
        self.tied_pending.clear()
        self.newest = self._snapshot(self.newest.index, None, self.newest.delta)

    def close(self) -> None:
        """Land the tied weights' last sums: a later holder applies them (``_apply_tied_sums``); with replicas the
        last all-reduce is waited for and its sum left unapplied (the run ends, or a new engine starts from the
        weights as they are)."""
        self._apply_tied_sums()
        for work, _ in self.tied_pending.values():
            work.wait()
        self.tied_pending.clear()

    def _update(self) -> None:
        """The stage's optimizer step after its ``m``-th backward, combined with its replicas as ``self.sync`` says:
        ``ssgd`` sums the gradients of every replica first (one flat all-reduce, as the simulator prices it);
        ``local-sgd`` and ``adaptive`` step on this replica's own mean gradient and average the models every few
        updates. The new version's delta is the optimizer's step alone, so weight prediction extrapolates the
        optimizer's progress, not an averaging's jump."""
        start = self.clock()
        self._apply_tied_sums()  # a step with fewer forwards than the grace: the last sums land before this one
        for c, p in self.params.items():
            p.grad = self.acc[c]
        if not self.sync.reduces_in_backward and self.acc:
            torch._foreach_div_(list(self.acc.values()), self.total)
        self.sync.after_backward(self.stages.params)
        awaited = self._exchange_tied()
        predicts = self.correction == "predict"  # a delta only feeds weight prediction
        before = ({c: p.detach().clone() for c, p in self.params.items()} if self.sync.moves_weights and predicts
                  else None)
        self.optimizer.step()
        if awaited:  # the first holder's tied weights: their sum travelled while the rest stepped
            self._step_alone(awaited)
        delta = {c: p.detach() - before[c] for c, p in self.params.items()} if before is not None else None
        self.sync.after_step(self.stages.params)
        self.updates += 1
        self.newest = self._snapshot(self.updates, self.newest if predicts else None, delta)
        self._fresh_accumulators()
        self._drop_unused()
        self.update_s += self.clock() - start

    def _step_alone(self, sums: Mapping[str, tuple[Any, torch.Tensor]]) -> None:
        """Step only the weights named in ``sums`` (name -> (all-reduce in flight, its tensor)), each with its sum
        once it has arrived; the others' gradients are left unset, so the optimizer skips them."""
        for p in self.params.values():
            p.grad = None
        for name, (work, summed) in sums.items():
            work.wait()
            self.params[name].grad = summed
        self.optimizer.step()
        for p in self.params.values():
            p.grad = None

    def _fresh_accumulators(self) -> None:
        """Zero the gradient accumulators for the next step's backwards, in place (no new memory to touch), except
        a tied weight's, whose tensor an all-reduce may still be summing into (``_exchange_tied``)."""
        kept = [acc for c, acc in self.acc.items() if c not in self.tie_leader]
        if kept:
            torch._foreach_zero_(kept)
        for c in self.tie_leader.keys() & self.acc.keys():
            self.acc[c] = torch.zeros_like(self.params[c])

    @contextlib.contextmanager
    def _running_on(self, weights: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """The stage module with a version's tensors (by canonical name) in place of its parameters, for one forward:
        what ``torch.func.functional_call`` does (the reference, ``train_async_reference``, calls it), without its
        cost per call, which on ``digits_cnn``'s millisecond passes was about a seventh of a forward."""
        live = [held[attr] for held, attr, _ in self.slots]
        for held, attr, c in self.slots:
            held[attr] = weights[c]
        try:
            yield
        finally:
            for (held, attr, _), param in zip(self.slots, live):
                held[attr] = param

    def _computing(self) -> contextlib.AbstractContextManager[None]:
        return self.timer.compute() if self.timer is not None else contextlib.nullcontext()

    # -- messages -----------------------------------------------------------------------------------------------
    def _send(self, tensors: Sequence[torch.Tensor], dst: int) -> None:
        if dst not in self.headed:
            self.headed.add(dst)
            for x in tensors:
                head = _header(x)
                self.sends.append((dist.isend(head, dst), head))
        for x in tensors:
            payload = x.detach().contiguous()
            self.sends.append((dist.isend(payload, dst), payload))
        self._drain_sends(wait=False)

    def _send_grads(self, grads: Sequence[torch.Tensor | None], inputs: Sequence[torch.Tensor]) -> None:
        assert self.prev is not None
        floats = [(g if g is not None else torch.zeros_like(x)) for g, x in zip(grads, inputs) if x.is_floating_point()]
        self._send(floats, self.prev)

    def _recv_activations(self) -> tuple[torch.Tensor, ...]:
        assert self.activations is not None
        return self.activations.take(len(self.stages.graphs[self.stage].input_names), self._blocked())

    def _recv_grads(self, outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        """The gradients of ``outputs``' floating-point values, from the next stage (None for the others)."""
        assert self.grads is not None
        received = iter(self.grads.take(sum(1 for o in outputs if o.is_floating_point()), self._blocked()))
        return tuple(next(received) if o.is_floating_point() else None for o in outputs)

    def _blocked(self) -> contextlib.AbstractContextManager[None]:
        return self.timer.blocked() if self.timer is not None else contextlib.nullcontext()

    def _drain_sends(self, wait: bool) -> None:
        """Forget sends that completed (oldest first: they complete in order), or wait for all of them."""
        if wait:
            for work, _ in self.sends:
                work.wait()
            self.sends = []
            return
        done = 0
        while done < len(self.sends) and self.sends[done][0].is_completed():
            done += 1
        del self.sends[:done]

    @property
    def wait_s(self) -> float:
        """Seconds this rank has waited for activations and gradients (over the engines it replaced too)."""
        return self.waited_before + sum(inbox.wait_s for inbox in (self.activations, self.grads) if inbox is not None)

    def report(self) -> dict[str, Any]:
        return {"schedule": self.schedule, "correction": self.correction, "warmup": self.warmup, "updates": self.updates,
                "stage": self.stage, "inflight": inflight_depth(self.stage, self.p, self.inflight),
                "versions_peak": self.stash_peak, "compute_s": self.compute_s, "wait_s": self.wait_s,
                "update_s": self.update_s}


def receives_ahead(receives: str, backend: str) -> bool:
    """Whether the engine posts each peer's next receive as soon as it has taken one (so that its transfer overlaps
    the compute in between), rather than when it is about to wait for it. ``receives``: ``plan run
    --async-receives`` (``ASYNC_RECEIVES`` of ``planner.runtime.launch.config``); ``auto`` decides by the backend.

    Not on gloo. Its TCP transport moves a message only once both sides have posted (a receive-ready and a
    send-ready notice, then the payload), and its own I/O thread, not a DMA engine, copies the bytes, on the cores the
    stages compute on; a receive posted ahead buys no copy that overlaps, and the call, made between two passes,
    now and then held the rank for milliseconds. docs/bench-async.md times the same plan both ways (docs/async.md,
    "When a receive is posted"). torch's ``Schedule1F1B`` posts each receive right before it waits on it, on every
    backend; NCCL's copies run on the GPU beside the compute, so there the engine posts ahead."""
    return receives == "ahead" or (receives == "auto" and backend != "gloo")


class _Inbox:
    """Messages from one peer, in order. With ``ahead`` a message's buffers are posted (``irecv``) as soon as the one
    before it is taken, so its transfer overlaps this rank's compute; otherwise when it is taken
    (``receives_ahead``). The first message is preceded by one header per tensor (``_header``); the shapes hold for
    the whole run."""

    def __init__(self, src: int, ahead: bool) -> None:
        self.src = src
        self.ahead = ahead
        self.meta: list[tuple[torch.dtype, tuple[int, ...]]] | None = None
        self.posted: tuple[list[Any], tuple[torch.Tensor, ...]] | None = None
        self.left = 0
        self.wait_s = 0.0

    def expect(self, messages: int) -> None:
        """The round will bring ``messages`` messages (none is posted beyond them, so a round ends with none open)."""
        self.left = messages

    def take(self, count: int, blocked: contextlib.AbstractContextManager[None]) -> tuple[torch.Tensor, ...]:
        start = time.perf_counter()
        with blocked:
            if self.meta is None:
                self.meta = []
                for _ in range(count):
                    head = torch.empty(_HEADER, dtype=torch.int64)
                    dist.recv(head, self.src)
                    self.meta.append(_unheader(head))
            if self.posted is None:
                self._post()
            assert self.posted is not None
            works, buffers = self.posted
            for work in works:
                work.wait()
        self.wait_s += time.perf_counter() - start
        self.posted = None
        self.left -= 1
        if self.ahead and self.left > 0:
            self._post()
        return buffers

    def _post(self) -> None:
        assert self.meta is not None
        buffers = tuple(torch.empty(shape, dtype=dtype) for dtype, shape in self.meta)
        self.posted = ([dist.irecv(b, self.src) for b in buffers], buffers)


def _header(x: torch.Tensor) -> torch.Tensor:
    if x.dim() > _HEADER - 2:
        raise UsageError(f"a value sent between stages has {x.dim()} dimensions; the asynchronous pipeline sends at "
                         f"most {_HEADER - 2}")
    head = torch.zeros(_HEADER, dtype=torch.int64)
    head[0] = _DTYPES.index(x.dtype)
    head[1] = x.dim()
    head[2:2 + x.dim()] = torch.tensor(x.shape, dtype=torch.int64)
    return head


def _unheader(head: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    values = head.tolist()
    return _DTYPES[values[0]], tuple(values[2:2 + values[1]])


def _tie_leader(tie: Any, rank_of_stage: Sequence[int]) -> int:
    """The first stage holding a tied weight (the lowest whose rank is among the tie's)."""
    return min(stage for stage, rank in enumerate(rank_of_stage) if rank in tie.ranks)


def _stage_names(graph: StageGraph, canonical: Mapping[int, str]) -> list[tuple[str, str]]:
    """(name in the stage module, the model's canonical name) of every parameter the stage reads:
    ``functional_call`` needs every name the module knows a parameter by (a tied one has several)."""
    return [(name, canonical[id(p)]) for name, p in graph.module.named_parameters(remove_duplicate=False)]


def train_async_reference(graphs: Sequence[StageGraph], model: torch.nn.Module, params: Mapping[str, torch.Tensor],
                          criterion: Callable[..., Any],
                          optimizer: str, lr: float, schedule: str, microbatches: int, batch: Batch, steps: int,
                          round_steps: int, correction: str = "predict", inflight: int | None = None,
                          shares: Sequence[int] | None = None, sync: str = "ssgd", period: int = 1,
                          warmup: int = 0, observe: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
                          ) -> tuple[list[float], list[list[dict[str, torch.Tensor]]]]:
    """The asynchronous update rule in one process, from the documented delays alone: micro-batches in order,
    stage ``s``'s forward of ``k`` on version ``forward_version(...)`` of its own weights (predicted when
    ``correction == "predict"``), every stage's update after every ``m``-th micro-batch, a weight held by several
    stages updated with the sum of their gradients as the runtime does (``AsyncEngine._exchange_tied``): in one
    pipeline, its first holder at the update and the later holders before their forward of the next step's
    micro-batch ``tied_grace`` (``_LateSums``); with replicas, every holder with the previous update's sum.
    ``shares``: replica pipelines' micro-batches per step (default: one pipeline), the step's micro-batches dealt to
    them in order, each replica's versions following its own share. ``sync``: how the replicas combine. ``ssgd``:
    one set of weights, every update taking the sum over all; ``local-sgd``: each replica its own weights, stepped on
    the mean over its own micro-batches, and after every ``period``-th update the replicas' weights averaged,
    weighted by their shares (a version's delta is its optimizer step alone). ``model`` names the parameters
    (``canonical_param_names``; the graphs read its tensors) and ``params`` gives their starting values by those
    names. ``warmup``: the synchronous warm-up (``async.warmup``): rounds are cut into drained spans as the engine
    cuts them (``async_spans``), and steps before it use their own step's version. ``observe(steps, weights)`` is
    called at each round's end (drained, where ``plan run`` evaluates) with the steps done and the first replica's
    weights by canonical name (live: read them, do not keep them). Returns the step losses and, per replica (one for
    ``ssgd``), each stage's weights at the end; the distributed run must equal it (``tests/test_async.py``)."""
    from planner.runtime.pipeline.training import make_optimizer

    if sync not in ("ssgd", "local-sgd"):
        raise UsageError(f"the reference combines replicas by ssgd or local-sgd, found {sync!r}")
    p, m = len(graphs), microbatches
    shares = list(shares or (m,))
    replica_of = [(r, j) for r, share in enumerate(shares) for j in range(share)]  # micro-batch i of a step
    copies = len(shares) if sync == "local-sgd" else 1
    divisor = [float(share) for share in shares] if sync == "local-sgd" else [float(m)]
    canonical = canonical_param_names(model)
    names = [_stage_names(g, canonical) for g in graphs]
    live = [[{c: torch.nn.Parameter(params[c].detach().clone()) for _, c in n} for n in names] for _ in range(copies)]
    optimizers = [[make_optimizer(w, optimizer, lr) for w in copy] for copy in live]
    history = [[{0: Version.of(0, stage, None)} for stage in copy] for copy in live]
    acc = [[{c: torch.zeros_like(w) for c, w in stage.items()} for stage in copy] for copy in live]
    shared = {c for stage in live[0] for c in stage if sum(c in other for other in live[0]) > 1}
    losses: list[float] = []
    tied: list[dict[str, torch.Tensor]] = [{} for _ in range(copies)]
    late = _LateSums(live[0], optimizers[0], history[0], shared, inflight) if len(shares) == 1 else None
    spans = [span for first in range(0, steps, round_steps)
             for span in async_spans(first, min(round_steps, steps - first), warmup)]
    for first, count in spans:
        for k in range(first * m, (first + count) * m):
            step, i = divmod(k, m)
            if i == 0:
                inputs, target = batch(step)
                chunks, targets = [x.chunk(m) for x in inputs], target.chunk(m)
                losses.append(0.0)
            values: tuple[torch.Tensor, ...] = tuple(c[i] for c in chunks)
            used = []
            r, j = replica_of[i]
            q = r if copies > 1 else 0
            for s, graph in enumerate(graphs):
                if late is not None:
                    late.before_forward(s, j)
                index = forward_version(schedule, s, p, shares[r], step * shares[r] + j, round_start=first * shares[r],
                                        inflight=inflight, warmup=warmup)
                version = history[q][s][index]
                weights = predict_weights(version, step - index) if correction == "predict" else version.weights
                used.append(weights)
                out = functional_call(graph.module, {name: weights[c] for name, c in names[s]}, values)
                values = tuple(out) if isinstance(out, (tuple, list)) else (out,)
            loss = criterion(values[0], targets[i])
            wanted = [(s, c, w) for s, weights in enumerate(used) for c, w in weights.items()]
            for (s, c, _), g in zip(wanted, torch.autograd.grad(loss, [w for _, _, w in wanted], allow_unused=True)):
                if g is not None:
                    acc[q][s][c].add_(g)
            losses[-1] += float(loss.detach()) / m
            if i == m - 1:
                _reference_update(live, optimizers, history, acc, tied, shared, divisor, step, late)
                if copies > 1 and (step + 1) % period == 0:
                    _average(live, history, shares, step + 1)
                acc = [[{c: torch.zeros_like(w) for c, w in stage.items()} for stage in copy] for copy in live]
        if late is not None:
            late.apply_all()  # the span's end: it drains
        done = first + count
        if observe is not None and (done % round_steps == 0 or done == steps):
            observe(done, {c: w for stage in live[0] for c, w in stage.items()})
    return losses, [[{c: w.detach().clone() for c, w in stage.items()} for stage in copy] for copy in live]


def _reference_update(live: list[list[dict[str, torch.nn.Parameter]]], optimizers: list[list[Any]],
                      history: list[list[dict[int, Version]]], acc: list[list[dict[str, torch.Tensor]]],
                      tied: list[dict[str, torch.Tensor]], shared: set[str], divisor: list[float], step: int,
                      late: "_LateSums | None") -> None:
    """Every copy's stages step on their mean gradient (a weight tied across stages: its holders' sum, see
    ``train_async_reference``) and record version ``step + 1`` with the optimizer's step as its delta."""
    for q, copy in enumerate(live):
        if late is not None:
            late.apply_all()  # sums a later holder has not applied yet land before this update
        sums = {c: sum(a[c] for a in acc[q] if c in a) / divisor[q] for c in shared}
        for s, stage in enumerate(copy):
            for c, w in stage.items():
                if c not in shared:
                    w.grad = acc[q][s][c] / divisor[q]
                elif late is not None:
                    w.grad = late.hold(s, c, sums[c])
                else:
                    w.grad = tied[q].get(c, torch.zeros_like(w))
        tied[q] = sums
        for s, stage in enumerate(copy):
            before = {c: w.detach().clone() for c, w in stage.items()}
            optimizers[q][s].step()
            delta = {c: w.detach() - before[c] for c, w in stage.items()}
            history[q][s][step + 1] = Version.of(step + 1, stage, history[q][s][step], delta)
        if late is not None:
            late.updated(step + 1)


class _LateSums:
    """The reference's tied weights in one pipeline (``AsyncEngine._exchange_tied``): the first holder steps with
    an update's sum at the update; a later holder holds the sum, and applies it alone with its optimizer before its
    forward of the next step's micro-batch ``tied_grace`` (or at the next update, or the round's end), taking its
    newest version again."""

    def __init__(self, stages: list[dict[str, torch.nn.Parameter]], optimizers: list[Any],
                 history: list[dict[int, Version]], shared: set[str], inflight: int | None) -> None:
        self.stages, self.optimizers, self.history = stages, optimizers, history
        self.leader = {c: min(s for s, stage in enumerate(stages) if c in stage) for c in shared}
        follows = [[self.leader[c] for c in shared if c in stage and self.leader[c] != s] for s, stage in
                   enumerate(stages)]
        self.grace = [min((tied_grace(lead, len(stages), inflight) for lead in leads), default=0) for leads in follows]
        self.pending: list[dict[str, torch.Tensor]] = [{} for _ in stages]
        self.newest = 0

    def hold(self, stage: int, name: str, summed: torch.Tensor) -> torch.Tensor | None:
        """The gradient ``stage`` steps ``name`` with at this update: the sum for its first holder, none (held) for
        the others."""
        if self.leader[name] == stage:
            return summed
        self.pending[stage][name] = summed
        return None

    def updated(self, index: int) -> None:
        self.newest = index

    def before_forward(self, stage: int, microbatch: int) -> None:
        """Before ``stage``'s forward of micro-batch ``microbatch`` of a step."""
        if microbatch >= self.grace[stage]:
            self.apply(stage)

    def apply_all(self) -> None:
        for stage in range(len(self.stages)):
            self.apply(stage)

    def apply(self, stage: int) -> None:
        if not self.pending[stage]:
            return
        weights = self.stages[stage]
        for c, w in weights.items():
            w.grad = self.pending[stage].get(c)
        self.pending[stage] = {}
        self.optimizers[stage].step()
        for w in weights.values():
            w.grad = None
        old = self.history[stage][self.newest]
        self.history[stage][self.newest] = Version.of(self.newest, weights, None, old.delta)


def _average(live: list[list[dict[str, torch.nn.Parameter]]], history: list[list[dict[int, Version]]],
             shares: Sequence[int], index: int) -> None:
    """``local-sgd``'s aggregation in the reference: every replica's weights set to the share-weighted mean, version
    ``index`` too (its delta stays the optimizer's step)."""
    total = float(sum(shares))
    with torch.no_grad():
        for s in range(len(live[0])):
            for c in live[0][s]:
                mean = sum(copy[s][c].detach() * (share / total) for copy, share in zip(live, shares))
                for q, copy in enumerate(live):
                    copy[s][c].copy_(mean)
                    history[q][s][index].weights[c].copy_(mean)
