"""``profile_model``: factory -> capture -> measure -> (estimate) -> ``Profile``. No printing, no files."""

from __future__ import annotations

import statistics
from collections import defaultdict
from types import MappingProxyType
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from planner.errors import ModelError
from planner.formats.profile import Node, OpTime, Profile
from planner.profile.capture import Captured, capture
from planner.formats.catalog import device_spec, load_catalog
from planner.profile.device import detect_device_type
from planner.roofline import FREE_CLASSES, add_estimates, check_precision
from planner.profile.loader import batch_size, describe_output, load_factory, pick_output, select_output
from planner.profile.measure import Measurement, Progress, measure
from planner.profile.memory import nbytes


COLOCATION_WINDOWS = 3
"""Loaded timings per ``--colocate`` profile, each of ``repeats`` micro-batches; their median is the loaded time."""


def profile_model(spec: str, *, input_spec: str | None = None, microbatch_size: int | None = None,
                  tracer: str = "auto", repeats: int = 5, warmup: int = 2, estimate: Sequence[str] = (),
                  progress: Progress | None = None, device: str | None = None, threads: int | None = 1,
                  estimate_precision: str | None = None, model_output: str | None = None,
                  colocate: int = 1) -> Profile:
    """Profile the model of ``spec`` (``pkg.mod:factory`` or ``file.py:factory``) on the local device.

    ``estimate`` lists catalog device types to add roofline estimates for, assuming
    ``estimate_precision`` (``None``: the profiled dtype; ``fp32``, ``tf32``, ``bf16``: see
    ``planner.roofline``), recorded as ``estimate_precision``; ``threads`` pins CPU
    intra-op threads while timing (1 by default, so per-op and whole-model times compare fairly).
    ``colocate`` (``--colocate N``, N >= 2) also times one training micro-batch while N - 1 other processes
    train the same model (``planner.profile.colocate``), recorded as ``whole_model.colocation``.
    ``model_output`` (``--model-output KEY|INDEX``) picks the output to train on when forward returns a dict,
    tuple or list; it is recorded as ``model.output`` and ``plan run`` picks the same one.
    """
    check_precision(estimate_precision)
    catalog = load_catalog()
    estimate = tuple(dict.fromkeys(estimate))
    for dev in estimate:
        device_spec(dev, catalog)
    module, inputs = load_factory(spec, input_spec, microbatch_size)
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    module = module.to(dev).train()
    inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs)
    output = check_inputs(module, inputs, input_spec)
    if model_output is not None:
        output = pick_output(output, model_output)
        module = select_output(module, model_output)
    captured = capture(module, inputs, tracer)
    measurement = measure(captured, module, inputs, device=dev, repeats=repeats, warmup=warmup,
                          threads=threads, progress=progress)
    device_type = detect_device_type(dev)
    profile = build_profile(spec, module, inputs, captured, measurement, device_type)
    model = dict(profile.model, output_kind=describe_output(output))
    if model_output is not None:
        model["output"] = model_output
    extra = dict(profile.extra, measurement=dict(profile.extra["measurement"], repeats=repeats, warmup=warmup))
    if colocate > 1 and measurement.whole.train_s:
        from planner.profile.colocate import measure_colocated
        from planner.profile.whole_model import time_training

        def train() -> float:
            return time_training(module, inputs, dev, repeats, warmup, threads)

        # Timed alone just before and just after the loaded windows: this shared machine's speed drifts by a few
        # percent over tens of seconds, which one lone time taken earlier would read as co-location. The loaded
        # time is the median of COLOCATION_WINDOWS windows: one window beside a helper ranged over 0.99-1.21x the
        # lone time on resnet_small in three profiles a minute apart, and the plan's prediction with it.
        before = train()
        loaded = measure_colocated(colocate, spec, input_spec, microbatch_size, threads or 1, train, COLOCATION_WINDOWS)
        alone = [before, train()]
        typical = statistics.median(loaded)
        whole = dict(extra["whole_model"], colocation={"ranks": colocate, "train_s": typical,
                                                       "factor": typical / statistics.fmean(alone),
                                                       "alone_s": alone, "loaded_s": loaded})
        extra["whole_model"] = whole
    estimated = tuple(d for d in estimate if d != device_type)
    if estimated:
        extra["estimated_device_types"] = list(estimated)
        if estimate_precision is not None:
            extra["estimate_precision"] = estimate_precision
    nodes = add_estimates(profile.nodes, estimated, catalog, estimate_precision)
    return Profile(model=MappingProxyType(model), nodes=nodes, extra=MappingProxyType(extra))


