"""``plan train``: gather options, call ``planner.app.train.train_command``, render the strategy and the summary.

Under ``torchrun`` every process is one rank; ``python -m planner.train`` is the same command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from planner.cli.app import command, console, emit_json


@command("train")
def train_cmd(
    model: Annotated[str, typer.Argument(help="The model's factory: 'package.module:factory' or "
                     "'path/to/file.py:factory'.", show_default=False)],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster file path, or a bundled cluster name "
                                         "(cpu-2, dgx-h100-8, ...).", show_default=False)],
    output_dir: Annotated[Path, typer.Option("--output-dir", "-o", help="Directory for the profile, plan, "
                          "timeline, trace, round log, curves and summary.json.")] = Path("out"),
    data: Annotated[Optional[str], typer.Option("--data", help="'pkg.mod:factory' of training and held-out batches "
                    "(bundled: planner.data.digits:batches, planner.data.text:batches; default: synthetic).",
                    show_default=False)] = None,
    steps: Annotated[Optional[int], typer.Option("--steps", help="Training steps (default 40; with --target, the "
                     "most steps: 1000).", show_default=False)] = None,
    target: Annotated[Optional[str], typer.Option("--target", help="accuracy=A or loss=L: stop at the first "
                      "evaluation that reaches it and report the time to it.", show_default=False)] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Samples per optimizer step "
                            "(default: 8 of the model's example batches); split into the micro-batch count the "
                            "search finds fastest.", show_default=False)] = None,
    microbatches: Annotated[str, typer.Option("--microbatches", "-n", help="Micro-batches per step, or auto.")] = "auto",
    schedule: Annotated[str, typer.Option("--schedule", "-s", help="auto, or fix one: gpipe, 1f1b, "
                        "interleaved-1f1b, zb-h1, zb-planned, zb-h2, zbv, dualpipev, async-1f1b, 2bw.")] = "auto",
    data_parallel: Annotated[str, typer.Option("--data-parallel", "-d", help="Replicas: auto, or a degree.")] = "auto",
    sync: Annotated[str, typer.Option("--sync", help="How replicas combine: auto (the rule of docs/train.md), or "
                    "ssgd, local-sgd, adaptive, bsp, asp, ssp, dasp.")] = "auto",
    sync_period: Annotated[Optional[int], typer.Option("--sync-period", help="local-sgd / adaptive: local steps "
                           "between aggregations.", show_default=False)] = None,
    method: Annotated[str, typer.Option("--method", "-m", help="Placer (greedy, dp, ilp, ...).")] = "greedy",
    recompute: Annotated[str, typer.Option("--recompute", help="Activation recomputation: auto (only in the stages "
                         "that need it, when nothing fits without it or when that is faster), on (every stage) or "
                         "off.")] = "auto",
    async_warmup: Annotated[Optional[int], typer.Option("--async-warmup", help="When an asynchronous schedule "
                            "(async-1f1b, 2bw) is chosen: the first steps it runs synchronously (0: none; "
                            "docs/async.md). Default: 50.", show_default=False)] = None,
    optimizer: Annotated[Optional[str], typer.Option("--optimizer", help="sgd or adam (default: adam, as "
                         "planned).", show_default=False)] = None,
    lr: Annotated[Optional[float], typer.Option("--lr", help="Learning rate (default 0.01 sgd, 1e-3 adam).",
                  show_default=False)] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seeds the model and the data.")] = 0,
    round_steps: Annotated[int, typer.Option("--round-steps", help="Steps per round (rebalancing, evaluation "
                           "and progress happen between rounds).")] = 5,
    eval_every: Annotated[Optional[int], typer.Option("--eval-every", help="Evaluate every K steps (default: every "
                          "round with --data or --target; 0: never).", show_default=False)] = None,
    eval_batches: Annotated[int, typer.Option("--eval-batches", help="Held-out batches per evaluation.")] = 4,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Profile and plan, print the strategy table, write the "
                       "plan and its timeline; do not train.")] = False,
    reprofile: Annotated[bool, typer.Option("--reprofile", help="Measure the model again instead of using the "
                         "cached profile.")] = False,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="Profile cache (default: "
                         "$PLANNER_CACHE_DIR, else ~/.cache/planner).", show_default=False)] = None,
    input_spec: Annotated[Optional[str], typer.Option("--input", help="Example inputs when the factory gives none, "
                          "e.g. 'int64[8,128]'.", show_default=False)] = None,
    tracer: Annotated[str, typer.Option("--tracer", help="auto, export or fx.")] = "auto",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repetitions per op when profiling.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed repetitions per op before timing.")] = 2,
    emulate_link: Annotated[Optional[str], typer.Option("--emulate-link", help="BANDWIDTH[,LATENCY]: slow every "
                            "transfer between ranks (testing aid).", show_default=False)] = None,
    emulate_slowdown: Annotated[Optional[list[str]], typer.Option("--emulate-slowdown", help="RANK=FACTOR: that "
                                "rank waits (FACTOR-1)x its compute after each pass (testing aid; repeatable).",
                                show_default=False)] = None,
    rebalance: Annotated[bool, typer.Option("--rebalance/--no-rebalance", help="Rebalance between rounds from "
                         "measured waits.")] = True,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Seconds a transfer may wait before the run "
                         "fails.")] = 120.0,
    show: Annotated[int, typer.Option("--show", help="Candidates listed beside the chosen one.")] = 6,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary (strategy, candidates, run, artefacts) "
                       "as JSON.")] = False,
) -> None:
    """Profile the model (cached), choose the whole strategy, train with it, and summarise -- in one command.

    Chooses the shape (stages x replicas and shares), the schedule, the micro-batch count under --global-batch
    and the sync mode, prints the chosen strategy beside the next best candidates, then trains with
    rebalancing and evaluation. Everything lands in -o DIR (docs/train.md).

    Examples:

      plan train planner.examples.gpt:gpt_small --cluster cpu-2

      plan train planner.examples.digits:digits_cnn --cluster cpu-2 --data planner.data.digits:batches --target accuracy=0.95

      plan train planner.examples.gpt:gpt_tiny --cluster dgx-h100-8 --dry-run

      torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:29500 -m planner.train MODEL --cluster cluster.json
    """
    from planner.app.train import TrainRequest, train_command
    from planner.report.render import render_strategy, render_train

    request = TrainRequest(
        model=model, cluster=cluster, output_dir=output_dir, data=data, steps=steps, target=target,
        global_batch=global_batch, microbatches=microbatches, schedule=schedule, data_parallel=data_parallel,
        sync=sync, sync_period=sync_period, method=method, recompute=recompute, async_warmup=async_warmup,
        optimizer=optimizer, lr=lr, seed=seed,
        round_steps=round_steps, eval_every=eval_every, eval_batches=eval_batches, dry_run=dry_run,
        reprofile=reprofile, cache_dir=cache_dir, input_spec=input_spec, tracer=tracer, repeats=repeats, warmup=warmup,
        emulate_link=emulate_link, emulate_slowdown=tuple(emulate_slowdown or ()), rebalance=rebalance,
        timeout_s=timeout_s, show=show)
    quiet = as_json
    summary = train_command(request, announce=None if quiet else console.print,
                            show_strategy=None if quiet else lambda s: render_strategy(console, s.to_dict(), show))
    if "strategy" not in summary:  # a rank other than 0 under torchrun
        return
    if as_json:
        emit_json(summary)
        return
    render_train(console, summary)
