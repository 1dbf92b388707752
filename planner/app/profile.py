"""``plan profile``: check the request (before torch is imported), profile the model and/or probe the links,
write the files, and return what the CLI renders."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from planner.errors import UsageError
from planner.formats.catalog import device_spec, load_catalog
from planner.formats.jsonio import check_writable
from planner.roofline import check_precision

__all__ = ["ProfileRequest", "ProfileResult", "check_request", "profile_command"]

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class ProfileRequest:
    """``plan profile``'s options (see its ``--help``)."""

    model: str | None
    output: Path | None = None
    input_spec: str | None = None
    microbatch_size: int | None = None
    tracer: str = "auto"
    repeats: int = 5
    warmup: int = 2
    threads: int = 1
    estimate: tuple[str, ...] = ()
    estimate_precision: str | None = None
    probe_links: bool = False
    cluster_out: Path | None = None
    top: int = 10
    model_output: str | None = None
    colocate: int = 1


@dataclass(frozen=True)
class ProfileResult:
    profile: dict[str, Any] | None
    """The profile's summary (``report.profile_summary.profile_summary``) and its ``output`` path."""
    cluster: dict[str, Any] | None
    """The probed cluster: ``output``, ``devices`` and ``pairs`` (rank 0 only)."""
    rank: int


def check_request(request: ProfileRequest) -> tuple[Path | None, Path | None]:
    """Refuse bad options as usage errors and return (profile path, cluster path); imports no torch."""
    check_precision(request.estimate_precision)
    catalog = load_catalog()
    for dev in request.estimate:
        device_spec(dev, catalog)
    for name, value, low in (("--repeats", request.repeats, 1), ("--warmup", request.warmup, 0),
                             ("--threads", request.threads, 0), ("--top", request.top, 0),
                             ("--microbatch-size", request.microbatch_size, 1), ("--colocate", request.colocate, 1)):
        if value is not None and value < low:
            raise UsageError(f"{name} must be an integer >= {low}, found {value}")
    if request.model is None and not request.probe_links:
        raise UsageError("missing MODEL; pass 'package.module:factory' or 'path/to/file.py:factory' "
                         "(or --probe-links under torchrun)")
    if request.model is None:
        return None, request.output or request.cluster_out or Path("cluster.json")
    if request.probe_links and request.cluster_out is None:
        raise UsageError("with a MODEL, --probe-links needs --cluster-out PATH for the cluster file (-o is the profile)")
    return request.output or Path("profile.json"), request.cluster_out if request.probe_links else None


def profile_command(request: ProfileRequest, progress: Progress | None = None) -> ProfileResult:
    """Probe the links (every rank, under torchrun) and profile the model (rank 0); write both files."""
    profile_path, cluster_path = check_request(request)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        for path, what in ((profile_path, "profile"), (cluster_path, "cluster")):
            if path is not None:
                check_writable(path, what)
    cluster = _probe(cluster_path, rank) if request.probe_links else None
    profile = None
    if request.model is not None and rank == 0:
        assert profile_path is not None
        profile = _profile(request, profile_path, progress)
    return ProfileResult(profile=profile, cluster=cluster, rank=rank)


def _profile(request: ProfileRequest, path: Path, progress: Progress | None) -> dict[str, Any]:
    from planner.formats.profile import save_profile
    from planner.profile import profile_model
    from planner.report.profile_summary import profile_summary

    assert request.model is not None
    profile = profile_model(request.model, input_spec=request.input_spec, microbatch_size=request.microbatch_size,
                            tracer=request.tracer, repeats=request.repeats, warmup=request.warmup,
                            estimate=request.estimate, progress=progress, threads=request.threads or None,
                            estimate_precision=request.estimate_precision, model_output=request.model_output,
                            colocate=request.colocate)
    save_profile(profile, path)
    return {**profile_summary(profile, request.top), "output": str(path)}


def _probe(path: Path | None, rank: int) -> dict[str, Any] | None:
    from planner.formats.cluster import save_cluster
    from planner.runtime.links import probe_links

    cluster = probe_links()
    if rank != 0 or path is None:
        return None
    save_cluster(cluster, path)
    return {"output": str(path), "devices": len(cluster.devices),
            "pairs": [{"a": a, "b": b, "bandwidth_Bps": link.bandwidth_Bps, "latency_s": link.latency_s}
                      for (a, b), link in sorted(cluster.pairs.items())]}
