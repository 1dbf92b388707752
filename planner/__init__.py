"""planner: plan and run model-parallel training.

Public entry points live in the subpackages: ``planner.profile`` (capture and measure),
``planner.partition`` (cost model, simulator, placers), ``planner.runtime`` (training).
File formats are in ``planner.formats``; every error the library raises is a ``PlannerError``.
"""

from planner.errors import PlannerError

__all__ = ["PlannerError"]
__version__ = "0.1.0"
