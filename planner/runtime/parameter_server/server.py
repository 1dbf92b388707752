"""The parameter server rank: it holds the global model and its optimizer, takes the workers' gradients and
hands back the model, in one of four modes (docs/sync.md):

- ``bsp``: every worker's gradient of one version is in before one update (their share-weighted sum, summed in
  rank order, so the result does not depend on arrival order); every worker waits for all, every step;
- ``asp``: each gradient is applied as it arrives and its sender gets the new model at once;
- ``ssp``: as asp, but a worker that has pushed ``clock`` updates gets its reply only while ``clock`` is at most
  ``staleness`` ahead of the slowest worker's (``rule.may_proceed``); held workers are released as the slowest
  catch up;
- ``dasp``: the synchronous group's gradients are combined as bsp combines everyone's, an asynchronous worker's
  gradient is applied on arrival with its learning rate scaled by ``1 / staleness`` (``rule.async_scale``), or
  with ``--dasp-async-update fold`` kept for the group's next combined update, weighted by its share x
  ``1 / staleness``; after every round ``rule.next_states`` moves workers between the two.

Progress is counted in *steps* of the plan's global batch: a step ends when updates holding ``microbatches``
micro-batches have been applied (one bsp update; ``d`` asp updates of ``d`` even workers), so ``--steps``,
``--round-steps`` and ``--eval-every`` mean the same samples in every mode. Buffers: a combined update takes the
members' share-weighted mean; an asynchronous one moves the server's buffers towards the sender's by its share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from planner.runtime.parameter_server.rule import (ASYNC, SYNC, DaspRule, WorkerState, async_scale, may_proceed,
                                                   next_states)
from planner.runtime.parameter_server.wire import ModelTensors, Push, recv_push_header, send_reply

__all__ = ["ServerSetup", "Server"]


@dataclass(frozen=True)
class ServerSetup:
    mode: str
    workers: tuple[int, ...]
    """The workers' ranks."""
    shares: tuple[int, ...]
    """Each worker's micro-batches per iteration (the plan's replica shares)."""
    microbatches: int
    """Micro-batches of one step (the plan's global count)."""
    steps: int
    round_steps: int
    staleness: int = 3
    rule: DaspRule = field(default_factory=DaspRule)


@dataclass
class _RoundTally:
    """What one round saw of one worker."""

    compute_s: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    waited_s: float = 0.0
    pushes: int = 0


