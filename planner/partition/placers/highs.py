"""PuLP's in-process HiGHS as the ILP uses it: a warm start PuLP cannot hand over, the banner HiGHS prints
to file descriptor 1 kept out of ``--json`` output, and the tolerances HiGHS really stopped by."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Any, Iterator

import highspy
import pulp

__all__ = ["HiGHS", "solver_output_to_log", "tolerances"]

log = logging.getLogger("planner.partition.placers.ilp")


@contextlib.contextmanager
def solver_output_to_log() -> Iterator[None]:
    """Route what HiGHS's C++ code prints to file descriptor 1 (its banner, printed on construction whatever
    the options say) into this module's debug log, so that ``--json`` output stays one JSON document."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                log.debug("HiGHS: %s", text)


class HiGHS(pulp.HiGHS):
    """PuLP's in-process HiGHS, plus a warm start handed to HiGHS before it runs (PuLP's lacks one)."""

    def __init__(self, start: dict[str, float] | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.start = start

    def callSolver(self, lp: pulp.LpProblem) -> None:
        if self.start:
            columns = lp.variables()
            solution = highspy.HighsSolution()
            solution.col_value = [float(self.start.get(var.name, 0.0)) for var in columns]
            solution.value_valid = True
            lp.solverModel.setSolution(solution)
        super().callSolver(lp)


def tolerances(highs: Any, scale_s: float) -> dict[str, float]:
    """The tolerances HiGHS really stopped by, read back from the solver instance.

    HiGHS declares a MIP ``Optimal`` when its relative gap is within ``mip_rel_gap`` *or* its absolute
    gap is within ``mip_abs_gap`` (objective units; default 1e-6). Its objective may also sit below the
    returned plan's true value by up to ``mip_feasibility_tolerance`` per unit of a constraint's slack
    (default 1e-6): a stage-time variable may undercut its lower bound by that much. We re-evaluate the
    returned plan with the exact formula, so the gap we compute includes that rounding. ``abs_gap_s``
    converts both absolute tolerances to seconds (the model is in units of ``scale_s``).
    """
    rel = float(highs.getOptionValue("mip_rel_gap")[1])
    abs_gap = float(highs.getOptionValue("mip_abs_gap")[1])
    feasibility = float(highs.getOptionValue("mip_feasibility_tolerance")[1])
    return {"mip_rel_gap": rel, "mip_abs_gap": abs_gap, "mip_feasibility_tolerance": feasibility,
            "abs_gap_s": (abs_gap + feasibility) * scale_s}
