"""Capture and measure a model: ``profile_model`` is the library entry point of ``plan profile``.

Public names: ``profile_model``, ``capture``/``Captured``, ``load_factory``, ``load_catalog``/
``device_spec``/``DeviceSpec``, ``estimate_node_time``. Link probing lives in ``planner.runtime.links``
and the rich summary in ``planner.report.profile_summary``.
"""

from planner.profile.capture import Captured, CapturedOp, capture
from planner.formats.catalog import DeviceSpec, device_spec, load_catalog
from planner.profile.device import detect_device_type
from planner.roofline import estimate_node_time
from planner.profile.loader import load_factory
from planner.profile.profiler import profile_model

__all__ = [
    "Captured", "CapturedOp", "capture", "DeviceSpec", "detect_device_type", "device_spec", "load_catalog",
    "estimate_node_time", "load_factory", "profile_model",
]
