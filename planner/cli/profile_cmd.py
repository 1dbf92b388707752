"""``plan profile``: gather options, call ``profile_model`` / ``probe_links``, render the summary."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from planner.cli.app import command, console, emit_json, err_console
from planner.errors import UsageError


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
    from planner.formats.jsonio import check_writable
    from planner.formats.catalog import device_spec, load_catalog

    from planner.roofline import check_precision

    check_precision(estimate_precision)
    types = tuple(t.strip() for t in estimate.split(",") if t.strip())
    for dev in types:
        device_spec(dev, load_catalog())
    _check_counts(repeats, warmup, threads, top, microbatch_size)
    if model is None and not probe_links:
        raise UsageError("missing MODEL; pass 'package.module:factory' or 'path/to/file.py:factory' (or --probe-links under torchrun)")
    rank = int(os.environ.get("RANK", "0"))
    profile_path = cluster_path = None
    if model is not None:
        profile_path = output or Path("profile.json")
        cluster_path = cluster_out if probe_links else None
        if probe_links and cluster_out is None:
            raise UsageError("with a MODEL, --probe-links needs --cluster-out PATH for the cluster file (-o is the profile)")
    else:
        cluster_path = output or cluster_out or Path("cluster.json")
    if rank == 0:
        for path, what in ((profile_path, "profile"), (cluster_path, "cluster")):
            if path is not None:
                check_writable(path, what)
    result: dict[str, Any] = {}
    if probe_links:
        result["cluster"] = _probe(cluster_path, rank, as_json)
    if model is not None and rank == 0:
        result["profile"] = _profile(model, profile_path, input_spec, microbatch_size, tracer, repeats, warmup,
                                     threads, types, top, as_json, estimate_precision)
    if as_json and rank == 0:
        emit_json(result)


def _check_counts(repeats: int, warmup: int, threads: int, top: int, microbatch_size: Optional[int]) -> None:
    for name, value, low in (("--repeats", repeats, 1), ("--warmup", warmup, 0), ("--threads", threads, 0),
                             ("--top", top, 0), ("--microbatch-size", microbatch_size, 1)):
        if value is not None and value < low:
            raise UsageError(f"{name} must be an integer >= {low}, found {value}")


def _profile(model: str, path: Path, input_spec: Optional[str], microbatch_size: Optional[int], tracer: str,
             repeats: int, warmup: int, threads: int, types: tuple[str, ...], top: int, as_json: bool,
             estimate_precision: Optional[str] = None) -> dict[str, Any]:
    from planner.formats.profile import save_profile
    from planner.profile import profile_model
    from planner.report.profile_summary import profile_summary, render_summary

    with _progress(not as_json) as progress:
        profile = profile_model(model, input_spec=input_spec, microbatch_size=microbatch_size, tracer=tracer,
                                repeats=repeats, warmup=warmup, estimate=types, progress=progress,
                                threads=threads or None, estimate_precision=estimate_precision)
    save_profile(profile, path)
    summary = profile_summary(profile, top)
    if not as_json:
        render_summary(summary, console)
        console.print(f"wrote {path}")
    return {**summary, "output": str(path)}


def _probe(path: Path, rank: int, as_json: bool) -> dict[str, Any]:
    from planner.formats.cluster import save_cluster
    from planner.runtime.links import probe_links

    cluster = probe_links()
    if rank == 0:
        save_cluster(cluster, path)
        if not as_json:
            for (a, b), link in sorted(cluster.pairs.items()):
                console.print(f"{a} <-> {b}: {link.bandwidth_Bps / 1e9:.2f} GB/s, latency {link.latency_s * 1e6:.1f} us")
            console.print(f"wrote {path}")
    return {"output": str(path), "devices": len(cluster.devices),
            "pairs": [{"a": a, "b": b, "bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s}
                      for (a, b), link in sorted(cluster.pairs.items())]}


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
