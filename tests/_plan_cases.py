"""Plans built from hand-made profiles and clusters, written to files for the check, report and CLI tests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from _partition_cases import chain, cluster

from planner.formats.cluster import Cluster, save_cluster
from planner.formats.plan import Plan, save_plan
from planner.formats.profile import Profile, save_profile
from planner.partition.model.convert import build_plan
from planner.partition.model.problem import StageSpec, build_problem
from planner.app.partition import profile_ref

MEMORY_BYTES = 10**6


@dataclass(frozen=True)
class Case:
    """A profile, a cluster and a plan on disk (plus the loaded objects)."""

    profile_path: Path
    cluster_path: Path
    plan_path: Path
    profile: Profile
    cluster: Cluster
    plan: Plan


def toy_profile(n: int = 6) -> Profile:
    """An input and ``n`` chained ops (``op0`` .. ``op{n-1}``), 1 ms forward and 2 ms backward each."""
    return chain(n, fwd=1e-3, bwd=2e-3, out=1000, params=100, saved=50)


def toy_cluster(n: int = 3, memory_bytes: int = MEMORY_BYTES) -> Cluster:
    return cluster(n, bandwidth_Bps=1e6, latency_s=1e-5, memory_bytes=memory_bytes)


def make_plan(profile: Profile, cl: Cluster, cuts: Sequence[int], *, schedule: str = "1f1b", microbatches: int = 4,
              profile_path: Path | None = None, method: str = "hand") -> Plan:
    """Stages of nodes ``[cuts[i], cuts[i+1])`` on devices ``d0, d1, ...`` (op granularity)."""
    problem = build_problem(profile, cl, microbatches=microbatches, schedule=schedule, optimizer="adam")
    bounds = [0, *cuts, len(profile.nodes)]
    partition = tuple(StageSpec(bounds[i], bounds[i + 1], cl.devices[i].id) for i in range(len(bounds) - 1))
    ref = profile_ref(profile_path, profile.model.get("name")) if profile_path is not None else None
    return build_plan(problem, partition, method=method, profile_ref=ref)


def write_case(tmp: Path, cuts: Sequence[int] = (3, 5), *, name: str = "plan", **kwargs: Any) -> Case:
    """Write ``profile.json``, ``cluster.json`` and ``NAME.json`` (a plan of the toy model) into ``tmp``."""
    profile, cl = toy_profile(), toy_cluster()
    profile_path, cluster_path, plan_path = tmp / "profile.json", tmp / "cluster.json", tmp / f"{name}.json"
    save_profile(profile, profile_path)
    save_cluster(cl, cluster_path)
    plan = make_plan(profile, cl, cuts, profile_path=profile_path, **kwargs)
    save_plan(plan, plan_path)
    return Case(profile_path, cluster_path, plan_path, profile, cl, plan)


def edit_plan(src: Path, dst: Path, edit: Any) -> Path:
    """Copy plan ``src`` to ``dst`` after ``edit(doc)`` changes its JSON document in place."""
    doc = json.loads(src.read_text())
    edit(doc)
    dst.write_text(json.dumps(doc))
    return dst
