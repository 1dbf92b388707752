"""``plan partition | show | check | diff``: gather options, call one library function, render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from planner.cli.app import command, console, emit_json, err_console, write_stdout

_JSON = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]


@command("partition")
def partition_cmd(
    profile: Annotated[Path, typer.Argument(help="Profile JSON written by `plan profile`.", show_default=False)],
    cluster: Annotated[str, typer.Option("--cluster", "-c", help="Cluster file path, or a bundled cluster name "
                                         "(e.g. dgx-h100-8, a100-2x8-ib, cpu-2).", show_default=False)],
    method: Annotated[str, typer.Option("--method", "-m", help="Placer: dp, ilp, greedy, or a peer "
                                        "baseline: uniform, params, time-balance (see docs/commands.md).")] = "dp",
    microbatches: Annotated[str, typer.Option("--microbatches", "-n", help="Micro-batches per step (>= 1), or auto "
                            "(with --global-batch: the count the simulator finds fastest).")] = "8",
    schedule: Annotated[str, typer.Option("--schedule", "-s", help="gpipe, 1f1b, interleaved-1f1b, a "
                        "zero-bubble schedule (zb-h1, zb-planned, zb-h2, or zbv and dualpipev with two stages per device in a V: each backward split into input and weight gradients, "
                        "docs/zero-bubble.md), auto (the fastest of those that fits), or an asynchronous schedule with no "
                        "flush between steps: async-1f1b or 2bw (docs/async.md; one stage per device, replicas with --sync ssgd).")] = "1f1b",
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Samples per optimizer step, for "
                            "--microbatches auto.", show_default=False)] = None,
    optimizer: Annotated[str, typer.Option("--optimizer", help="sgd or adam (optimizer state in the memory model).")] = "adam",
    refine: Annotated[bool, typer.Option("--refine", help="Re-weight devices from simulated waits and re-plan "
                                         "until stable (the rebalancing loop of docs/methods.md, offline; one round for methods without "
                                         "weights), then polish the cuts against the simulator.")] = False,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Where to write the plan JSON "
                                                   "(atomically; nothing is written on error).")] = None,
    granularity: Annotated[Optional[str], typer.Option("--granularity", "-g", help="Blocks no stage splits: op, "
                           "layer, depth:N or count:N (default op; dp/ilp scale with the block count).",
                           show_default=False)] = None,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", help="ilp: solver time limit in seconds "
                          "(default 60); the plan records whether optimality was proven.", show_default=False)] = None,
    estimate_precision: Annotated[Optional[str], typer.Option("--estimate-precision", help="Precision the roofline "
                                  "estimates of device types the profile did not measure assume: fp32, tf32 or "
                                  "bf16 (recorded in the plan). Default: the profiled dtype.",
                                  show_default=False)] = None,
    data_parallel: Annotated[str, typer.Option("--data-parallel", "-d", help="Replica pipelines: auto (the "
                             "fastest shape the simulator finds, the pure pipeline included), or N (1: a pure "
                             "pipeline; N > 1: N replicas of every stage).")] = "auto",
    sync: Annotated[str, typer.Option("--sync", help="How replicas combine their updates: ssgd (gradients "
                    "averaged every step), local-sgd (parameters averaged every --sync-period steps) or adaptive "
                    "(the interval adapts as the run goes); or through a parameter server rank: bsp, asp, ssp "
                    "(--staleness S) or dasp (DASP: docs/methods.md), on one replica of the whole model per device "
                    "(docs/sync.md). A mode other than ssgd makes --data-parallel auto consider replicated shapes "
                    "only.")] = "ssgd",
    sync_period: Annotated[Optional[int], typer.Option("--sync-period", help="Local steps between aggregations: "
                           "required by local-sgd; for adaptive, the first interval (default: chosen from the "
                           "predicted compute and aggregation times).", show_default=False)] = None,
    staleness: Annotated[Optional[int], typer.Option("--staleness", help="ssp: how many steps the fastest "
                         "worker may be ahead of the slowest. Default: 3.", show_default=False)] = None,
    async_correction: Annotated[str, typer.Option("--async-correction", help="async-1f1b and 2bw: predict (weight "
                                "prediction on top of weight stashing) or none (stashing alone); docs/async.md.")] = "predict",
    async_warmup: Annotated[Optional[int], typer.Option("--async-warmup", help="async-1f1b and 2bw: the first steps "
                            "run synchronously, each drained as under 1F1B, before the steps overlap (0: none; "
                            "docs/async.md). Default: 50.", show_default=False)] = None,
    recompute: Annotated[str, typer.Option("--recompute", help="Activation recomputation: off, on (every stage keeps "
                         "only its inputs and runs its forward again before the backward), or auto (only in the "
                         "stages that need it, when nothing fits without it or when that is faster).")] = "off",
    round_steps: Annotated[Optional[int], typer.Option("--round-steps", help="async-1f1b and 2bw: the steps plan run "
                           "will run per round (its --round-steps), where the pipeline drains; each round then pays "
                           "one fill and drain in the prediction. Default: never drains (the steady state).",
                           show_default=False)] = None,
    as_json: _JSON = False,
) -> None:
    """Split a profiled model into pipeline stages over a cluster and write the plan.

    Prints one row per stage (device, layers, compute, transfer, memory against capacity, idle)
    and the predicted step time and bubble.

    Examples:

      plan partition profile.json --cluster dgx-h100-8 --method dp -n 16 -s 1f1b -o plan.json

      plan partition profile.json -c dgx-h100-8 --data-parallel 2 -o hybrid.json

      plan partition profile.json -c cpu-2 -d 2 --sync local-sgd --sync-period 8 -o local.json

      plan partition profile.json -c cpu-4 --sync dasp -o dasp.json

      plan partition profile.json -c cpu-2 -s async-1f1b -n 4 -o async.json

      plan partition profile.json -c my-cluster.json -m greedy --refine --json -o plan.json
    """
    from planner.app.partition import partition_file
    from planner.report import plan_summary, render_plan

    # A spinner on stderr while the placer works (ilp and --refine can take a while); silent when not a terminal.
    with err_console.status(f"planning with {method} ...", spinner="dots"):
        plan = partition_file(profile, cluster, output, method=method, microbatches=microbatches,
                              schedule=schedule, optimizer=optimizer, refine=refine, granularity=granularity,
                              time_limit_s=time_limit, estimate_precision=estimate_precision,
                              data_parallel=data_parallel, global_batch=global_batch, sync=sync,
                              sync_period=sync_period, staleness=staleness, async_correction=async_correction,
                              recompute=recompute, round_steps=round_steps, async_warmup=async_warmup)
    if as_json:
        emit_json({**plan_summary(plan), "output": None if output is None else str(output)})
        return
    render_plan(console, plan, files={} if output is None else {"plan": output})


@command("show")
def show_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan JSON written by `plan partition`.", show_default=False)],
    timeline: Annotated[Optional[Path], typer.Option("--timeline", help="Timeline PNG "
                        "(default: PLAN-STEM.timeline.png next to the plan).", show_default=False)] = None,
    svg: Annotated[Optional[Path], typer.Option("--svg", help="Timeline SVG "
                   "(default: PLAN-STEM.timeline.svg next to the plan).", show_default=False)] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help="Chrome/Perfetto trace JSON "
                     "(default: PLAN-STEM.trace.json next to the plan).", show_default=False)] = None,
    no_files: Annotated[bool, typer.Option("--no-files", help="Print the table only; write no pictures or trace.")] = False,
    as_json: _JSON = False,
) -> None:
    """Print a plan's stage table, and re-simulate it to draw a per-device timeline and a trace.

    By default writes PLAN-STEM.timeline.png, PLAN-STEM.timeline.svg and PLAN-STEM.trace.json
    next to PLAN (for run/plan.json: run/plan.timeline.png, ...). Open the trace in
    https://ui.perfetto.dev or chrome://tracing.

    Examples:

      plan show plan.json

      plan show plan.json --timeline out/t.png --svg out/t.svg --trace out/t.trace.json
    """
    from planner.app.show import default_report_paths, show_plan
    from planner.report import plan_summary, render_plan

    paths = {} if no_files else default_report_paths(plan)
    for key, given in (("png", timeline), ("svg", svg), ("trace", trace)):
        if given is not None:
            paths[key] = given
    with err_console.status("simulating and drawing ...", spinner="dots"):
        report = show_plan(plan, paths)
    if as_json:
        emit_json({**plan_summary(report.plan), "simulated_step_time_s": report.step_time_s,
                   "files": {k: str(v) for k, v in report.files.items()}})
        return
    render_plan(console, report.plan, title=str(plan), simulated_step_time_s=report.step_time_s, files=report.files)


@command("check")
def check_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan JSON to check.", show_default=False)],
    baseline: Annotated[Optional[Path], typer.Option("--baseline", "-b", help="Plan to compare against "
                        "(step time and peak memory).", show_default=False)] = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Profile to validate against "
                       "(default: the plan's profile.path).", show_default=False)] = None,
    cluster: Annotated[Optional[str], typer.Option("--cluster", "-c", help="Cluster path or bundled name "
                       "(default: the cluster embedded in the plan).", show_default=False)] = None,
    tolerance: Annotated[str, typer.Option("--tolerance", "-t", help="Allowed growth over the baseline: "
                                           "a percentage (2%) or a fraction (0.02).")] = "2%",
    memory_tolerance: Annotated[Optional[str], typer.Option("--memory-tolerance", help="Allowed growth of peak "
                                "memory (default: --tolerance).", show_default=False)] = None,
    as_json: _JSON = False,
) -> None:
    """Validate a plan and compare it with a baseline; for CI.

    Valid means: every profile node in exactly one stage, no empty stage, no edge running
    backwards, every device in the cluster, every device's memory within its capacity.
    Exit codes: 0 valid and no regression; 1 invalid plan or a regression beyond the tolerance
    (or unreadable input); 2 bad usage.

    Examples:

      plan check plan.json

      plan check new.json --baseline golden.json --tolerance 2%
    """
    from planner.app.check import check_files, parse_tolerance
    from planner.report import render_check

    result = check_files(plan, baseline_path=baseline, profile_path=profile, cluster_spec=cluster,
                         tolerance=parse_tolerance(tolerance),
                         memory_tolerance=None if memory_tolerance is None
                         else parse_tolerance(memory_tolerance, "--memory-tolerance"))
    if as_json:
        emit_json(result.to_dict())
    else:
        render_check(console, result)
    if not result.passed:
        raise typer.Exit(1)


@command("diff")
def diff_cmd(
    a: Annotated[Path, typer.Argument(help="First plan (A).", show_default=False)],
    b: Annotated[Path, typer.Argument(help="Second plan (B).", show_default=False)],
    as_json: _JSON = False,
) -> None:
    """Show what changed from plan A to plan B: devices, node counts and moved nodes per stage,
    and the predicted step time and memory.

    Example:

      plan diff plan-greedy.json plan-dp.json
    """
    from planner.app.check import diff_files
    from planner.report import render_diff

    result = diff_files(a, b)
    if as_json:
        emit_json(result.to_dict())
        return
    render_diff(console, result)


@command("export")
def export_cmd(
    plan: Annotated[Path, typer.Argument(help="Plan file (JSON).", show_default=False)],
    to: Annotated[str, typer.Option("--to", help="torchtitan (the [parallelism] TOML table), pipelining "
                  "(split_spec for torch.distributed.pipelining.pipeline) or schedule-csv (each rank's action "
                  "order, as _PipelineScheduleRuntime loads it).", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write the TOML (torchtitan), the "
                      "Python snippet (pipelining) or the CSV (schedule-csv) here.", show_default=False)] = None,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Profile the plan was made from (default: "
                       "the plan's profile.path).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the export as JSON data.")] = False,
) -> None:
    """Export a plan to torchtitan, pipelining or schedule-csv.

    torchtitan and pipelining get module FQNs per stage; plans that cut inside a module (from --granularity op)
    are refused with the cost of cutting at layers. schedule-csv writes each rank's order of passes.

    Example: plan export plan.json --to torchtitan -o parallelism.toml
    """
    from planner.app.export import export_file

    result = export_file(plan, to, output, profile)
    if as_json:
        emit_json({"format": result.format, **result.data, "output": result.output})
    elif result.output is None:
        write_stdout(result.text)  # as written to -o: no wrapping
    else:
        console.print(f"wrote {result.output}", soft_wrap=True)
