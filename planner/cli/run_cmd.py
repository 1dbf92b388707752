"""``plan run``: gather options, call ``planner.app.run.run_plan``, render the summary.

Under ``torchrun`` every process is one rank; ``python -m planner.run`` is the same command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from planner.cli.app import command, console, emit_json
from planner.runtime.parameter_server.rule import DaspRule


@command("run")
def run_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan JSON (from plan partition).", show_default=False)],
    model: Annotated[str, typer.Argument(help="The profiled model's factory: 'package.module:factory' or "
                     "'path/to/file.py:factory'.", show_default=False)],
    steps: Annotated[int, typer.Option("--steps", help="Training steps.")] = 10,
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", help="Ranks on this node "
                              "(default: the plan's device count / nnodes).", show_default=False)] = None,
    microbatch_size: Annotated[Optional[int], typer.Option("--microbatch-size", help="Rows per micro-batch "
                               "(default: the profile's).", show_default=False)] = None,
    optimizer: Annotated[Optional[str], typer.Option("--optimizer", help="sgd or adam (default: the plan's "
                         "optimizer if it is one of those, else sgd).", show_default=False)] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate (default: 0.01 for sgd, 1e-3 for "
                  "adam).", show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the model factory and the synthetic data.")] = 0,
    data: Annotated[Optional[str], typer.Option("--data", help="'pkg.mod:factory' returning (inputs, target) "
                    "for factory(seed=, step=, batch_size=, split='train'|'val') (default: seeded synthetic "
                    "batches). Bundled: planner.data.digits:batches, planner.data.text:batches.",
                    show_default=False)] = None,
    loss: Annotated[Optional[str], typer.Option("--loss", help="'pkg.mod:fn' with fn(output, target) -> scalar "
                    "(default: from the task: next-token or class cross-entropy, else MSE).",
                    show_default=False)] = None,
    eval_every: Annotated[int, typer.Option("--eval-every", help="Evaluate on held-out batches every K steps "
                          "(0: never); logged and in the summary's eval.")] = 0,
    eval_batches: Annotated[int, typer.Option("--eval-batches", help="Held-out batches per evaluation (the "
                            "same ones each time).")] = 4,
    target: Annotated[Optional[str], typer.Option("--target", help="accuracy=A or loss=L: record "
                      "time_to_target_s, the training time to the first evaluation that reaches it.",
                      show_default=False)] = None,
    stop_at_target: Annotated[bool, typer.Option("--stop-at-target", help="End the run at the evaluation that "
                              "reaches --target.")] = False,
    emulate_link: Annotated[Optional[str], typer.Option("--emulate-link", help="BANDWIDTH[,LATENCY] in bytes/s "
                            "and s: every transfer between ranks takes latency + bytes/bandwidth longer "
                            "(testing aid; the prediction uses the same figures).", show_default=False)] = None,
    sync: Annotated[Optional[str], typer.Option("--sync", help="How replicas combine their updates: ssgd, "
                    "local-sgd (every --sync-period steps), adaptive, or through a parameter server rank bsp, asp, "
                    "ssp or dasp (docs/sync.md). Default: the plan's data_parallel.sync.", show_default=False)] = None,
    sync_period: Annotated[Optional[int], typer.Option("--sync-period", help="Local steps between aggregations "
                           "(local-sgd; adaptive: the first interval). Default: the plan's.",
                           show_default=False)] = None,
    sync_elastic: Annotated[float, typer.Option("--sync-elastic", help="adaptive: share of its drift from the "
                            "expected global model a replica gives back every local step (0, the default: no correction; "
                            "docs/sync.md says why).")] = 0.0,
    sync_momentum: Annotated[float, typer.Option("--sync-momentum", help="adaptive: the outer momentum of the "
                             "global model's steps (SlowMo; 0, the default: the averaged model as it is).")] = 0.0,
    sync_chunk_bytes: Annotated[Optional[int], typer.Option("--sync-chunk-bytes", help="adaptive: bytes per "
                                "sub-tensor an aggregation is cut into, sent first layers first. Default: from the "
                                "plan's links, the least size at which a link's latency is at most a fifth of a "
                                "ring step (docs/sync.md).", show_default=False)] = None,
    sync_overhead: Annotated[float, typer.Option("--sync-overhead", help="adaptive: largest share of the step "
                             "time aggregations may take; sets the interval with the loss.")] = 0.1,
    sync_max_period: Annotated[int, typer.Option("--sync-max-period", help="adaptive: the longest "
                               "interval.")] = 32,
    staleness: Annotated[Optional[int], typer.Option("--staleness", help="ssp: how many steps the fastest worker "
                         "may be ahead of the slowest. Default: the plan's.", show_default=False)] = None,
    dasp_slow_factor: Annotated[float, typer.Option("--dasp-slow-factor", help="dasp: a synchronous worker this "
                                "many times slower than the fastest leaves the group.")] = DaspRule.slow_factor,
    dasp_rejoin_factor: Annotated[float, typer.Option("--dasp-rejoin-factor", help="dasp: an asynchronous worker "
                                  "within this many times the fastest rejoins.")] = DaspRule.rejoin_factor,
    dasp_patience: Annotated[int, typer.Option("--dasp-patience", help="dasp: rounds in a row before a worker "
                             "changes state.")] = DaspRule.patience,
    dasp_async_update: Annotated[str, typer.Option("--dasp-async-update", help="dasp: an asynchronous worker's "
                                 "gradient folded into the group's next update (fold), or an update of its own on "
                                 "arrival (apply); either way weighted by 1 / staleness.")] = DaspRule.async_update,
    async_receives: Annotated[str, typer.Option("--async-receives", help="async-1f1b and 2bw: when a rank posts "
                              "each receive: auto (when it is about to wait on gloo, one message ahead elsewhere; "
                              "docs/async.md), ahead or on-demand.")] = "auto",
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Profile the plan was made from "
                       "(default: the plan's profile.path).", show_default=False)] = None,
    round_steps: Annotated[int, typer.Option("--round-steps", help="Steps per round (rebalancing and "
                           "progress happen between rounds).")] = 5,
    nnodes: Annotated[str, typer.Option("--nnodes", help="Nodes, N or MIN:MAX (as torchrun).")] = "1",
    rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous "
                             "shared by all nodes (default: a free local port).", show_default=False)] = None,
    rdzv_id: Annotated[str, typer.Option("--rdzv-id", help="Job id, the same on every node.")] = "plan-run",
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="Restarts of the worker group after a "
                            "failure (as torchrun).")] = 0,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Seconds a collective or transfer may wait "
                         "before the run fails (instead of hanging).")] = 120.0,
    params_out: Annotated[Optional[Path], typer.Option("--params-out", help="Directory where every rank writes "
                          "rank{R}.pt: its trained parameters by name.", show_default=False)] = None,
    rebalance: Annotated[bool, typer.Option("--rebalance/--no-rebalance", help="Rebalance between rounds from "
                         "measured waits (the rebalancing loop; docs/rebalancing.md, docs/methods.md).")] = True,
    threshold: Annotated[float, typer.Option("--rebalance-threshold", help="A round is unbalanced when the max "
                         "wait exceeds the mean by this fraction of the round.")] = 0.05,
    patience: Annotated[int, typer.Option("--patience", help="Stop rebalancing after this many rounds without "
                        "a plan change (S6).")] = 3,
    emulate_slowdown: Annotated[Optional[list[str]], typer.Option("--emulate-slowdown", help="RANK=FACTOR: that "
                                "rank waits (FACTOR-1)x its compute after each pass (testing aid; repeatable).",
                                show_default=False)] = None,
    log: Annotated[Optional[str], typer.Option("--log", help="Append one JSON line per round to this file "
                   "('-': stdout).", show_default=False)] = None,
    live: Annotated[bool, typer.Option("--live", help="Show the rounds in a live table on stderr.")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the final plan (after "
                      "rebalancing) here.", show_default=False)] = None,
    checkpoint_dir: Annotated[Optional[Path], typer.Option("--checkpoint-dir", help="Checkpoint directory; a run "
                              "resumes from its newest checkpoint.", show_default=False)] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Steps between checkpoints "
                                "(0: none).")] = 0,
    allow_device_mismatch: Annotated[bool, typer.Option("--allow-device-mismatch", help="Train with a plan made "
                                     "for other device types than the ranks have (refused by default: its split "
                                     "and predicted step time were made for those devices).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary.")] = False,
) -> None:
    """Train with a plan: one pipeline stage per rank, torch.distributed.pipelining schedules.

    Starts the ranks with torch's elastic launcher (nccl on GPUs, gloo on CPU). The model is captured
    again and must match the plan's profile. Default data is seeded synthetic batches shaped like the
    factory's example inputs; the default loss is next-token cross-entropy for language models and MSE
    otherwise (docs/run.md).

    Examples:

      plan run plan.json planner.examples.gpt:gpt_small --steps 20

      plan run plan.json my_model.py:build --optimizer adam --lr 3e-4 --data my_data:batches

      plan run plan.json planner.examples.gpt:gpt_small --emulate-slowdown 1=2.0 --log rounds.jsonl -o final.json

      plan run hybrid.json planner.examples.digits:digits_mlp --data planner.data.digits:batches --sync adaptive

      plan run dp4.json planner.examples.digits:digits_mlp --data planner.data.digits:batches --sync dasp --emulate-slowdown 3=4

      plan run plan.json planner.examples.gpt:gpt_small --checkpoint-dir ckpt --checkpoint-every 10 --max-restarts 2

      torchrun --nproc-per-node 2 -m planner.run plan.json planner.examples.gpt:gpt_small --steps 20
    """
    from planner.app.run import Launch, run_config, run_plan

    config = run_config(
        plan=str(plan), model=model, steps=steps, round_steps=round_steps, timeout_s=timeout_s,
        max_restarts=max_restarts, microbatch_size=microbatch_size, optimizer=optimizer, lr=lr, seed=seed, data=data,
        profile=str(profile) if profile else None, params_out=str(params_out) if params_out else None,
        allow_device_mismatch=allow_device_mismatch, loss=loss, eval_every=eval_every, eval_batches=eval_batches,
        target=target, stop_at_target=stop_at_target, emulate_link=emulate_link, sync=sync, sync_period=sync_period,
        sync_elastic=sync_elastic, sync_momentum=sync_momentum, sync_chunk_bytes=sync_chunk_bytes,
        sync_overhead=sync_overhead, sync_max_period=sync_max_period, staleness=staleness,
        dasp_slow_factor=dasp_slow_factor, dasp_rejoin_factor=dasp_rejoin_factor, dasp_patience=dasp_patience,
        dasp_async_update=dasp_async_update,
        async_receives=async_receives,
        options=dict(rebalance=rebalance, threshold=threshold, patience=patience, emulate_slowdown=emulate_slowdown,
                     log=log, live=live, output=output, checkpoint_dir=checkpoint_dir,
                     checkpoint_every=checkpoint_every))
    launch = Launch(nproc_per_node=nproc_per_node, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                    max_restarts=max_restarts)
    result = run_plan(config, launch, announce=None if as_json else console.print)
    if result is None:
        return
    if as_json:
        emit_json({k: v for k, v in result.items() if k != "plan"})
        return
    from planner.report import render_run

    render_run(console, result)
