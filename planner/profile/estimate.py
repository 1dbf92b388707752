"""Roofline estimates of op times for device types that were not measured (Williams et al., 2009).

    time = max(FLOPs / (peak_FLOPs * compute_eff), bytes / (bandwidth * memory_eff)) + launch_overhead

per op class (:data:`EFFICIENCY`); view-like ops that move no data cost nothing. It works from a
profile ``Node`` alone, so the cost model can estimate any catalog type a profile lacks. Inputs per node:
``flops`` / ``bwd_flops`` (FlopCounterMode) and the extra fields ``bytes_moved``, ``op_class``,
``dtype`` and ``grad`` written by :mod:`planner.profile.measure` (documented in docs/formats.md);
profiles without them fall back to ``2 * output_bytes + param_bytes`` bytes and an op class guessed
from the op name. Backward: ``bwd_flops`` (else 2x forward FLOPs) and twice the forward bytes
(read the output gradient and the saved inputs, write the input gradients).
"""

from __future__ import annotations

from typing import Mapping

from planner.formats.profile import INPUT_OP, Node, OpTime
from planner.profile.catalog import DeviceSpec, device_spec

EFFICIENCY: Mapping[str, tuple[float, float]] = {
    "matmul": (0.70, 0.80),
    "attention": (0.50, 0.70),
    "elementwise": (0.50, 0.70),
    "reduction": (0.40, 0.60),
}
"""Op class -> (fraction of peak FLOP/s, fraction of peak memory bandwidth) reached in practice.
Dense GEMMs/convolutions reach ~70% of tensor-core peak in large training runs (e.g. Megatron-LM's
reported ~50-75% model FLOPs utilisation); fused attention ~50%; element-wise, norm and reduction
kernels are bandwidth bound at 60-70% of peak bandwidth. Assumed round numbers, not fitted."""

FREE_CLASSES = ("input", "view")
"""Classes that do no work: model inputs, views, getitem, shape queries (time 0, no launch)."""

_MATMUL = ("mm", "matmul", "linear", "addmm", "bmm", "baddbmm", "conv", "einsum", "module:torch.nn.modules.linear",
           "module:torch.nn.modules.conv")
_ATTENTION = ("scaled_dot_product", "attention")
_REDUCTION = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "softmax", "log_softmax",
              "cross_entropy", "nll_loss", "logsumexp", "cumsum", "var", "std", "norm")
_VIEW = ("view", "reshape", "getitem", "permute", "transpose", "expand", "unsqueeze", "squeeze", "slice",
         "select", "split", "chunk", "unbind", "alias", "detach", "t.default", "_unsafe_view", "flatten",
         "size", "sym_size", "getattr", "_assert", "dim", "contiguous", "lift_fresh", "unflatten")


def classify(op: str) -> str:
    """Op class from the op name alone (used when a node carries no measured ``op_class``)."""
    if op == INPUT_OP:
        return "input"
    parts = op.lower().replace("operator.", "").replace("aten.", "").replace("tensor.", "").split(".")
    base = parts[0] if parts else op
    if any(key in op.lower() for key in _ATTENTION):
        return "attention"
    if base in _VIEW or op.endswith(".t.default") or "getitem" in op or base.startswith("_assert"):
        return "view"
    if base in _MATMUL or any(op.startswith(k) for k in _MATMUL if k.startswith("module:")) or base.startswith("conv"):
        return "matmul"
    if base in _REDUCTION:
        return "reduction"
    return "elementwise"


def node_class(node: Node) -> str:
    value = node.extra.get("op_class")
    return value if isinstance(value, str) and value else classify(node.op)


def node_bytes(node: Node) -> int:
    """Bytes the forward op reads and writes (``bytes_moved`` when measured, else an approximation)."""
    value = node.extra.get("bytes_moved")
    if isinstance(value, int) and value >= 0:
        return value
    return 2 * node.output_bytes + node.param_bytes


def estimate_node_time(node: Node, device_type: str, catalog: Mapping[str, DeviceSpec] | None = None) -> OpTime:
    """Roofline forward and backward seconds of ``node`` on ``device_type`` (source ``estimated``)."""
    spec = device_spec(device_type, catalog)
    cls = node_class(node)
    if cls in FREE_CLASSES:
        return OpTime(0.0, 0.0, "estimated")
    compute_eff, memory_eff = EFFICIENCY.get(cls, EFFICIENCY["elementwise"])
    peak = spec.peak_flops(str(node.extra.get("dtype", "float32")))
    nbytes = node_bytes(node)
    fwd = _roofline(node.flops, nbytes, peak * compute_eff, spec.memory_bandwidth_Bps * memory_eff) + spec.launch_overhead_s
    if node.extra.get("grad") is False:
        return OpTime(fwd, 0.0, "estimated")
    bwd_flops = node.bwd_flops if node.bwd_flops > 0 else 2 * node.flops
    bwd = _roofline(bwd_flops, 2 * nbytes, peak * compute_eff, spec.memory_bandwidth_Bps * memory_eff) + spec.launch_overhead_s
    return OpTime(fwd, bwd, "estimated")


def _roofline(flops: int, nbytes: int, flops_per_s: float, bytes_per_s: float) -> float:
    return max(flops / flops_per_s, nbytes / bytes_per_s)


def add_estimates(nodes: tuple[Node, ...], device_types: tuple[str, ...],
                  catalog: Mapping[str, DeviceSpec] | None = None) -> tuple[Node, ...]:
    """Nodes with an estimated ``time_s`` entry added for each of ``device_types`` (measured entries kept)."""
    from dataclasses import replace
    from types import MappingProxyType

    for dev in device_types:
        device_spec(dev, catalog)  # fail on an unknown type before touching any node
    out = []
    for node in nodes:
        times = dict(node.time_s)
        for dev in device_types:
            if dev not in times or times[dev].source == "estimated":
                times[dev] = estimate_node_time(node, dev, catalog)
        out.append(replace(node, time_s=MappingProxyType(times)))
    return tuple(out)
