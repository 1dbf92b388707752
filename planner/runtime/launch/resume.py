"""What a run depends on, recorded in its checkpoints and compared when a run resumes from one.

A checkpoint holds the plan in force, the weights, optimizer state and step. Resuming from it is only
the same run when the rest is the same too: the model (its captured graph and parameter shapes), the
data (``--data`` or the synthetic stream), the seed, the optimizer, learning rate and micro-batch size,
and the plan the run started from. ``run_identity`` records those; ``check_resume`` compares them with
the run being started and refuses a difference in one line that names the checkpoint, the field, both
values and what to do. It runs in ``prepare``, so ``plan run`` refuses before any rank starts.

The checkpoint's plan may differ from the plan given: rebalancing changes the plan in force, and a
resumed run continues under it. ``plan run`` says so before the ranks start and in its summary, and
says when the checkpoint's run started from another plan than the one given.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Mapping

from torch import nn

from planner.errors import PlanMismatchError, UsageError
from planner.formats.plan import Plan, plan_from_dict
from planner.partition.search.rebalance import plan_fingerprint
from planner.profile.capture import Captured
from planner.runtime import checkpoint as ckpt
from planner.runtime.rebalancing.replan import device_order, stage_keys

__all__ = ["Resume", "run_identity", "check_resume", "IDENTITY_KEY"]

IDENTITY_KEY = "run"
"""Key of the run's identity in a checkpoint's ``extra``."""

_FIELDS = (  # field, how the message names it, what to pass to match
    ("model", "model", "the same MODEL"),
    ("graph", "model graph (ops and parameter shapes)", "the same model code"),
    ("data", "--data", "the same --data"),
    ("seed", "--seed", "the same --seed"),
    ("optimizer", "--optimizer", "the same --optimizer"),
    ("lr", "--lr", "the same --lr"),
    ("microbatch_size", "--microbatch-size", "the same --microbatch-size"),
)


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes from, checked against it."""

    info: ckpt.CheckpointInfo
    plan: Plan
    """The plan in force when the checkpoint was written (the run continues under it)."""
    plan_changed: bool
    """The checkpoint's plan differs from the plan given (the run continues under the checkpoint's)."""
    other_start: bool = False
    """The checkpoint's run started from another plan than the one given (not only rebalanced from it)."""

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.info.step, "path": str(self.info.path), "plan_changed": self.plan_changed,
                "other_start": self.other_start}



def run_identity(config: Any, captured: Captured, module: nn.Module, settings: Any, plan: Plan) -> dict[str, Any]:
    """What the run depends on besides the checkpointed state (JSON-ready)."""
    graph = [(op.name, op.op) for op in captured.ops]
    shapes = sorted((name, list(p.shape)) for name, p in module.named_parameters())
    return {
        "model": config.model,
        "graph": hashlib.sha256(json.dumps([graph, shapes]).encode()).hexdigest()[:16],
        "data": config.data or "synthetic",
        "seed": settings.seed,
        "optimizer": settings.optimizer,
        "lr": settings.lr,
        "microbatch_size": settings.microbatch_size,
        "plan": _fingerprint(plan),
    }


def check_resume(checkpoint_dir: str | None, steps: int, identity: Mapping[str, Any], plan: Plan,
                 plan_path: str) -> Resume | None:
    """The newest complete checkpoint under ``checkpoint_dir``, checked against this run (``None``: start afresh)."""
    info = ckpt.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    if info is None:
        return None
    where = f"checkpoint {str(info.path)!r}"
    if steps <= info.step:
        raise UsageError(f"--steps {steps} is not above step {info.step} of {where}, so there is nothing left to "
                         f"train; pass --steps above {info.step} to train on, or another --checkpoint-dir to start "
                         f"afresh")
    held = plan_from_dict(dict(info.plan), f"{where} plan")
    if device_order(held) != device_order(plan):
        raise PlanMismatchError(f"{where} runs devices {list(device_order(held))} on ranks 0..{len(device_order(held)) - 1}, "
                                f"the plan given {list(device_order(plan))}; resume with the plan the checkpoint was "
                                f"made from, or pass another --checkpoint-dir to start afresh")
    recorded = info.extra.get(IDENTITY_KEY)
    if isinstance(recorded, Mapping):
        for field, name, fix in _FIELDS:
            if field in recorded and recorded[field] != identity[field]:
                raise PlanMismatchError(
                    f"{where} was written by a run with {name} {recorded[field]!r}, this run has "
                    f"{identity[field]!r}; resuming would silently change the run: resume with {fix}, or pass "
                    f"another --checkpoint-dir to start afresh")
    started = recorded.get("plan") if isinstance(recorded, Mapping) else None
    return Resume(info, held, plan_changed=_fingerprint(held) != _fingerprint(plan),
                  other_start=started is not None and started != identity["plan"])


def _fingerprint(plan: Plan) -> str:
    """The plan's identity for a resume: the rebalancer's (``stage_keys``: each stage's nodes and holders, replicas
    and their shares included) and the schedule and micro-batches."""
    return plan_fingerprint(stage_keys(plan)) + f"/{plan.schedule}/{plan.microbatches}"
