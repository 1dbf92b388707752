"""Per node and device type: the forward and backward seconds a problem's blocks are built from.

Measured times of the profiled type, scaled by the calibration factor (one training micro-batch of the
whole model over the sum of its per-op times); roofline estimates for catalog types the profile did not
measure (``planner.roofline``, with the catalog the caller passes in); the default loss and the optimizer
step per device type. Pure: the catalog arrives as an argument.
"""

from __future__ import annotations

import math
import statistics
from typing import Collection, Mapping, Sequence

from planner.errors import InputFileError, PlannerError
from planner.formats.catalog import DeviceSpec
from planner.formats.cluster import Cluster
from planner.formats.profile import Node, OpTime, Profile
from planner.roofline import (estimate_loss_s, estimate_node_time, estimate_update_s_per_param_byte,
                              estimate_version_s_per_param_byte)

__all__ = ["node_times", "loss_times", "update_rates", "update_tensor_rates", "version_rates", "split_backward_excess",
           "SPLIT_EXCESS_EXPONENTS", "calibration_factors", "timed_on_gpu", "CALIBRATION_RANGE",
           "GPU_CALIBRATION_RANGE"]


def loss_times(profile: Profile, types: Sequence[str], estimated: Collection[str],
               catalog: Mapping[str, DeviceSpec]) -> dict[str, tuple[float, float]]:
    """Device type -> (forward, backward) seconds of ``plan run``'s default loss per micro-batch.

    The profiled type uses the profile's measurement (``whole_model.loss``); estimated catalog types get a
    roofline of a bandwidth-bound sweep over the model's output
    (``planner.roofline.estimate_loss_s``). Profiles without the measurement (older ones, or
    models whose output the default loss does not apply to) get none.
    """
    measured = (profile.extra.get("whole_model") or {}).get("loss") or {}
    if not measured:
        return {}
    measured_type = str(profile.extra.get("device_type", ""))
    out = {}
    for dev_type in types:
        if dev_type == measured_type and dev_type not in estimated:
            out[dev_type] = (float(measured["fwd_s"]), float(measured["bwd_s"]))
        elif dev_type in estimated and dev_type in catalog:
            out[dev_type] = estimate_loss_s(int(measured.get("output_bytes", 0)), catalog[dev_type])
    return out


def update_rates(profile: Profile, types: Sequence[str], optimizer: str, estimated: Collection[str],
                 catalog: Mapping[str, DeviceSpec], per_tensor: Mapping[str, float]) -> dict[str, float]:
    """Device type -> seconds of one ``optimizer`` step per parameter byte.

    The profiled type uses the profile's measured step (``whole_model.update_s``, over
    ``update_param_bytes``), less the part it pays per tensor (``per_tensor``, ``update_tensor_rates``'s figures,
    times ``update_param_tensors``); types whose op times are estimated get the roofline estimate of a
    bandwidth-bound sweep (``planner.roofline.estimate_update_s_per_param_byte``). Other
    measured types (an older profile without ``update_s``) get none: their step is not modelled.
    """
    whole = profile.extra.get("whole_model") or {}
    measured_type = str(profile.extra.get("device_type", ""))
    measured = (whole.get("update_s") or {}).get(optimizer)
    param_bytes = int(whole.get("update_param_bytes", 0) or 0)
    fixed = per_tensor.get(measured_type, 0.0)
    tensors = int(whole.get("update_param_tensors", 0)) if fixed else 0  # checked where ``per_tensor`` was read
    out = {}
    for dev_type in types:
        if dev_type == measured_type and dev_type not in estimated and measured is not None and param_bytes > 0:
            out[dev_type] = max(float(measured) - fixed * tensors, 0.0) / param_bytes
            continue
        if dev_type in estimated:
            if dev_type in catalog:
                out[dev_type] = estimate_update_s_per_param_byte(optimizer, catalog[dev_type])
    return out


