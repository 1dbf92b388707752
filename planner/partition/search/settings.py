"""``--schedule auto`` and ``--microbatches auto``: run settings chosen by simulated step time.

- **Schedule**: gpipe, 1f1b and interleaved-1f1b are each planned (shape search included); the fastest plan
  that fits wins, ties to the earlier in that order.
- **Micro-batch count** (needs ``--global-batch``, in samples): every count ``m`` that splits the global batch
  into equal micro-batches (``B / m`` rows each, up to ``MAX_MICROBATCHES``) is planned on the profile rescaled
  to ``B / m`` rows (``rescaled``: activation bytes in proportion to the rows, times with the fixed part the profile
  measured by doubling the rows, parameters and the optimizer step unchanged -- the same model ``plan run`` uses
  for a ``--microbatch-size`` other than the profile's);
  the fastest wins, ties to fewer micro-batches. The plan records ``microbatch_size`` for ``plan run``.

Every candidate's simulated step time (``null``: nothing fit, with ``why``), its shape (``stages``, ``degree``) and
its peak memory (``peak_memory_bytes``, ``memory_fraction``: of the fullest device) are recorded under ``choices``; all candidates
process the same global batch per step, so their step times compare directly. The fixed part is one share for
the whole model (docs/cost-model.md): a model that mixes large matmuls with many small kernels has more fixed
cost in the small ones than that share says.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Mapping

from planner.errors import InfeasibleError, PlannerError, UsageError
from planner.formats.catalog import DeviceSpec
from planner.formats.plan import SCHEDULES, Plan
from planner.formats.profile import OpTime, Profile
from planner.partition.model.times import timed_on_gpu
from planner.roofline import growing_time_s

__all__ = ["MAX_MICROBATCHES", "FINALISTS", "parse_microbatches", "microbatch_counts", "rescaled", "time_growth",
           "candidate_facts", "choose"]

MAX_MICROBATCHES = 64

PlanFn = Callable[[Profile, int, str], Plan]
"""``(profile, microbatches, schedule) -> plan`` with every other setting bound."""


def parse_microbatches(value: str | int, global_batch: int | None) -> int | None:
    """``--microbatches``: a positive count, or ``auto`` (``None``), which needs ``--global-batch``."""
    if isinstance(value, int) or str(value).isdigit():
        if global_batch is not None:
            raise UsageError("--global-batch goes with --microbatches auto; with a fixed count the global batch is "
                             "microbatches x the profile's micro-batch size")
        return int(value)
    if str(value) != "auto":
        raise UsageError(f"--microbatches must be a positive whole number or 'auto', found {value!r}")
    if global_batch is None or global_batch < 1:
        raise UsageError("--microbatches auto needs --global-batch SAMPLES (a positive count: the rows of one "
                         "optimizer step); pass it, or give a count such as -n 8")
    return None


def microbatch_counts(global_batch: int) -> list[int]:
    """Counts that split ``global_batch`` rows into equal micro-batches, up to ``MAX_MICROBATCHES``."""
    return [m for m in range(1, min(global_batch, MAX_MICROBATCHES) + 1) if global_batch % m == 0]


def rescaled(profile: Profile, microbatch_size: int, catalog: Mapping[str, DeviceSpec] | None = None) -> Profile:
    """``profile`` as if profiled with ``microbatch_size`` rows (``k`` times the profiled rows).

    Activation bytes and FLOPs scale with the rows. Measured times (the profile's own device type) scale by
    ``time_growth``: a fixed part, measured by doubling the rows, and a part in proportion, or the roofline's
    work if that is more. Roofline estimates keep their launch overhead per op and scale the rest, as
    ``roofline.estimate_node_time`` would. Both need ``catalog`` (``formats.catalog.load_catalog``; the callers
    load it, the core reads no file); without it the GPU bound is left out and estimates scale in proportion."""
    base = int(profile.model.get("microbatch_size") or 0)
    if base < 1:
        raise PlannerError("the profile records no microbatch_size; --microbatches auto cannot rescale it: profile "
                           "the model again with plan profile")
    if microbatch_size == base:
        return profile
    k = microbatch_size / base
    measured = time_growth(profile, k, catalog)
    launch = {t: catalog[t].launch_overhead_s for n in profile.nodes for t, v in n.time_s.items()
              if v.source != "measured" and catalog is not None and t in catalog}

    def time(t: str, v: OpTime) -> OpTime:
        if v.source == "measured" or t not in launch:
            return OpTime(v.fwd * measured, v.bwd * measured, v.source,
                          None if v.bwd_weight is None else v.bwd_weight * measured)
        def part(x: float) -> float:  # launch + (x - launch) k, where the estimate charged a launch
            return x if x <= 0 else min(x, launch[t]) + max(x - launch[t], 0.0) * k
        bwd = part(v.bwd)
        return OpTime(part(v.fwd), bwd, v.source, None if v.bwd_weight is None else v.bwd_weight * bwd / v.bwd)

    nodes = tuple(replace(n, output_bytes=round(n.output_bytes * k), saved_bytes=round(n.saved_bytes * k),
                          flops=round(n.flops * k), bwd_flops=round(n.bwd_flops * k),
                          time_s={t: time(t, v) for t, v in n.time_s.items()})
                  for n in profile.nodes)
    return replace(profile, nodes=nodes, model={**profile.model, "microbatch_size": microbatch_size},
                   extra={**profile.extra, "whole_model": _rescaled_whole(profile.extra.get("whole_model"), k,
                                                                          measured)})


def time_growth(profile: Profile, k: float, catalog: Mapping[str, DeviceSpec] | None = None) -> float:
    """How many times longer a training micro-batch of ``k`` times the profiled rows takes on the profiled type.

    ``f + (1 - f) k``, where ``f`` is the share of the micro-batch that did not grow when its rows doubled
    (``whole_model.rows_scaling.fixed_fraction``; 0 in older profiles, which scale in proportion): on a CPU the
    fixed part and the rest run one after the other (``f`` was 0.09 for gpt_small). A profile timed with CUDA
    events takes ``max(f + (1 - f) k, s k)``, with ``s`` the share the roofline gives the work that grows with
    the rows (``roofline.growing_time_s``, at most 1; 0 without ``catalog`` or where it lacks the type): the host issues
    kernels while earlier ones run, so a micro-batch takes the longer of the two, and two sizes that both ran at
    the host's launch rate (``f`` 1) say nothing of where the device's work takes over."""
    whole = profile.extra.get("whole_model") or {}
    fixed = _fixed_fraction(whole)
    affine = fixed + (1.0 - fixed) * k
    train_s = float(whole.get("train_s") or 0.0)
    device_type = str(profile.extra.get("device_type", ""))
    if not timed_on_gpu(profile) or fixed <= 0 or train_s <= 0 or catalog is None or device_type not in catalog:
        return affine
    share = min(growing_time_s(profile.nodes, device_type, catalog) / train_s, 1.0)
    return max(affine, share * k)


def _fixed_fraction(whole: Mapping[str, Any]) -> float:
    """``whole_model.rows_scaling.fixed_fraction`` in [0, 1] (0 where the profile measured none)."""
    return min(max(float((whole.get("rows_scaling") or {}).get("fixed_fraction") or 0.0), 0.0), 1.0)


def _rescaled_whole(whole: Any, k: float, time_k: float) -> Any:
    """The whole-model measurement at ``k`` times the rows: its training, forward, backward and loss times (the
    co-location's lone and loaded ones too) scale by ``time_k`` as the measured ops do, so the calibration factor
    (training over the sum of the ops) and the co-location factor are those measured; the loss's output bytes
    scale by ``k``; the optimizer step does not depend on the rows. ``rows_scaling`` is restated at the new rows:
    the fixed part is the same seconds, a different share of the new time."""
    if not whole:
        return whole
    scaled = dict(whole)
    for key in ("fwd_s", "bwd_s", "sum_ops_fwd_s", "sum_ops_bwd_s", "train_s"):
        if isinstance(whole.get(key), (int, float)):
            scaled[key] = whole[key] * time_k
    loss = whole.get("loss")
    if loss:
        scaled["loss"] = {**loss, **{key: loss[key] * time_k for key in ("fwd_s", "bwd_s") if key in loss},
                          **({"output_bytes": round(loss["output_bytes"] * k)} if "output_bytes" in loss else {})}
    colocation = whole.get("colocation")
    if colocation and isinstance(colocation.get("train_s"), (int, float)):
        scaled["colocation"] = {**colocation, "train_s": colocation["train_s"] * time_k,
                                **{key: [x * time_k for x in colocation[key]] for key in ("alone_s", "loaded_s")
                                   if isinstance(colocation.get(key), list)}}
    if whole.get("rows_scaling"):
        scaled["rows_scaling"] = {**whole["rows_scaling"], "fixed_fraction": _fixed_fraction(whole) / time_k}
    return scaled


def candidate_facts(plan: Plan) -> dict[str, Any]:
    """What a candidate table shows beside a plan's step time: its shape and its fullest device's memory."""
    shape = plan.shape()
    devices = plan.extra.get("cluster", {}).get("devices", ())
    capacity = {d["id"]: int(d["memory_bytes"]) for d in devices}
    peaks = {d: int(v.get("peak_memory_bytes") or 0) for d, v in plan.predicted.get("devices", {}).items()}
    fraction = max((peak / capacity[d] for d, peak in peaks.items() if capacity.get(d)), default=None)
    return {"stages": len(plan.stages), "degree": shape.degree, "peak_memory_bytes": plan.peak_memory_bytes,
            "memory_fraction": fraction, "recompute": sum(plan.recomputed())}


FINALISTS = 3
"""Candidates ``choose`` re-plans with the slower, better placer (``finish``: ``--refine``): the fastest ones that
differ in their layout (``_layout``)."""


def _layout(plan: Plan) -> tuple[Any, ...]:
    """What makes two candidates the same plan before refining: stages, devices, replicas, shares and step time (an
    interleaved or V schedule that kept one stage per device runs 1F1B's or ZB-H1's order on the same stages, and a
    finalist slot spent on it again would refine the same plan)."""
    return (plan.microbatches, tuple(len(st.nodes) for st in plan.stages), tuple(map(tuple, plan.replicas())),
            tuple(plan.shares() or ()), round(plan.step_time_s, 12))


TIE = 1e-9
"""Step times within this fraction of each other are a tie (the same plan simulated through two code paths can
differ in the last bits): the earlier candidate wins."""


def _ranked(plans: Mapping[int, tuple[Profile, Plan]]) -> list[int]:
    """Candidate indices fastest first, a tie (``TIE``) going to the earlier candidate."""
    order = sorted(plans, key=lambda i: (plans[i][1].step_time_s, i))
    if not order:
        return order
    best = plans[order[0]][1].step_time_s
    tied = sorted(i for i in order if plans[i][1].step_time_s <= best * (1 + TIE))
    return tied + order[len(tied):]  # the tied ones are the first len(tied) of order


def choose(profile: Profile, schedule: str, microbatches: int | None, global_batch: int | None, plan: PlanFn,
           finish: PlanFn | None = None, catalog: Mapping[str, DeviceSpec] | None = None) -> Plan:
    """The fastest plan over the schedules (``schedule == "auto"``) and micro-batch counts (``microbatches is
    None``) asked to be chosen; raises the last ``InfeasibleError`` when no candidate fits. With ``finish`` (the
    same planner with ``--refine``), every candidate is planned by ``plan`` and the ``FINALISTS`` fastest distinct ones
    again by ``finish``; the fastest finished plan wins (refining every candidate costs ten times as much and rarely
    reorders the leaders)."""
    schedules = list(SCHEDULES) if schedule == "auto" else [schedule]
    if microbatches is None:
        assert global_batch is not None
        counts = microbatch_counts(global_batch)
    else:
        counts = [microbatches]
    tried: list[dict[str, Any]] = []
    plans: dict[int, tuple[Profile, Plan]] = {}
    error: PlannerError | None = None
    for m in counts:
        rows = global_batch // m if microbatches is None else None  # type: ignore[operator]
        source = profile if rows is None else rescaled(profile, rows, catalog)
        facts = {} if rows is None else {"microbatch_size": rows}
        for name in schedules:
            try:
                candidate = plan(source, m, name)
            except (InfeasibleError, UsageError) as exc:
                error = exc
                tried.append({"schedule": name, "microbatches": m, **facts, "step_time_s": None,
                              "why": str(exc)[:200]})
                continue
            tried.append({"schedule": name, "microbatches": m, **facts, "step_time_s": candidate.step_time_s,
                          **candidate_facts(candidate)})
            plans[len(tried) - 1] = (source, candidate)
    if not plans:
        assert error is not None
        raise error
    ranked = _ranked(plans)
    if finish is not None:
        finalists: dict[tuple[Any, ...], int] = {}
        for index in ranked:
            if len(finalists) < FINALISTS:
                finalists.setdefault(_layout(plans[index][1]), index)
        for index in finalists.values():
            source, first = plans[index]
            try:
                refined = finish(source, first.microbatches, first.schedule)
            except (InfeasibleError, UsageError):
                continue  # the first plan stands
            if refined.step_time_s <= first.step_time_s:
                plans[index] = (source, refined)
                tried[index].update(step_time_s=refined.step_time_s, refined=True, **candidate_facts(refined))
        ranked = _ranked(plans)
    index = ranked[0]
    chosen = plans[index][1]
    record: dict[str, Any] = {"schedule": schedule, "microbatches": "auto" if microbatches is None else microbatches,
                              "chosen": tried[index], "candidates": tried}
    extra = {**dict(chosen.extra), "choices": record}
    if microbatches is None:
        assert global_batch is not None
        record["global_batch"] = global_batch
        extra["microbatch_size"] = global_batch // chosen.microbatches
    return replace(chosen, extra=extra)
