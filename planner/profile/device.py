"""The local device as the catalog names it: its type and memory (needs torch; profiling and link probing)."""

from __future__ import annotations

import os
import re
from typing import Any

from planner.formats.catalog import load_catalog


def detect_device_type(device: Any = None) -> str:
    """Catalog type of the local device: ``cpu``, or a CUDA GPU matched by its name (``cuda-<name>`` if unknown)."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    name = props.name.upper()
    gib = props.total_memory / 2**30
    rules = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-80g" if gib > 50 else "a100-40g"),
             ("V100", "v100-32g"), ("L4", "l4"), ("T4", "t4"))
    for needle, dev_type in rules:
        if needle in name:
            return dev_type
    return "cuda-" + re.sub(r"[^a-z0-9]+", "-", props.name.lower()).strip("-")


def device_memory_bytes(device: Any = None) -> int:
    """Memory of the local device: GPU memory, or the host's physical memory for the CPU."""
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return load_catalog()["cpu"].memory_bytes
