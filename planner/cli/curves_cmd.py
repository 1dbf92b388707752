"""``plan curves``: gather options, call ``planner.app.curves.curves_command``, render the table."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from planner.cli.app import command, console, emit_json


@command("curves")
def curves_cmd(
    runs: Annotated[list[Path], typer.Argument(help="Run logs (plan run --log FILE) or summaries (plan run --json "
                    "> FILE), one curve each.", show_default=False)],
    output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Picture to write: NAME.png and NAME.svg "
                      "(both).", show_default=False)] = None,
    target: Annotated[Optional[str], typer.Option("--target", help="accuracy=A or loss=L for the time-to-target "
                      "column (default: each summary's own --target).", show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the time-to-target table as JSON.")] = False,
) -> None:
    """Draw runs' validation metric (or training loss) against training time and against step, side by side,
    and print each run's time to target.

    Example: plan curves fast.jsonl slow.jsonl --target accuracy=0.95 -o curves.png
    """
    from planner.app.curves import curves_command

    result = curves_command(runs, output, target)
    if as_json:
        emit_json({"runs": result.table(), "outputs": list(result.outputs)})
        return
    from planner.report.curves import render_curves

    render_curves(console, result.table(), result.outputs)