def update_tensor_rates(profile: Profile, types: Sequence[str], optimizer: str,
                        estimated: Collection[str]) -> dict[str, float]:
    """Device type -> seconds of one ``optimizer`` step per parameter tensor, whatever its size
    (``whole_model.update_tensor_s``, ``planner.profile.whole_model.measure_update_per_tensor``): a stage's step
    costs this per tensor it holds besides ``update_rates`` per byte. The profiled type only (the roofline prices the
    bytes, not an optimizer's per-tensor bookkeeping); profiles without the field get none, as before it existed."""
    whole = profile.extra.get("whole_model") or {}
    measured_type = str(profile.extra.get("device_type", ""))
    if measured_type not in types or measured_type in estimated or "update_tensor_s" not in whole:
        return {}
    field_value = whole["update_tensor_s"]
    seconds: float | None = math.nan  # malformed unless read below
    tensors = 0
    if isinstance(field_value, Mapping):
        try:
            seconds = float(field_value[optimizer]) if optimizer in field_value else None
            tensors = int(whole.get("update_param_tensors", 0))
        except (TypeError, ValueError):
            seconds = math.nan
    if seconds is not None and not (0 <= seconds < math.inf and tensors >= 0):
        raise InputFileError(f"the profile's whole_model.update_tensor_s holds {field_value!r} with "
                             f"update_param_tensors {whole.get('update_param_tensors')!r}, expected seconds per "
                             f"optimizer (>= 0) and a tensor count; re-profile with plan profile or delete the fields")
    return {} if seconds is None else {measured_type: seconds}


def version_rates(profile: Profile, types: Sequence[str], estimated: Collection[str],
                  catalog: Mapping[str, DeviceSpec]) -> dict[str, float]:
    """Device type -> seconds per parameter byte of an asynchronous stage's version bookkeeping at each update
    (snapshot, delta, predicted copy: docs/async.md), which the asynchronous schedules add to the optimizer step.

    As ``update_rates``: the profiled type from ``whole_model.version_s`` over ``update_param_bytes``, estimated
    types from a bandwidth-bound sweep (``planner.roofline.estimate_version_s_per_param_byte``); other measured
    types (a profile older than the field) get none."""
    whole = profile.extra.get("whole_model") or {}
    measured_type = str(profile.extra.get("device_type", ""))
    measured = whole.get("version_s")
    param_bytes = int(whole.get("update_param_bytes", 0) or 0)
    out = {}
    for dev_type in types:
        if dev_type in estimated:
            if dev_type in catalog:
                out[dev_type] = estimate_version_s_per_param_byte(catalog[dev_type])
        elif dev_type == measured_type and measured is not None and param_bytes > 0:
            out[dev_type] = float(measured) / param_bytes
    return out


SPLIT_EXCESS_EXPONENTS = (1.0, 2.0)
"""How fast a split backward's excess may grow with the bytes a stage saves: at least in proportion (every saved
tensor is walked again), at most with their square (each weight group's call walks the graph below it)."""


