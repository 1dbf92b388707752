"""Resolve ``--cluster`` arguments: a path to a cluster file, or the name of a bundled cluster.

Bundled clusters live in ``profiles/clusters/NAME.json`` at the repository root (next to the
``planner`` package in a source checkout or an editable install).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from planner.errors import InputFileError
from planner.formats.cluster import Cluster, cluster_from_dict, load_cluster
from planner.formats.jsonio import to_plain
from planner.formats.plan import Plan

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "profiles" / "clusters"
_SUFFIXES = (".json", ".yaml", ".yml")


def bundled_clusters() -> tuple[str, ...]:
    """Names of the bundled clusters, sorted."""
    if not BUNDLED_DIR.is_dir():
        return ()
    return tuple(sorted(p.stem for p in BUNDLED_DIR.iterdir() if p.suffix in _SUFFIXES and p.is_file()))


def resolve_cluster(spec: str) -> Path:
    """An existing file path wins; otherwise ``spec`` names a bundled cluster (``dgx-h100-8``)."""
    path = Path(spec)
    if path.is_file():
        return path
    if path.suffix not in _SUFFIXES and "/" not in spec and "\\" not in spec:
        for suffix in _SUFFIXES:
            candidate = BUNDLED_DIR / f"{spec}{suffix}"
            if candidate.is_file():
                return candidate
    names = ", ".join(bundled_clusters()) or "none found"
    raise InputFileError(f"cluster {spec!r} is neither an existing file nor a bundled cluster name "
                         f"(bundled: {names}); pass a cluster file path or one of those names")


def load_cluster_spec(spec: str) -> Cluster:
    """Resolve and load a cluster given as a path or a bundled name."""
    return load_cluster(resolve_cluster(spec))


def embedded_cluster(plan: Plan, what: str = "plan") -> Cluster:
    """The cluster a plan was made for, embedded in it under ``cluster``."""
    raw = plan.extra.get("cluster")
    if not isinstance(raw, Mapping):
        raise InputFileError(f"{what} embeds no cluster (field 'cluster' is missing); pass --cluster PATH_OR_NAME")
    return cluster_from_dict(to_plain(raw), f"cluster embedded in {what}")

