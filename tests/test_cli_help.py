"""Help that reads at 80 columns (issue 23, item 7): no cut option names, paragraphs wrapped by the formatter."""

from __future__ import annotations

import click
import pytest
from typer.main import get_command
from typer.testing import CliRunner

from planner.cli import app

COMMANDS = sorted(get_command(app).commands)  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", COMMANDS)
def test_help_fits_80_columns_with_every_option_whole(name: str) -> None:
    done = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "…" not in done.output
    command = get_command(app).commands[name]  # type: ignore[attr-defined]
    for param in command.params:
        if isinstance(param, click.Option):
            for opt in param.opts:
                assert opt in done.output, f"{name} --help lacks {opt}"


def test_the_command_list_names_every_export_format() -> None:
    done = CliRunner().invoke(app, ["--help"], terminal_width=80)
    assert "export" in done.output and "schedule" in done.output
