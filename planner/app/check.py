"""``plan check`` and ``plan diff``: is a plan valid, did it regress against a baseline, what changed.

Validation (every node exactly once, no empty stage, no edge running backwards, devices known,
memory fits) is ``planner.partition.validate.validate_plan``; this module adds the comparison with
a baseline plan (step time and peak memory, each allowed to grow by a relative tolerance) and the
stage-by-stage difference of two plans. Pure functions over loaded plans; ``check_files`` is the
one entry point that reads files.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from planner.clusters import embedded_cluster, load_cluster_spec
from planner.errors import InputFileError, UsageError
from planner.formats.catalog import load_catalog
from planner.formats.cluster import Cluster
from planner.formats.plan import Plan, load_plan
from planner.formats.profile import Profile, load_profile

DEFAULT_TOLERANCE = 0.02


@dataclass(frozen=True)
class Metric:
    """One compared figure: ``regressed`` when ``current > baseline * (1 + tolerance)``."""

    name: str
    unit: str
    baseline: float
    current: float
    tolerance: float

    @property
    def change(self) -> float:
        """Relative change, ``current / baseline - 1`` (0 when both are 0)."""
        if self.baseline == 0:
            return 0.0 if self.current == 0 else float("inf")
        return self.current / self.baseline - 1.0

    @property
    def regressed(self) -> bool:
        return self.current > self.baseline * (1.0 + self.tolerance) + 1e-15

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "unit": self.unit, "baseline": self.baseline, "current": self.current,
                "change": self.change if self.change != float("inf") else None,  # JSON has no infinity
                "tolerance": self.tolerance, "regressed": self.regressed}


@dataclass(frozen=True)
class CheckResult:
    """The verdict of ``plan check``: problems make a plan invalid, regressed metrics make it fail."""

    plan: str
    problems: tuple[str, ...]
    metrics: tuple[Metric, ...] = ()
    baseline: str | None = None
    notes: tuple[str, ...] = ()
    """Facts worth a look that do not fail the check (e.g. the profile changed since planning)."""

    @property
    def regressions(self) -> tuple[Metric, ...]:
        return tuple(m for m in self.metrics if m.regressed)

    @property
    def passed(self) -> bool:
        return not self.problems and not self.regressions

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "baseline": self.baseline, "passed": self.passed, "valid": not self.problems,
                "problems": list(self.problems), "metrics": [m.to_dict() for m in self.metrics],
                "regressions": [m.name for m in self.regressions], "notes": list(self.notes)}


def parse_tolerance(text: str, option: str = "--tolerance") -> float:
    """``"2%"`` or ``"0.02"`` -> 0.02. A bare number above 1 is ambiguous and refused (``option`` names it)."""
    raw = text.strip()
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1] if percent else raw)
    except ValueError:
        raise UsageError(f"{option} must be a percentage such as 2% or a fraction such as 0.02, found {text!r}") from None
    if percent:
        value /= 100.0
    elif value > 1:
        raise UsageError(f"{option} {text!r} is ambiguous; write {raw}% for a percentage or a fraction at most 1 such as 0.02")
    if not value >= 0 or value == float("inf"):
        raise UsageError(f"{option} must be a non-negative finite value such as 2% or 0.02, found {text!r}")
    return value


def compare(plan: Plan, baseline: Plan, tolerance: float, memory_tolerance: float | None = None) -> tuple[Metric, ...]:
    """Step time and peak memory of ``plan`` against ``baseline`` (both as the plans predict them).

    Peak memory is allowed ``memory_tolerance`` growth (default: ``tolerance``).
    """
    metrics = [Metric("step_time_s", "s", baseline.step_time_s, plan.step_time_s, tolerance)]
    memory_tolerance = tolerance if memory_tolerance is None else memory_tolerance
    base_mem, mem = baseline.peak_memory_bytes, plan.peak_memory_bytes
    if base_mem is not None and mem is not None:
        metrics.append(Metric("peak_memory_bytes", "B", float(base_mem), float(mem), memory_tolerance))
    return tuple(metrics)


def check_plan(plan: Plan, profile: Profile, cluster: Cluster, *, name: str = "plan",
               baseline: Plan | None = None, baseline_name: str | None = None,
               tolerance: float = DEFAULT_TOLERANCE, memory_tolerance: float | None = None) -> CheckResult:
    """Validate ``plan`` against ``profile`` and ``cluster``; compare with ``baseline`` when given."""
    from planner.partition.validate import validate_plan

    problems = tuple(validate_plan(plan, profile, cluster, load_catalog()))
    metrics = compare(plan, baseline, tolerance, memory_tolerance) if baseline is not None else ()
    notes = [] if baseline is None else _baseline_notes(plan, baseline)
    return CheckResult(plan=name, problems=problems, metrics=metrics, baseline=baseline_name, notes=tuple(notes))


def _baseline_notes(plan: Plan, baseline: Plan) -> list[str]:
    """Differences from the baseline that do not fail the check but tell a reviewer what changed."""
    diff = diff_plans(baseline, plan)
    label = {"stages": "stage count"}
    notes = [f"{label.get(key, key)} differs from the baseline: {old} -> {new}" for key, (old, new) in diff.settings.items()]
    devices = [s.index for s in diff.stages if s.device_a != s.device_b]
    if diff.moved_nodes or diff.only_in_a or diff.only_in_b or devices:
        notes.append(f"placement differs from the baseline: {diff.moved_nodes} node(s) moved stage"
                     + (f", stage(s) {', '.join(map(str, devices))} on other devices" if devices else "")
                     + "; see `plan diff BASELINE PLAN`")
    speeds, base_speeds = speed_factors_of(plan), speed_factors_of(baseline)
    if speeds != base_speeds:
        notes.append(f"the plans assume different device speeds (baseline: {_speeds(base_speeds)}; plan: "
                     f"{_speeds(speeds)}), so their predicted step times are not comparable: a plan made by "
                     f"`plan run`'s rebalancer carries the speeds it measured; compare plans made with the same speeds")
    return notes


def speed_factors_of(plan: Plan) -> dict[str, float]:
    """The measured speed factors a plan was made with (device id -> multiplier on compute; none = as profiled)."""
    raw = plan.extra.get("speed_factors") or {}
    return {str(d): float(f) for d, f in sorted(raw.items()) if abs(float(f) - 1.0) > 1e-9} if isinstance(raw, Mapping) else {}


def _speeds(factors: Mapping[str, float]) -> str:
    return ", ".join(f"{d} x{f:.2f}" for d, f in factors.items()) or "as profiled"


def check_files(plan_path: str | Path, *, baseline_path: str | Path | None = None,
                profile_path: str | Path | None = None, cluster_spec: str | None = None,
                tolerance: float = DEFAULT_TOLERANCE, memory_tolerance: float | None = None) -> CheckResult:
    """Load the plan, its profile (``profile.path`` in the plan unless given), its cluster (embedded
    unless given: a path or a bundled name) and the baseline, then ``check_plan``."""
    plan = load_plan(plan_path)
    profile_file = Path(profile_path) if profile_path is not None else profile_path_of(plan, Path(plan_path))
    profile = load_profile(profile_file)
    cluster = load_cluster_spec(cluster_spec) if cluster_spec is not None else embedded_cluster(plan, str(plan_path))
    baseline = load_plan(baseline_path) if baseline_path is not None else None
    result = check_plan(plan, profile, cluster, name=str(plan_path), baseline=baseline,
                        baseline_name=None if baseline_path is None else str(baseline_path), tolerance=tolerance,
                        memory_tolerance=memory_tolerance)
    note = _profile_digest_note(plan, profile_file)
    return result if note is None else CheckResult(result.plan, result.problems, result.metrics, result.baseline,
                                                   result.notes + (note,))


def profile_path_of(plan: Plan, plan_path: Path) -> Path:
    """``profile.path`` recorded in the plan: as written (relative to the working directory), else
    relative to the plan's own directory."""
    ref = plan.extra.get("profile")
    raw = ref.get("path") if isinstance(ref, Mapping) else None
    if not isinstance(raw, str) or not raw:
        raise InputFileError(f"plan {str(plan_path)!r} does not record its profile's path (field 'profile.path'); "
                             f"pass --profile PATH")
    path = Path(raw)
    if path.is_absolute() or path.exists():
        return path
    beside = plan_path.parent / path
    if beside.exists():
        return beside
    raise InputFileError(f"profile {raw!r} recorded in plan {str(plan_path)!r} does not exist (looked in the working "
                         f"directory and next to the plan); pass --profile PATH")


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _profile_digest_note(plan: Plan, profile_file: Path) -> str | None:
    ref = plan.extra.get("profile")
    recorded = ref.get("sha256") if isinstance(ref, Mapping) else None
    if not isinstance(recorded, str) or file_sha256(profile_file) == recorded:
        return None
    return (f"profile {str(profile_file)!r} changed since the plan was made (sha256 differs); "
            f"its times may no longer match the plan's prediction")