def split_backward_excess(profile: Profile, types: Sequence[str], estimated: Collection[str]) -> dict[str, tuple[float, float]]:
    """Device type -> ``(a, k)``: a backward split into torch's ``I`` and ``W`` takes ``a * saved_bytes ** k`` seconds
    beyond the same backward fused, which zero-bubble schedules pay on every stage but their pipeline's first
    (``cost.stage_backward_halves``).

    From ``whole_model.split_backward``'s points (the whole model and its later half, each with the bytes it saves):
    the excess follows what a stage saves, not its FLOPs (``I`` keeps the graph and its activations for ``W``, which
    walks them again: gpt_small's blocks and its LM head cost about as much to differentiate, yet a block's split
    takes 1.2x its fused backward and the head's 1.04x), and faster than in proportion (0.45 ms per MB on a third of
    gpt_small, 0.8 on all of it). Two points fix ``k`` (within ``SPLIT_EXCESS_EXPONENTS``) and ``a`` through their
    geometric mean; one point gives ``k = 1``. The profiled type only: the roofline has no rule for it, so estimated
    types and profiles without the field get none; an excess under 0 is timing noise, not charged."""
    points = (profile.extra.get("whole_model") or {}).get("split_backward") or []
    measured_type = str(profile.extra.get("device_type", ""))
    if measured_type not in types or measured_type in estimated:
        return {}
    fitted = []
    for point in points if isinstance(points, list) else [points]:
        try:
            excess = float(point["input_s"]) + float(point["weight_s"]) - float(point["fused_s"])
            saved = float(point["saved_bytes"])
        except (TypeError, KeyError, ValueError):
            raise InputFileError(f"the profile's whole_model.split_backward holds {point!r}, expected a list of "
                                 f"{{saved_bytes, fused_s, input_s, weight_s}} numbers; re-profile with plan profile "
                                 f"or delete the field") from None
        if excess > 0 and saved > 0:
            fitted.append((saved, excess))
    if not fitted:
        return {}
    k = 1.0
    if len(fitted) >= 2 and fitted[0][0] != fitted[1][0]:
        (b1, e1), (b2, e2) = fitted[:2]
        low, high = SPLIT_EXCESS_EXPONENTS
        k = min(high, max(low, math.log(e1 / e2) / math.log(b1 / b2)))
    a = math.exp(sum(math.log(e) - k * math.log(b) for b, e in fitted[:2]) / len(fitted[:2]))
    return {measured_type: (a, k)}


CALIBRATION_RANGE = (0.5, 2.0)
"""Factors outside this range mean the per-op method failed on the model: they are not applied."""

GPU_CALIBRATION_RANGE = (0.2, 2.0)
"""The same for a profile timed with CUDA events: an op timed alone pays its launch and a synchronisation, which
a training step overlaps with the kernels before it, so the ops' sum can be several times the whole (gpt_small
on an H200: factors 0.46 and 0.59 in two profiles, and its plan predicted 2.7x the measured step with none)."""


def timed_on_gpu(profile: Profile) -> bool:
    """Whether ``profile`` was timed with CUDA events (``measurement.clock``): its ops alone pay a launch and a
    synchronisation each, and its micro-batch's host and device overlap."""
    return (profile.extra.get("measurement") or {}).get("clock") == "cuda_events"


def calibration_factors(profile: Profile, cluster: Cluster | None = None) -> dict[str, float]:
    """Device type -> (one training micro-batch of the whole model) / (sum of its per-op times).

    ``plan profile`` times, besides every op alone, one training micro-batch of the whole model as
    training runs it (``whole_model.train_s``: forward, then backward accumulating into ``.grad``).
    Isolated ops miss the dispatch between ops, gradient accumulation and a real step's cache and
    allocator traffic, so their sum falls short of it (2-20 % on CPU). Scaling the measured times of
    the profiled type by this ratio makes the stages' compute add up to what training costs; the
    split between ops keeps the per-op shape. Profiles without ``train_s`` (older ones, or a model
    without trainable parameters) get no factor; see docs/cost-model.md, "Calibration".

    The lone micro-batch is the mean of every time the profile took of it alone: ``train_s`` and, under
    co-location, ``colocation.alone_s`` (timed just before and after the loaded windows).

    With ``cluster``, a profile measured under co-location (``plan profile --colocate N``:
    ``whole_model.colocation``) takes the loaded micro-batch instead (``colocation.train_s``, the median of the
    windows timed beside ``N - 1`` helpers) when some host of the cluster holds ``N`` or more devices of the
    profiled type: those devices share that host's cores and memory as measured. The loaded time is used as it was
    measured, not as a factor over one lone time, which multiplied the noise of two timings: four profiles of
    resnet_small a minute apart predicted 48.6-54.2 ms a micro-batch that way, and 49.8-52.9 ms this way. A loaded
    time under the lone one counts as the lone one: ranks that share a host slow each other or leave each other
    alone, so less is the measurements' noise (a factor of 0.974 took 2.6% off a README main job's prediction).
    """
    whole = profile.extra.get("whole_model") or {}
    device_type = str(profile.extra.get("device_type", ""))
    train_s = float(whole.get("train_s", 0.0) or 0.0)
    if train_s <= 0:
        return {}
    measured = [n.time_s[device_type] for n in profile.nodes
                if device_type in n.time_s and n.time_s[device_type].source == "measured"]
    total = sum(t.fwd + t.bwd for t in measured)
    if total <= 0:
        return {}
    colocation = whole.get("colocation") or {}
    lone = statistics.fmean([train_s, *(float(x) for x in colocation.get("alone_s") or ())])
    factor = lone / total
    low, high = GPU_CALIBRATION_RANGE if timed_on_gpu(profile) else CALIBRATION_RANGE
    if not low <= factor <= high:
        return {}
    loaded = float(colocation.get("train_s") or 0.0)  # older profiles too: there factor x their one lone time
    if cluster is not None and loaded > 0 and cluster.most_on_one_host(device_type) >= int(colocation.get("ranks", 2)):
        factor = max(loaded, lone) / total
    return {device_type: factor}


