"""The device catalog (profiles/devices.json): peak FLOP/s, memory bandwidth and capacity per device type.

``load_catalog`` reads it once at the boundary (the CLI's application layer, the runtime, benchmarks); the
pure core (cost model, roofline, placers) receives the mapping it returns and reads no file itself.

The file lives at the repository root (``planner/../profiles/devices.json``), which an editable
install and a checkout both see; ``PLANNER_DEVICES`` names another catalog file.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from planner.errors import InputFileError, UsageError
from planner.formats._validate import Checker
from planner.formats.jsonio import read_document

CATALOG_PATH = Path(__file__).resolve().parents[2] / "profiles" / "devices.json"
_NUMBERS = ("bf16_flops", "fp32_flops", "memory_bandwidth_Bps", "memory_bytes", "launch_overhead_s")


@dataclass(frozen=True)
class DeviceSpec:
    """One device type of the catalog."""

    type: str
    """Catalog key, e.g. ``h100-sxm``; the ``DEVICE_TYPE`` of profiles and clusters."""
    name: str
    bf16_flops: float
    """Peak dense half-precision (bf16, or fp16 where the device has no bf16) FLOP/s."""
    fp32_flops: float
    """Peak dense fp32 FLOP/s (no TF32 tensor cores: PyTorch leaves TF32 matmul off by default)."""
    memory_bandwidth_Bps: float
    memory_bytes: int
    launch_overhead_s: float
    """Fixed cost per op launch added to every working op by the roofline estimate."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """Where each number comes from."""
    tf32_flops: float | None = None
    """Peak dense TF32 tensor-core FLOP/s (optional ``tf32_flops`` in the catalog; ``None``: the device has
    no TF32 tensor cores, e.g. V100 and T4, and TF32 matmuls run at the fp32 rate)."""

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for values of ``dtype`` (``float32``, ``bfloat16``, ...): fp32 rate unless half precision."""
        return self.bf16_flops if dtype in ("bfloat16", "float16", "half") else self.fp32_flops


def catalog_path() -> Path:
    return Path(os.environ.get("PLANNER_DEVICES", CATALOG_PATH))


@functools.lru_cache(maxsize=4)
def _load(path: str) -> Mapping[str, DeviceSpec]:
    data = read_document(path, "device catalog")
    check = Checker(f"device catalog {path!r}")
    devices = check.get(data, "devices", dict)
    specs = {}
    for key, raw in sorted(devices.items()):
        if not isinstance(raw, dict):
            check.fail(f"devices.{key}", "an object", raw)
        nums = {n: float(check.get(raw, n, float, f"devices.{key}.{n}")) for n in _NUMBERS}
        for n, value in nums.items():
            if value <= 0:
                check.fail(f"devices.{key}.{n}", "positive", value)
        tf32 = float(check.get(raw, "tf32_flops", float, f"devices.{key}.tf32_flops")) if "tf32_flops" in raw else None
        if tf32 is not None and tf32 <= 0:
            check.fail(f"devices.{key}.tf32_flops", "positive", tf32)
        specs[key] = DeviceSpec(type=key, name=str(raw.get("name", key)), memory_bytes=int(nums.pop("memory_bytes")),
                                sources=MappingProxyType(dict(raw.get("sources", {}))), tf32_flops=tf32, **nums)
    if not specs:
        raise InputFileError(f"device catalog {path!r} lists no devices; restore profiles/devices.json")
    return MappingProxyType(specs)


def load_catalog() -> Mapping[str, DeviceSpec]:
    """All device types of the catalog, keyed by type."""
    return _load(str(catalog_path()))


def device_spec(device_type: str, catalog: Mapping[str, DeviceSpec]) -> DeviceSpec:
    """The catalog entry of ``device_type``; ``UsageError`` naming the known types when it is unknown."""
    if device_type not in catalog:
        raise UsageError(f"unknown device type {device_type!r}; known types: {', '.join(sorted(catalog))} (see profiles/devices.json)")
    return catalog[device_type]