@dataclass(frozen=True)
class StageDiff:
    """One stage index compared across plans A and B (``None`` where a plan has no such stage)."""

    index: int
    device_a: str | None
    device_b: str | None
    nodes_a: int
    nodes_b: int
    compute_s_a: float | None
    compute_s_b: float | None
    memory_bytes_a: int | None
    memory_bytes_b: int | None
    moved_in: tuple[str, ...]
    """Nodes in this stage in B that were in another stage (or absent) in A."""
    moved_out: tuple[str, ...]
    """Nodes in this stage in A that are in another stage (or absent) in B."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class PlanDiff:
    """``plan diff A B``: settings, stage-by-stage changes and the predicted totals of both."""

    a: str
    b: str
    settings: Mapping[str, tuple[Any, Any]]
    """Settings that differ (method, schedule, micro-batches and their size, stage count, data-parallel degree,
    replica shares, sync): name -> (A, B). Stages compare their holders: the device, or every replica's."""
    stages: tuple[StageDiff, ...]
    moved_nodes: int
    only_in_a: tuple[str, ...]
    only_in_b: tuple[str, ...]
    step_time_s: tuple[float, float]
    peak_memory_bytes: tuple[int | None, int | None]
    bubble_fraction: tuple[float | None, float | None]

    @property
    def identical(self) -> bool:
        return (not self.settings and self.moved_nodes == 0 and not self.only_in_a and not self.only_in_b
                and all(s.device_a == s.device_b for s in self.stages))

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "identical": self.identical,
                "settings": {k: list(v) for k, v in self.settings.items()},
                "stages": [s.to_dict() for s in self.stages], "moved_nodes": self.moved_nodes,
                "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b),
                "step_time_s": list(self.step_time_s), "peak_memory_bytes": list(self.peak_memory_bytes),
                "bubble_fraction": list(self.bubble_fraction)}


