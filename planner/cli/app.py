"""The typer application and the one boundary where library errors become one-line messages.

Commands only gather options, call one library function and render; ``@command`` turns a
``PlannerError`` into ``error: <message>`` on stderr with the error's exit code, never a traceback.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable, TypeVar

import typer
from rich.console import Console

from planner.errors import PlannerError

app = typer.Typer(
    name="plan",
    help="Plan and run model-parallel (pipeline) training: profile a model, partition it over a cluster, "
    "check, show and run the plan.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
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

    sys.stdout.write(json.dumps(data, indent=1) + "\n")
    sys.stdout.flush()


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
