"""Roofline estimates of op times for device types that were not measured (Williams et al., 2009).

    time = max(FLOPs / (peak_FLOPs * compute_eff), bytes / (bandwidth * memory_eff)) + launch_overhead

per op class (:data:`EFFICIENCY`); view-like ops that move no data cost nothing. It works from a
profile ``Node`` alone, so the cost model can estimate any catalog type a profile lacks. Inputs per node:
``flops`` / ``bwd_flops`` (FlopCounterMode) and the extra fields ``bytes_moved``, ``op_class``,
``dtype`` and ``grad`` written by :mod:`planner.profile.measure` (documented in docs/formats.md);
profiles without them fall back to ``2 * output_bytes + param_bytes`` bytes and an op class guessed
from the op name. Backward: ``bwd_flops`` (else 2x forward FLOPs) and twice the forward bytes
(read the output gradient and the saved inputs, write the input gradients).

**Precision** (``precision``; ``plan profile --estimate-precision``, ``plan partition --estimate-precision``).
``None`` (the default) estimates the profiled dtype: a float32 CPU profile at each GPU's fp32 peak, which
is honest about what was measured but not how models are trained on GPUs. The explicit options assume
the training precision instead (:data:`PRECISIONS`):

- ``fp32``: every op at the fp32 peak, 4-byte floats;
- ``tf32``: matmuls and attention on TF32 tensor cores (``tf32_flops``; the fp32 rate on devices
  without them, V100 and T4), other ops at the fp32 peak, 4-byte floats;
- ``bf16`` (mixed precision, autocast): matmuls and attention at the half-precision tensor-core peak
  (``bf16_flops``; fp16 on V100 and T4), other ops at the fp32 peak, 2-byte floats.

Bytes moved scale with the element size: a float32 node's ``bytes_moved`` is halved under ``bf16``
(non-float outputs such as token ids are not scaled). Only op *times* change; the profile's activation,
parameter and cut bytes (memory, transfers) stay as profiled, which overstates them under bf16.
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Mapping, Sequence

from planner.errors import UsageError
from planner.formats.profile import INPUT_OP, Node, OpTime
from planner.formats.catalog import DeviceSpec, device_spec

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

PRECISIONS: Mapping[str, int] = {"fp32": 4, "tf32": 4, "bf16": 2}
"""Training precisions the estimate can assume -> bytes per floating-point element."""

TENSOR_CORE_CLASSES = ("matmul", "attention")
"""Op classes that run on tensor cores under ``tf32`` and ``bf16``; the others stay at the fp32 rate."""

FLOAT_BYTES: Mapping[str, int] = {"float32": 4, "float": 4, "float64": 8, "double": 8, "bfloat16": 2,
                                  "float16": 2, "half": 2}
"""Element size of the floating dtypes a profile node may record (``extra["dtype"]``)."""

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


def check_precision(precision: str | None) -> str | None:
    """``precision`` if it is ``None`` or one of :data:`PRECISIONS`; a one-line ``UsageError`` otherwise."""
    if precision is not None and precision not in PRECISIONS:
        raise UsageError(f"unknown estimate precision {precision!r}; expected one of {', '.join(PRECISIONS)} "
                         "(or leave it out to estimate the profiled dtype)")
    return precision


def peak_flops(spec: DeviceSpec, cls: str, dtype: str, precision: str | None) -> float:
    """Peak FLOP/s the estimate assumes for an op of class ``cls`` (module docstring, **Precision**)."""
    if precision is None:
        return spec.peak_flops(dtype)
    if cls not in TENSOR_CORE_CLASSES or precision == "fp32":
        return spec.fp32_flops
    if precision == "tf32":
        return spec.tf32_flops or spec.fp32_flops
    return spec.bf16_flops


def scaled_bytes(node: Node, precision: str | None) -> int:
    """Bytes the op moves in ``precision``: ``node_bytes`` times target over profiled float element size."""
    nbytes = node_bytes(node)
    source = FLOAT_BYTES.get(str(node.extra.get("dtype", "float32")))
    if precision is None or source is None:
        return nbytes
    check_precision(precision)
    return nbytes * PRECISIONS[precision] // source


def estimate_node_time(node: Node, device_type: str, catalog: Mapping[str, DeviceSpec],
                       precision: str | None = None) -> OpTime:
    """Roofline forward and backward seconds of ``node`` on ``device_type`` (source ``estimated``).

    ``precision``: ``None`` (the profiled dtype) or one of :data:`PRECISIONS` (module docstring).
    """
    check_precision(precision)
    spec = device_spec(device_type, catalog)
    cls = node_class(node)
    if cls in FREE_CLASSES:
        return OpTime(0.0, 0.0, "estimated")
    compute_eff, memory_eff = EFFICIENCY.get(cls, EFFICIENCY["elementwise"])
    peak = peak_flops(spec, cls, str(node.extra.get("dtype", "float32")), precision)
    nbytes = scaled_bytes(node, precision)
    fwd = _roofline(node.flops, nbytes, peak * compute_eff, spec.memory_bandwidth_Bps * memory_eff) + spec.launch_overhead_s
    if node.extra.get("grad") is False:
        return OpTime(fwd, 0.0, "estimated")
    bwd_flops = node.bwd_flops if node.bwd_flops > 0 else 2 * node.flops
    bwd = _roofline(bwd_flops, 2 * nbytes, peak * compute_eff, spec.memory_bandwidth_Bps * memory_eff) + spec.launch_overhead_s
    return OpTime(fwd, bwd, "estimated", bwd * weight_share(node))


WEIGHT_ONLY_OPS = ("aten.embedding.default",)
"""Ops with parameters whose other inputs never need a gradient (an embedding's indices): all weight gradient."""


def weight_share(node: Node) -> float:
    """The part of ``node``'s backward that is its weight gradient (zero-bubble schedules' ``W``).

    Measured where the profile split it (``OpTime.bwd_weight``; the first measured type that did, in type order).
    Otherwise a rule, which the planner names when it uses it (docs/zero-bubble.md): an op without parameters
    first used here has no weight gradient (0); an embedding is all weight gradient (1); any other op with
    parameters splits half and half, as a matrix product's two gradients cost the same FLOPs. A parameter used
    again by a later op (tied weights) counts only at its first use."""
    for dev_type in sorted(node.time_s):
        t = node.time_s[dev_type]
        if t.source == "measured" and t.bwd_weight is not None and t.bwd > 0:
            return min(1.0, t.bwd_weight / t.bwd)
    if not node.params and node.param_bytes <= 0:
        return 0.0
    return 1.0 if node.op in WEIGHT_ONLY_OPS else 0.5


def growing_time_s(nodes: Sequence[Node], device_type: str, catalog: Mapping[str, DeviceSpec]) -> float:
    """The roofline's seconds of ``nodes``, forward and backward, without its launch overheads: the part of a
    micro-batch that grows with its rows (``partition.search.settings.time_growth``: on a GPU, a micro-batch of
    more rows takes at least this much more)."""
    spec = device_spec(device_type, catalog)
    total = 0.0
    for node in nodes:
        times = estimate_node_time(node, device_type, catalog)
        total += sum(max(t - spec.launch_overhead_s, 0.0) for t in (times.fwd, times.bwd) if t > 0)
    return total


def has_measured_split(nodes: Sequence[Node]) -> bool:
    """Whether any node's backward split was measured (else ``weight_share`` falls back to its rule everywhere)."""
    return any(t.source == "measured" and t.bwd_weight is not None for n in nodes for t in n.time_s.values())


def _roofline(flops: int, nbytes: int, flops_per_s: float, bytes_per_s: float) -> float:
    return max(flops / flops_per_s, nbytes / bytes_per_s)


def add_estimates(nodes: tuple[Node, ...], device_types: tuple[str, ...],
                  catalog: Mapping[str, DeviceSpec], precision: str | None = None) -> tuple[Node, ...]:
    """Nodes with an estimated ``time_s`` entry added for each of ``device_types`` (measured entries kept).

    Existing ``estimated`` entries of those types are replaced (so re-estimating in another precision works).
    """
    check_precision(precision)
    for dev in device_types:
        device_spec(dev, catalog)  # fail on an unknown type before touching any node
    out = []
    for node in nodes:
        times = dict(node.time_s)
        for dev in device_types:
            if dev not in times or times[dev].source == "estimated":
                times[dev] = estimate_node_time(node, dev, catalog, precision)
        out.append(replace(node, time_s=MappingProxyType(times)))
    return tuple(out)


UPDATE_BYTES_PER_PARAM_BYTE: Mapping[str, int] = {"sgd": 5, "adam": 9}
"""Memory traffic of one optimizer step per parameter byte, with the gradient averaging before it:
the division reads and writes the gradient (2); plain SGD then reads parameter and gradient and writes
the parameter (3); Adam reads parameter, gradient and both moments and writes parameter and moments (7)."""


def estimate_update_s_per_param_byte(optimizer: str, spec: DeviceSpec) -> float:
    """Roofline estimate of an optimizer step's seconds per parameter byte on ``spec``: a bandwidth-bound
    element-wise sweep (:data:`UPDATE_BYTES_PER_PARAM_BYTE` bytes at the element-wise bandwidth fraction)."""
    _, memory_eff = EFFICIENCY["elementwise"]
    return UPDATE_BYTES_PER_PARAM_BYTE[optimizer] / (spec.memory_bandwidth_Bps * memory_eff)


VERSION_BYTES_PER_PARAM_BYTE = 9
"""Memory traffic of an asynchronous stage's version bookkeeping at each update, per parameter byte
(``planner.runtime.pipeline.versions.version_work``): the snapshot reads the weights and writes a copy (2), the
delta reads both versions and writes one (3), the predicted copy reads version and delta and writes one (3), and the
gradient accumulators are zeroed (1)."""


def estimate_version_s_per_param_byte(spec: DeviceSpec) -> float:
    """Roofline estimate of that bookkeeping's seconds per parameter byte on ``spec``: a bandwidth-bound
    element-wise sweep of :data:`VERSION_BYTES_PER_PARAM_BYTE` bytes."""
    _, memory_eff = EFFICIENCY["elementwise"]
    return VERSION_BYTES_PER_PARAM_BYTE / (spec.memory_bandwidth_Bps * memory_eff)


LOSS_BYTES_PER_OUTPUT_BYTE = 3
"""Memory traffic of the default loss per byte of the model's output, each way: cross-entropy's forward
reads the logits twice (max and sum of exponentials) and writes the log-probabilities; its backward reads
them and the output gradient and writes the logits' gradient. Mean squared error moves less; 3 bounds both."""


def estimate_loss_s(output_bytes: int, spec: DeviceSpec) -> tuple[float, float]:
    """Roofline estimate of the default loss's forward and backward seconds on ``spec``: a bandwidth-bound
    reduction over the model's output (:data:`LOSS_BYTES_PER_OUTPUT_BYTE`), plus a few kernel launches."""
    _, memory_eff = EFFICIENCY["reduction"]
    sweep = LOSS_BYTES_PER_OUTPUT_BYTE * output_bytes / (spec.memory_bandwidth_Bps * memory_eff)
    return sweep + 3 * spec.launch_overhead_s, sweep + 3 * spec.launch_overhead_s