def check_inputs(module: nn.Module, inputs: Sequence[Any], input_spec: str | None) -> Any:
    """Run the model once eagerly so a shape or dtype mismatch is reported as such, not as a capture failure;
    return its output."""
    try:
        with torch.no_grad():
            return module(*inputs)
    except Exception as exc:
        line = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")[:240]
        shapes = ", ".join(f"{str(x.dtype).replace('torch.', '')}{list(x.shape)}" for x in inputs if isinstance(x, torch.Tensor))
        what = f"input spec {input_spec!r}" if input_spec else "the factory's example inputs"
        raise ModelError(f"{what} ({shapes}) do not fit the model: {type(exc).__name__}: {line}; "
                         f"pass shapes and dtypes its forward accepts with --input") from None


def build_profile(spec: str, module: nn.Module, inputs: Sequence[Any], captured: Captured,
                  measurement: Measurement, device_type: str) -> Profile:
    """Assemble the profile: nodes with first-use parameter bytes, tied parameters, coverage gaps."""
    tensors = _named_tensors(module)
    owners: set[int] = set()
    nodes = []
    for op, m in zip(captured.ops, measurement.ops):
        first = [name for name in op.params if name in tensors and id(tensors[name]) not in owners]
        owners.update(id(tensors[name]) for name in first)
        extra: dict[str, Any] = {"bytes_moved": m.bytes_moved, "op_class": m.op_class, "dtype": m.dtype, "grad": m.grad}
        if m.error:
            extra["measure_error"] = m.error
        nodes.append(Node(
            name=op.name, op=op.op, inputs=op.inputs, output_bytes=m.output_bytes,
            param_bytes=sum(nbytes(tensors[n]) for n in first),
            time_s=MappingProxyType({device_type: OpTime(m.fwd_s, m.bwd_s, "measured", m.bwd_weight_s)}),
            saved_bytes=m.saved_bytes, flops=m.flops, bwd_flops=m.bwd_flops, module_path=op.module_path,
            params=tuple(first), extra=MappingProxyType(extra),
        ))
    distinct = {id(t): t for t in tensors.values()}
    model = {
        "name": type(module).__name__, "source": spec, "microbatch_size": batch_size(inputs),
        "inputs": [{"dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape)} for x in inputs if isinstance(x, torch.Tensor)],
        "parameters": sum(p.numel() for p in module.parameters()),
        "param_bytes": sum(nbytes(t) for t in distinct.values()),
    }
    extra = {
        "device_type": device_type,
        "tracer": captured.tracer,
        "measurement": {"device": str(next((x.device for x in inputs if isinstance(x, torch.Tensor)), "cpu")),
                        "threads": measurement.threads, "clock": measurement.clock,
                        "allocator": measurement.allocator, "timer_overhead_s": measurement.timer_overhead_s,
                        "grad_overhead_s": measurement.grad_overhead_s},
        "whole_model": measurement.whole.to_dict(),
        "tied_parameters": tied_parameters(captured, tensors),
        "uncounted_flops": uncounted_flops(nodes),
    }
    failures = [{"node": m.name, "error": m.error} for m in measurement.ops if m.error]
    if failures:
        extra["measure_failures"] = failures
    return Profile(model=MappingProxyType(model), nodes=tuple(nodes), extra=MappingProxyType(extra))


def tied_parameters(captured: Captured, tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Parameters shared by several names or read by several nodes: ``{"params", "nodes", "bytes"}``."""
    aliases: dict[int, list[str]] = defaultdict(list)
    for name, tensor in tensors.items():
        aliases[id(tensor)].append(name)
    users: dict[int, list[str]] = defaultdict(list)
    for op in captured.ops:
        for key in dict.fromkeys(id(tensors[n]) for n in op.params if n in tensors):
            users[key].append(op.name)
    groups = []
    for key, names in aliases.items():
        if len(names) > 1 or len(users.get(key, [])) > 1:
            groups.append({"params": sorted(names), "nodes": users.get(key, []), "bytes": nbytes(tensors[names[0]])})
    return sorted(groups, key=lambda g: g["params"])


def uncounted_flops(nodes: Iterable[Node]) -> list[dict[str, Any]]:
    """Working ops (not inputs or views) for which FlopCounterMode counted no FLOPs, grouped by op."""
    by_op: dict[str, list[str]] = defaultdict(list)
    for node in nodes:
        if node.extra.get("op_class") not in FREE_CLASSES and node.flops == 0:
            by_op[node.op].append(node.name)
    return [{"op": op, "count": len(names), "nodes": names} for op, names in sorted(by_op.items())]


def _named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = dict(module.named_buffers(remove_duplicate=False))
    tensors.update(module.named_parameters(remove_duplicate=False))
    return tensors

