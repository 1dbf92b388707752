"""``plan profile``: gather options, call ``planner.app.profile.profile_command``, render the summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from planner.cli.app import command, console, emit_json, err_console


@command("profile")
def profile_cmd(
    model: Annotated[Optional[str], typer.Argument(help="Model factory: 'package.module:factory' or "
                     "'path/to/file.py:factory' returning an nn.Module or (module, example_inputs).",
                     show_default=False)] = None,
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Profile JSON to write, atomically "
                      "(default profile.json); with --probe-links and no MODEL, the cluster JSON "
                      "(default cluster.json).", show_default=False)] = None,
    input_spec: Annotated[Optional[str], typer.Option("--input", help="Input shapes and dtypes when the factory "
                          "returns only a module, e.g. 'int64[8,128]' or 'float32[4,3,64,64],int64[4]'; "
                          "'int64[8,128]<50257' bounds integer values.", show_default=False)] = None,
    microbatch_size: Annotated[Optional[int], typer.Option("--microbatch-size", help="Rescale dimension 0 of the "
                               "inputs to this many samples.", show_default=False)] = None,
    model_output: Annotated[Optional[str], typer.Option("--model-output", help="When forward returns a dict, tuple "
                            "or list: the output to train on, a KEY or an INDEX (e.g. logits, 0). Recorded in the "
                            "profile; plan run trains on the same one.", show_default=False)] = None,
    colocate: Annotated[int, typer.Option("--colocate", help="Also time a training micro-batch while N-1 other "
                        "processes train the same model, as the ranks sharing this host will; the cost model applies "
                        "the slowdown on hosts with N or more devices of this type (1: off).")] = 1,
    tracer: Annotated[str, typer.Option("--tracer", help="auto (torch.export, then torch.fx), export or fx.")] = "auto",
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats per op (the median is kept).")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed calls before the repeats.")] = 2,
    threads: Annotated[int, typer.Option("--threads", help="CPU intra-op threads while timing (0 = leave as is).")] = 1,
    estimate: Annotated[str, typer.Option("--estimate", help="Comma-separated catalog device types to add roofline "
                        "estimates for, e.g. h100-sxm,a100-80g (see profiles/devices.json).")] = "",
    estimate_precision: Annotated[Optional[str], typer.Option("--estimate-precision", help="Precision the "
                                  "--estimate times assume: fp32, tf32 or bf16 (mixed precision: matmuls on "
                                  "half-precision tensor cores, half the bytes). Default: the profiled dtype.",
                                  show_default=False)] = None,
    probe_links: Annotated[bool, typer.Option("--probe-links", help="Under torchrun (>= 2 ranks): time transfers "
                           "between every pair of ranks and the pipeline runtime's own cost per pass, and write a "
                           "cluster file.")] = False,
    cluster_out: Annotated[Optional[Path], typer.Option("--cluster-out", help="Cluster JSON to write when probing "
                           "links together with a MODEL.", show_default=False)] = None,
    top: Annotated[int, typer.Option("--top", help="Ops listed in the summary.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print a machine-readable summary; no progress bar.")] = False,
) -> None:
    """Capture a model's op graph, measure every op forward and backward, and write a profile.

    Times are per micro-batch on the local device (marked "measured"); --estimate adds roofline
    estimates for other device types (marked "estimated"). Under torchrun, --probe-links times the
    links between ranks and the pipeline runtime's cost per pass, and writes a cluster file (rank 0
    writes; rank 0 also profiles MODEL).

    Examples:

      plan profile planner.examples.gpt:gpt_small -o profile.json --estimate h100-sxm,a100-80g

      plan profile planner.examples.gpt:gpt_small -o profile.json --estimate a100-80g,v100-32g --estimate-precision bf16

      plan profile my_model.py:build --input 'float32[8,3,224,224]' --microbatch-size 4 -o profile.json

      torchrun --nproc-per-node 2 --no-python plan profile --probe-links -o cluster.json
    """
    from planner.app.profile import ProfileRequest, check_request, profile_command

    request = ProfileRequest(model=model, output=output, input_spec=input_spec, microbatch_size=microbatch_size,
                             tracer=tracer, repeats=repeats, warmup=warmup, threads=threads,
                             estimate=tuple(dict.fromkeys(t.strip() for t in estimate.split(",") if t.strip())),
                             estimate_precision=estimate_precision, probe_links=probe_links,
                             cluster_out=cluster_out, top=top, model_output=model_output,
                             colocate=colocate)
    check_request(request)  # usage errors before torch is imported
    with _progress(not as_json and model is not None) as progress:
        result = profile_command(request, progress)
    if result.rank != 0:
        return
    if as_json:
        emit_json({k: v for k, v in (("cluster", result.cluster), ("profile", result.profile)) if v is not None})
        return
    from planner.report.profile_summary import render_summary
    from planner.report.render import render_links

    if result.cluster is not None:
        render_links(console, result.cluster)
    if result.profile is not None:
        render_summary(result.profile, console)
        console.print(f"wrote {result.profile['output']}", soft_wrap=True)


class _progress:
    """A rich progress bar on stderr fed by ``profile_model``'s progress callback (off when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> Optional[Callable[[int, int, str], None]]:
        if not self.enabled:
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("measuring"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), console=err_console, transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task("", total=None)

        def update(done: int, total: int, what: str) -> None:
            self.bar.update(self.task, completed=done, total=total, description=what)

        return update

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
