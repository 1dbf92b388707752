"""planner: plan and run model-parallel training.

Public entry points live in the subpackages: ``planner.profile`` (capture and measure),
``planner.partition`` (cost model, simulator, placers), ``planner.runtime`` (training).
File formats are in ``planner.formats``; every error the library raises is a ``PlannerError``. For one's
own training loop: ``planner.load_plan``, ``planner.build_pipeline`` and ``planner.rebalance`` (``planner.api``).
"""

from typing import Any

from planner.errors import PlannerError

__all__ = ["PlannerError", "load_plan", "build_pipeline", "rebalance"]
__version__ = "0.1.0"

_API = ("load_plan", "build_pipeline", "rebalance", "Pipeline")


def __getattr__(name: str) -> Any:
    """``planner.load_plan`` / ``build_pipeline`` / ``rebalance`` (``planner.api``), imported on first use so that
    ``import planner`` stays light (the CLI answers usage errors before torch loads)."""
    if name in _API:
        from planner import api

        return getattr(api, name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
