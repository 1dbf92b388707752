"""The typer application and the one boundary where library errors become one-line messages.

Commands only gather options, call one library function and render; ``@command`` turns a
``PlannerError`` into ``error: <message>`` on stderr with the error's exit code, never a traceback.
"""

from __future__ import annotations

import functools
import io
import logging
import select
import sys
from typing import Any, Callable, TypeVar

import click
import typer
import typer.core

# typer >= 0.16 vendors click as typer._click; its exceptions are not click's.
_click = getattr(typer.core, "_click", click)
from rich.console import Console

from planner.errors import PlannerError

class _OneLineErrors(typer.core.TyperGroup):
    """Click's usage errors (missing argument, unknown command, bad choice) as one ``error:`` line.

    Typer draws them as a multi-line box; a tool used in scripts and CI wants one greppable line
    that names what was expected and what to do, with click's exit code (2 for usage).
    """

    def main(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except _click.exceptions.ClickException as exc:
            hint = ""
            if getattr(exc, "ctx", None) is not None:
                path = exc.ctx.command_path
                hint = f"; expected usage: {exc.ctx.get_usage().replace('Usage: ', '')}; run '{path} --help'"
            message = " ".join(exc.format_message().split()).rstrip(".")
            typer.echo(f"error: {message}{hint}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    name="plan",
    help="Plan and run model-parallel (pipeline) training: profile a model, partition it over a cluster, "
    "check, show and run the plan.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

console = Console()
"""Human output (tables, progress). Machine output (``--json``) goes to plain stdout."""
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def command(*args: Any, **kwargs: Any) -> Callable[[F], F]:
    """Register a command on ``app`` and wrap it so that ``PlannerError`` becomes a one-line error."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def guarded(*a: Any, **kw: Any) -> Any:
            try:
                return fn(*a, **kw)
            except PlannerError as exc:
                fail(str(exc), exc.exit_code)
            except KeyboardInterrupt:
                fail("interrupted", 130)

        app.command(*args, **kwargs)(guarded)
        return fn

    return decorate


def fail(message: str, code: int = 1) -> None:
    """Print ``error: message`` as one line on stderr and exit with ``code``."""
    line = " ".join(str(message).split())
    typer.echo(f"error: {line}", err=True)
    raise typer.Exit(code)


def emit_json(data: Any) -> None:
    """Write machine-readable output to stdout."""
    import json

    write_stdout(json.dumps(data, indent=1) + "\n")


def write_stdout(text: str) -> None:
    """Write ``text`` to stdout whole.

    Under ``PYTHONUNBUFFERED`` (``python -u``) ``sys.stdout`` writes straight to the raw file, and CPython's text
    layer ignores how much of a write the file took. A write to a pipe that fills while a signal arrives takes only
    part: ``plan run --json`` under a slow reader lost all of its summary after the first 64 KiB, with exit code 0.
    So the bytes go to the raw file in a loop until every one is written."""
    stream = sys.stdout
    raw = getattr(stream, "buffer", None)
    if not isinstance(raw, io.RawIOBase):  # buffered (the default, or a test's capture): it writes everything
        stream.write(text)
        stream.flush()
        return
    stream.flush()
    data = memoryview(text.encode(stream.encoding or "utf-8"))
    while data:
        written = raw.write(data)
        if written is None:  # a non-blocking file that is full: wait until it takes more
            select.select([], [raw], [])
            continue
        data = data[written:]


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is at emit time (test runners swap it per invocation)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


_LOG_HANDLER = _CurrentStderr()
_LOG_HANDLER.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))


@app.callback()
def _root(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log progress details to stderr.")) -> None:
    logger = logging.getLogger("planner")
    if _LOG_HANDLER not in logger.handlers:
        logger.addHandler(_LOG_HANDLER)
    logger.setLevel(logging.INFO if verbose else logging.WARNING)
