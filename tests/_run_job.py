"""Launch ``plan run``'s worker on 2 local gloo ranks with the built-in hooks and the fault-injection plugin; print the summary as JSON.

Used by the multi-process runtime tests through ``subprocess`` (with a hard timeout):
``python tests/_run_job.py PLAN MODEL STEPS ROUND_STEPS TIMEOUT_S MAX_RESTARTS OPTIONS_JSON [NPROC]``
(``PLANNER_TEST_PARAMS_OUT``: where the ranks write their parameters).
"""

from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    from planner.errors import PlannerError
    from planner.runtime.launch.elastic import LaunchOptions, launch
    from planner.runtime.launch.config import RunConfig

    plan, model, steps, k, timeout_s, restarts, options = sys.argv[1:8]
    import os

    plugins = ("tests._faults:hooks", *(h for h in os.environ.get("PLANNER_TEST_HOOKS", "").split(",") if h))
    config = RunConfig(plan=plan, model=model, steps=int(steps), round_steps=int(k), timeout_s=float(timeout_s),
                       plugins=plugins, options=json.loads(options),
                       params_out=os.environ.get("PLANNER_TEST_PARAMS_OUT") or None)
    nproc = int(sys.argv[8]) if len(sys.argv) > 8 else 2
    try:
        results = launch(config, LaunchOptions(nproc_per_node=nproc, max_restarts=int(restarts)))
    except PlannerError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(1)
    print(json.dumps({"losses": results[0]["losses"], "plan": results[0]["plan"], "first_step": results[0].get("first_step")}))
