"""One error hierarchy. Every message says what was expected, what was found, and what to do.

The CLI turns any ``PlannerError`` into a single line on stderr and a non-zero exit code;
anything else escaping the library is a bug.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error the library raises on bad input or an impossible request."""

    exit_code: int = 1


class UsageError(PlannerError):
    """Bad command-line usage: unknown option values, malformed specs."""

    exit_code = 2


class InputFileError(PlannerError):
    """A file that is missing, unreadable, malformed, or of the wrong schema version."""


class ModelError(PlannerError):
    """A model spec that cannot be imported, a factory that raises, or a model that cannot be traced."""


class CaptureError(ModelError):
    """Neither tracer could capture the model's graph."""


class InfeasibleError(PlannerError):
    """No plan satisfies the constraints (usually memory)."""


class PlanMismatchError(PlannerError):
    """A plan that does not match its profile, cluster or model."""


class DistributedError(PlannerError):
    """A distributed job that cannot start or continue (wrong world size, a rank that stopped answering)."""


class Interrupted(PlannerError):
    """The user interrupted a command (Ctrl-C, SIGTERM); the shell's code for SIGINT."""

    exit_code = 130

