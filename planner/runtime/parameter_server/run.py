"""The ranks of a parameter-server run: the server's loop with evaluation and the round log, the workers'
loop, and the summary (the package docstring says how the pieces fit)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from planner.data import factory as data_mod
from planner.runtime.launch.config import RunConfig
from planner.runtime.launch.prepare import Prepared
from planner.runtime.options import parse_target
from planner.runtime.parameter_server.rule import DaspRule
from planner.runtime.parameter_server.server import Server, ServerSetup
from planner.runtime.parameter_server.wire import ModelTensors, send_reply
from planner.runtime.parameter_server.worker import WorkerSetup, work
from planner.runtime.pipeline.training import make_optimizer
from planner.runtime.slowdown import parse_slowdown_patterns

__all__ = ["run_served", "evaluate_module"]


def run_served(config: RunConfig, prepared: Prepared, rank: int, world: int) -> dict[str, Any]:
    """This rank's part of a parameter-server run: the server's summary (the run's, ``primary``) or a worker's."""
    plan = prepared.plan
    shape = plan.shape()
    server, workers = world - 1, tuple(range(world - 1))
    if rank == server:
        summary = _serve(config, prepared, ServerSetup(
            shape.sync, workers, shape.shares, plan.microbatches, config.steps, config.round_steps, shape.staleness,
            DaspRule(config.dasp_slow_factor, config.dasp_rejoin_factor, config.dasp_patience,
                     async_update=config.dasp_async_update)))
    else:
        slow = parse_slowdown_patterns(config.options.get("emulate_slowdown"), len(workers))
        first = sum(shape.shares[:rank])
        share = shape.shares[rank]

        def rows(step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
            inputs, target = prepared.batch(step)
            size = target.shape[0] // plan.microbatches
            cut = slice(first * size, (first + share) * size)
            return tuple(x[cut] for x in inputs), target[cut]

        summary = {"rank": rank, "role": "worker",
                   **work(WorkerSetup(server, share, slow.get(rank)), prepared.module, rows,
                          data_mod.loss_fn(prepared.spec, prepared.custom_loss))}
    reports: list[Any] = [None] * world if rank == server else []
    dist.gather_object({k: v for k, v in summary.items() if k != "plan"} if rank != server else None,
                       reports if rank == server else None, dst=server)
    if rank == server:
        summary["sync"]["workers"] = [r for r in reports if r is not None]
    return summary


def evaluate_module(module: torch.nn.Module, prepared: Prepared, batches: int) -> dict[str, Any]:
    """Loss (and accuracy, where the task has one) of ``module`` on the first ``batches`` validation batches, each
    cut into the plan's micro-batches as the pipeline's evaluation cuts it; buffers restored afterwards."""
    assert prepared.val_batch is not None
    spec = prepared.spec
    criterion = data_mod.loss_fn(spec, prepared.custom_loss)
    buffers = list(module.buffers())
    saved = [b.detach().clone() for b in buffers]
    m = prepared.plan.microbatches
    loss_sum, correct, rows = 0.0, 0.0, 0.0
    with torch.no_grad():
        for index in range(batches):
            inputs, target = prepared.val_batch(index)
            out = torch.cat([module(*x) for x in zip(*(t.chunk(m) for t in inputs))])
            n = float(target.shape[0])
            loss_sum += float(criterion(out, target)) * n
            rows += n
            if data_mod.has_accuracy(spec):
                correct += float((out.argmax(-1) == target).float().mean()) * n
        for buffer, value in zip(buffers, saved):
            buffer.copy_(value)
    return {"loss": loss_sum / max(rows, 1.0),
            "accuracy": correct / max(rows, 1.0) if data_mod.has_accuracy(spec) else None}


def _serve(config: RunConfig, prepared: Prepared, setup: ServerSetup) -> dict[str, Any]:
    from planner.runtime.rebalancing.roundlog import RoundLog

    module = prepared.module
    settings = prepared.settings
    optimizer = make_optimizer(dict(module.named_parameters()), settings.optimizer, settings.lr)
    server = Server(setup, ModelTensors(module), optimizer)
    target = parse_target(config.target)
    evals: list[dict[str, Any]] = []
    state = {"eval_s": 0.0, "reached": None, "written": 0}
    start = time.perf_counter()
    options = config.options
    with RoundLog(options.get("log"), json_stdout=bool(options.get("json"))) as log:

        def evaluate(step: int) -> bool:
            began = time.perf_counter()
            result = {"step": step, "wall_s": began - start - state["eval_s"],
                      **evaluate_module(module, prepared, config.eval_batches)}
            state["eval_s"] += time.perf_counter() - began
            evals.append(result)
            log.write({"eval": result})
            if target is not None and state["reached"] is None and target.reached(result["loss"], result["accuracy"]):
                state["reached"] = result["wall_s"]
                return config.stop_at_target
            return False

        def on_step(step: int) -> bool:
            for record in server.rounds[state["written"]:]:
                log.write(record)
            state["written"] = len(server.rounds)
            every = config.eval_every
            if every and (step % every == 0 or step >= config.steps):
                return evaluate(step)
            return False

        if bool(config.eval_every) and evaluate(0):  # reached before any training: every worker stops at once
            for w in setup.workers:
                send_reply(w, 0, None)
        else:
            server.run(on_step)
    wall_s = time.perf_counter() - start - state["eval_s"]
    if options.get("output"):  # -o: the plan as it ran (no rebalancing re-plans it under these modes)
        from planner.formats.plan import save_plan

        save_plan(prepared.plan, options["output"])
    shape = prepared.plan.shape()
    steady = server.rounds[1:] or server.rounds
    steps_timed = sum(r["steps"] for r in steady)
    return {
        "primary": True, "rank": dist.get_rank(), "role": "server", "world_size": dist.get_world_size(),
        "backend": dist.get_backend(), "schedule": prepared.plan.schedule, "microbatches": prepared.plan.microbatches,
        "microbatch_size": settings.microbatch_size, "optimizer": settings.optimizer, "lr": settings.lr,
        "loss": prepared.spec.loss, "steps": server.step, "losses": server.losses, "first_step": 0, "resumed": None,
        "wall_s": wall_s, "eval_s": state["eval_s"], "eval": evals,
        "target": target.to_dict() if target is not None else None, "time_to_target_s": state["reached"],
        "bytes_sent": None,
        "data": {"source": config.data or "synthetic", "task": prepared.spec.loss,
                 "fingerprint": prepared.data_fingerprint},
        "sync": {"mode": setup.mode, "degree": shape.degree, "shares": list(shape.shares), **server.report()},
        "replica": None,
        "step_time_s": sum(r["wall_s"] for r in steady) / steps_timed if steps_timed else None,
        "predicted_step_time_s": prepared.plan.step_time_s,
        "device_mismatch": list(prepared.device_mismatch),
        "rounds": server.rounds,
        "stages": [0],
        "plan": prepared.plan.to_dict(),
    }
