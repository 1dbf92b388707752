"""Small helpers for hand-written validators: each names the file, the field and the rule that broke."""

from __future__ import annotations

from typing import Any

from planner.errors import InputFileError


class Checker:
    """Collects context (``what`` = file kind and path) for one-line validation errors."""

    def __init__(self, what: str, hint: str = "regenerate the file") -> None:
        self.what = what
        self.hint = hint
        """The advice for a broken field: files the tool writes say regenerate; hand-written ones say fix."""

    def fail(self, field: str, expected: str, found: Any, hint: str | None = None) -> None:
        raise InputFileError(f"{self.what}: field {field!r} must be {expected}, found {_short(found)}; "
                             f"{hint or self.hint}")

    def get(self, obj: dict[str, Any], key: str, kind: type | tuple[type, ...], field: str | None = None) -> Any:
        field = field or key
        if key not in obj:
            self.fail(field, f"present ({_kind_name(kind)})", "nothing")
        value = obj[key]
        if not _is(value, kind):
            self.fail(field, f"a {_kind_name(kind)}", value)
        return value

    def opt(self, obj: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any, field: str | None = None) -> Any:
        if key not in obj:
            return default
        return self.get(obj, key, kind, field)

    def non_negative(self, value: float, field: str) -> None:
        if value < 0:
            self.fail(field, "non-negative", value)

    def schema_version(self, obj: dict[str, Any], supported: int) -> int:
        version = obj.get("schema_version")
        if version != supported:
            raise InputFileError(
                f"{self.what}: schema_version must be {supported}, found {_short(version)}; "
                f"regenerate the file with this version of planner"
            )
        return supported


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        return False
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return True
    return isinstance(value, kinds)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {int: "integer", float: "number", str: "string", list: "list", dict: "object", bool: "boolean"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