def node_times(profile: Profile, cluster: Cluster, types: Sequence[str], precision: str | None,
                calibration: Mapping[str, float], catalog: Mapping[str, DeviceSpec] | None,
                ) -> tuple[list[list[tuple[float, float]]], set[str]]:
    """Per node, per type (in ``types`` order): (fwd, bwd) seconds; and the types with estimated times.

    With ``precision``, entries marked ``estimated`` of catalog types are estimated again in it;
    ``calibration`` (type -> factor) scales the measured entries of its types.
    """
    _check_missing_types(profile, cluster, types, catalog)
    if precision is not None and catalog is None and any(
            t.source == "estimated" for n in profile.nodes for t in n.time_s.values()):
        raise PlannerError("re-estimating the profile's estimated times in another precision needs the device "
                           "catalog; pass catalog=load_catalog() (the CLI does)")
    estimated: set[str] = set()
    out: list[list[tuple[float, float]]] = []
    for node in profile.nodes:
        row = []
        for dev_type in types:
            op_time = node.time_s.get(dev_type)
            redo = (precision is not None and op_time is not None and op_time.source == "estimated"
                    and catalog is not None and dev_type in catalog)
            if op_time is None or redo:
                op_time = _estimate(node, dev_type, catalog, precision)
            if op_time.source == "estimated":
                estimated.add(dev_type)
                row.append((op_time.fwd, op_time.bwd))
            else:
                factor = calibration.get(dev_type, 1.0)
                row.append((op_time.fwd * factor, op_time.bwd * factor))
        out.append(row)
    return out, estimated


def _estimate(node: Node, device_type: str, catalog: Mapping[str, DeviceSpec] | None, precision: str | None) -> OpTime:
    """Roofline estimate of a node the profile did not time on ``device_type``."""
    assert catalog is not None  # _check_missing_types refused missing types without a catalog
    return estimate_node_time(node, device_type, catalog, precision)


def _check_missing_types(profile: Profile, cluster: Cluster, types: Sequence[str],
                         catalog: Mapping[str, DeviceSpec] | None) -> None:
    """Every cluster type the profile did not time must be in the catalog, or the error names it with its devices."""
    timed = set(profile.device_types)
    missing = [t for t in types if t not in timed]
    if missing and catalog is None:
        raise PlannerError(f"cluster {cluster.name!r} has device type(s) {', '.join(missing)} that the profile did not "
                           f"time; estimating them needs the device catalog: pass catalog=load_catalog() (the CLI does)")
    for dev_type in missing:
        assert catalog is not None
        if dev_type not in catalog:
            ids = ", ".join(d.id for d in cluster.devices if d.type == dev_type)
            raise PlannerError(
                f"cluster {cluster.name!r} has devices of type {dev_type!r} ({ids}), which the profile did not "
                f"time (it has {', '.join(sorted(timed)) or 'no complete type'}) and the device catalog does not "
                f"know (known: {', '.join(sorted(catalog))}); fix the device type or profile on that device"
            )
