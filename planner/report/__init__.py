"""Rendering, and only rendering: stage tables, console output of every command's result, the per-device
timeline picture, the Chrome/Perfetto trace, the profile summary and the live round table.

Public: ``stage_table``, ``summary_text``, ``plan_summary`` (tables and the plan's JSON summary), and the
``render_*`` functions of ``planner.report.render``. The work behind ``plan show`` (load, re-simulate,
write files) is ``planner.app.show``.
"""

from __future__ import annotations

from planner.report.render import render_check, render_diff, render_links, render_plan, render_run
from planner.report.table import plan_summary, stage_table, summary_text

__all__ = ["plan_summary", "stage_table", "summary_text", "render_check", "render_diff", "render_links",
           "render_plan", "render_run"]