class Server:
    """The loop of the server rank (``run``) and what it recorded (``report``)."""

    def __init__(self, setup: ServerSetup, model: ModelTensors, optimizer: torch.optim.Optimizer) -> None:
        self.setup = setup
        self.model = model
        self.optimizer = optimizer
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.share = dict(zip(setup.workers, setup.shares))
        self.version = 0
        self.applied_mb = 0
        self.step = 0
        self.states = {w: WorkerState() for w in setup.workers}
        self.members = set(setup.workers)
        """dasp's synchronous group (bsp: everyone, always)."""
        self.clocks = {w: 0 for w in setup.workers}
        self.waiting: dict[int, torch.Tensor | None] = {}
        """Workers that pushed and wait for their reply: a combined mode's payload to combine, or ``None`` (ssp
        held)."""
        self.versions: dict[int, int] = {}
        self.folded: list[tuple[int, int, torch.Tensor]] = []
        """dasp with ``fold``: asynchronous gradients ``(worker, version computed on, payload)`` waiting for the
        group's next combined update."""
        self.applied = {w: 0 for w in setup.workers}
        self.pushes = {w: 0 for w in setup.workers}
        self.discarded = {w: 0 for w in setup.workers}
        self.stale_applied = 0
        self.replies: list[tuple[int, int, int]] = []
        """ssp: ``(worker, its clock, the slowest clock)`` at every reply (the invariant's record)."""
        self.losses: list[float] = []
        self._loss = [0.0, 0]
        self.rounds: list[dict[str, Any]] = []
        self._tally = {w: _RoundTally() for w in setup.workers}
        self._round_began = time.perf_counter()
        self._paused_s = 0.0
        self.transitions: list[dict[str, Any]] = []

    # -- the loop -----------------------------------------------------------------------------------------------
    def run(self, on_step: Callable[[int], bool]) -> None:
        """Serve until ``setup.steps`` steps are applied or ``on_step(step)`` (called after every step; its time
        is not training time) says stop; every worker gets a stop reply."""
        payload, out = self.model.empty(), self.model.empty()
        for w in self.setup.workers:
            send_reply(w, 0, self.model.values(out))
        self._out = out
        live, stopping = set(self.setup.workers), False
        self._round_began = time.perf_counter()
        while live:
            source, push = recv_push_header()
            torch.distributed.recv(payload, src=source)
            self.pushes[source] += 1
            if stopping:
                self.discarded[source] += 1  # computed after the last step: not applied
                send_reply(source, self.version, None)
                live.discard(source)
                continue
            tally = self._tally[source]
            tally.compute_s.append(push.compute_s)
            tally.waited_s += push.waited_s
            tally.pushes += 1
            self.clocks[source] = push.clock + 1
            self._on_push(source, push, payload)
            stopping = self._advance(on_step)
            if stopping:
                for w in sorted(self.waiting):
                    self.discarded[w] += self.waiting[w] is not None  # a group member's gradient not combined
                    send_reply(w, self.version, None)
                    live.discard(w)
                self.waiting.clear()
                for w, _, _ in self.folded:  # an asynchronous gradient no combined update took in
                    self.discarded[w] += 1
                self.folded = []

    def _on_push(self, source: int, push: Push, payload: torch.Tensor) -> None:
        mode = self.setup.mode
        self._loss[0] += push.loss * self.share[source]
        self._loss[1] += self.share[source]
        if mode == "dasp" and source not in self.members and self.setup.rule.async_update == "fold":
            self.folded.append((source, push.version, payload.clone()))
            self._reply(source)
        elif mode == "asp" or (mode == "dasp" and source not in self.members):
            self._apply_alone(source, push.version, payload, scaled=mode == "dasp")
            self._reply(source)
        elif mode == "ssp":
            self._apply_alone(source, push.version, payload, scaled=False)
            self.waiting[source] = None
            self._release_ssp()
        else:  # bsp, and dasp's synchronous group
            self.waiting[source] = payload.clone()
            self.versions[source] = push.version
            self._combine_if_complete()

    def _release_ssp(self) -> None:
        slowest = min(self.clocks.values())
        for w in sorted(self.waiting):
            if may_proceed(self.clocks[w], list(self.clocks.values()), self.setup.staleness):
                del self.waiting[w]
                self.replies.append((w, self.clocks[w], slowest))
                self._reply(w)

    def _combine_if_complete(self) -> None:
        group = sorted(self.members)
        if not group or any(w not in self.waiting for w in group):
            return
        # (sender, weight, gradient) in rank order, then the folded ones by sender and version: the same sum
        # whatever the arrival order
        parts = [(w, float(self.share[w]), self.waiting[w]) for w in group]
        parts += [(w, self.share[w] * async_scale(self._count(w, version)), payload)
                  for w, version, payload in sorted(self.folded, key=lambda f: (f[0], f[1]))]
        self.folded = []
        weights = sum(weight for _, weight, _ in parts)
        combined = torch.zeros_like(parts[0][2])  # type: ignore[arg-type]
        for _, weight, payload in parts:
            combined.add_(payload, alpha=weight / weights)  # type: ignore[arg-type]
        for w in group:
            self._count(w, self.versions[w])  # dasp: asynchronous updates may have come in between
        self._update(combined, 1.0, 1.0)
        self.applied_mb += sum(self.share[w] for w, _, _ in parts)
        for w in group:
            del self.waiting[w]
            self._reply(w)

    def _count(self, worker: int, computed_on: int) -> int:
        """Record one applied gradient of ``worker`` computed on model version ``computed_on``; its staleness."""
        staleness = self.version - computed_on
        self._tally[worker].staleness.append(staleness)
        self.stale_applied += staleness > 0
        self.applied[worker] += 1
        return staleness

    def _apply_alone(self, worker: int, computed_on: int, payload: torch.Tensor, *, scaled: bool) -> None:
        """One worker's gradient as its own update (``scaled``: lr x ``async_scale`` of its staleness)."""
        staleness = self._count(worker, computed_on)
        self._update(payload, async_scale(staleness) if scaled else 1.0, self.share[worker] / self.setup.microbatches)
        self.applied_mb += self.share[worker]

    def _update(self, flat: torch.Tensor, lr_scale: float, buffer_weight: float) -> None:
        """One optimizer step with the gradients in ``flat``; the buffers moved ``buffer_weight`` of the way to
        ``flat``'s."""
        self.model.set_grads(flat)
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = lr * lr_scale
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = lr
        if self.model.buffers:
            mixed = self.model.values(self._out).mul_(1.0 - buffer_weight).add_(flat, alpha=buffer_weight)
            self.model.set_buffers(mixed)
        self.version += 1

    def _reply(self, worker: int) -> None:
        send_reply(worker, self.version, self.model.values(self._out))

    # -- steps, rounds and dasp's states ------------------------------------------------------------------------
    def _advance(self, on_step: Callable[[int], bool]) -> bool:
        """Close the steps (and rounds) the applied micro-batches complete; True to stop."""
        m = self.setup.microbatches
        while self.applied_mb >= (self.step + 1) * m:
            self.step += 1
            self.losses.append(self._loss[0] / self._loss[1] if self._loss[1] else float("nan"))
            self._loss = [0.0, 0]
            if self.step % self.setup.round_steps == 0 or self.step >= self.setup.steps:
                self._close_round()
            began = time.perf_counter()
            stop = on_step(self.step)
            self._paused_s += time.perf_counter() - began
            if stop or self.step >= self.setup.steps:
                return True
        return False

    def _close_round(self) -> None:
        now = time.perf_counter()
        first = self.rounds[-1]["first_step"] + self.rounds[-1]["steps"] if self.rounds else 0
        steps = self.step - first
        workers = []
        for w in self.setup.workers:
            t = self._tally[w]
            workers.append({
                "rank": w, "state": self._state_of(w), "pushes": t.pushes,
                "iteration_s": sum(t.compute_s) / len(t.compute_s) if t.compute_s else None,
                "staleness": sum(t.staleness) / len(t.staleness) if t.staleness else None,
                "max_staleness": max(t.staleness, default=None), "waited_s": t.waited_s, "clock": self.clocks[w]})
        record: dict[str, Any] = {
            "round": len(self.rounds), "first_step": first, "steps": steps,
            "wall_s": now - self._round_began - self._paused_s,
            "loss": self.losses[-1] if self.losses else None, "version": self.version, "workers": workers}
        if self.setup.mode == "dasp":
            record["transitions"] = self._transition([row["iteration_s"] for row in workers])
        self.rounds.append(record)
        self._tally = {w: _RoundTally() for w in self.setup.workers}
        self._round_began, self._paused_s = time.perf_counter(), 0.0

    def _state_of(self, worker: int) -> str:
        if self.setup.mode == "dasp":
            return self.states[worker].state
        return SYNC if self.setup.mode == "bsp" else ASYNC

    def _transition(self, measured: list[float | None]) -> list[dict[str, Any]]:
        """dasp: the rule's new states, in force at once (a worker leaving the group while it waits for it has
        its gradient applied asynchronously and its reply sent)."""
        workers = self.setup.workers
        new = dict(zip(workers, next_states([self.states[w] for w in workers], measured, self.setup.rule)))
        changes = []
        for w in workers:
            before, after = self.states[w].state, new[w].state
            if before != after:
                changes.append({"rank": w, "from": before, "to": after, "iteration_s": new[w].iteration_s})
        self.states = new
        self.members = {w for w in workers if new[w].state == SYNC}
        for change in changes:
            w = change["rank"]
            if change["to"] == ASYNC and w in self.waiting:
                payload = self.waiting.pop(w)
                assert payload is not None
                self._apply_alone(w, self.versions[w], payload, scaled=True)
                self._reply(w)
        self._combine_if_complete()
        self.transitions.extend({**c, "step": self.step} for c in changes)
        return changes

    def report(self) -> dict[str, Any]:
        """The sync part of the run summary."""
        return {"applied": dict(sorted((str(w), n) for w, n in self.applied.items())),
                "pushes": dict(sorted((str(w), n) for w, n in self.pushes.items())),
                "discarded": dict(sorted((str(w), n) for w, n in self.discarded.items())),
                "stale_applied": self.stale_applied, "version": self.version,
                "staleness_bound": self.setup.staleness if self.setup.mode == "ssp" else None,
                "ssp_replies": [list(r) for r in self.replies] if self.setup.mode == "ssp" else None,
                "states": {str(w): s.state for w, s in self.states.items()} if self.setup.mode == "dasp" else None,
                "transitions": self.transitions if self.setup.mode == "dasp" else None}