def diff_plans(a: Plan, b: Plan, name_a: str = "A", name_b: str = "B") -> PlanDiff:
    """Compare two plans stage by stage (by stage index) and node by node (by stage membership)."""
    stage_a, stage_b = a.assignment(), b.assignment()
    moved = sorted(n for n in stage_a.keys() & stage_b.keys() if stage_a[n] != stage_b[n])
    stages = []
    for i in range(max(len(a.stages), len(b.stages))):
        sa = a.stages[i] if i < len(a.stages) else None
        sb = b.stages[i] if i < len(b.stages) else None
        nodes_a, nodes_b = set(sa.nodes if sa else ()), set(sb.nodes if sb else ())
        stages.append(StageDiff(
            index=i, device_a=_holder(a, i), device_b=_holder(b, i),
            nodes_a=len(nodes_a), nodes_b=len(nodes_b),
            compute_s_a=_num(sa, "compute_s"), compute_s_b=_num(sb, "compute_s"),
            memory_bytes_a=_int(sa, "memory_bytes"), memory_bytes_b=_int(sb, "memory_bytes"),
            moved_in=_in_order(sb, nodes_b - nodes_a), moved_out=_in_order(sa, nodes_a - nodes_b),
        ))
    settings = {}
    for key, va, vb in (("method", a.method, b.method), ("schedule", a.schedule, b.schedule),
                        ("microbatches", a.microbatches, b.microbatches), ("stages", len(a.stages), len(b.stages)),
                        ("microbatch_size", a.extra.get("microbatch_size"), b.extra.get("microbatch_size")),
                        ("data-parallel degree", a.shape().degree, b.shape().degree),
                        ("replica shares", list(a.replica_shares()), list(b.replica_shares())),
                        ("sync", _sync(a), _sync(b))):
        if va != vb:
            settings[key] = (va, vb)
    return PlanDiff(
        a=name_a, b=name_b, settings=settings, stages=tuple(stages), moved_nodes=len(moved),
        only_in_a=tuple(sorted(stage_a.keys() - stage_b.keys())), only_in_b=tuple(sorted(stage_b.keys() - stage_a.keys())),
        step_time_s=(a.step_time_s, b.step_time_s), peak_memory_bytes=(a.peak_memory_bytes, b.peak_memory_bytes),
        bubble_fraction=(_opt_float(a.predicted.get("bubble_fraction")), _opt_float(b.predicted.get("bubble_fraction"))),
    )


def _holder(plan: Plan, index: int) -> str | None:
    """Stage ``index``'s device, or its replicas' devices joined by ``+`` (``None``: no such stage)."""
    return "+".join(plan.shape().replicas[index]) if index < len(plan.stages) else None


def _sync(plan: Plan) -> str:
    """How the plan's replicas combine updates (``"none"`` for a pure pipeline)."""
    shape = plan.shape()
    return shape.sync if shape.replicated else "none"


def diff_files(path_a: str | Path, path_b: str | Path) -> PlanDiff:
    """Load two plans and ``diff_plans`` them."""
    return diff_plans(load_plan(path_a), load_plan(path_b), str(path_a), str(path_b))


def _in_order(stage: Any, names: set[str]) -> tuple[str, ...]:
    return tuple(n for n in stage.nodes if n in names) if stage is not None else ()


def _num(stage: Any, key: str) -> float | None:
    return _opt_float(stage.extra.get(key)) if stage is not None else None


def _int(stage: Any, key: str) -> int | None:
    value = _num(stage, key)
    return None if value is None else int(value)


def _opt_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
