"""Reading and atomically writing the JSON (and YAML) files of the file contracts."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from planner.errors import InputFileError, PlannerError


def read_document(path: str | Path, what: str) -> dict[str, Any]:
    """Read a JSON (or, by extension, YAML) object from ``path``; ``what`` names it in errors."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputFileError(f"{what} file {str(path)!r} does not exist; pass the path of an existing {what} file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputFileError(f"cannot read {what} file {str(path)!r}: {exc}; check the path and its permissions") from None
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.load(text, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
        else:
            data = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError or yaml.YAMLError
        detail = str(exc).splitlines()[0]
        raise InputFileError(f"{what} file {str(path)!r} is not valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'JSON'} ({detail}); regenerate it or fix the syntax") from None
    if not isinstance(data, dict):
        raise InputFileError(f"{what} file {str(path)!r} must hold a JSON object at the top level, found {type(data).__name__}")
    return data


def _yaml_loader() -> Any:
    """PyYAML's SafeLoader, reading floats as YAML 1.2 and JSON do.

    PyYAML follows YAML 1.1, where ``12.0e9`` and ``1e9`` (no sign in the exponent) are strings; a
    hand-written cluster file means numbers there. The added resolver takes any decimal float.
    """
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$|^[-+]?[0-9][0-9_]*\.[0-9_]*$"),
        list("-+0123456789."))
    return Loader


def check_writable(path: str | Path, what: str = "output") -> Path:
    """Fail early, before any expensive work, when ``path`` cannot be written."""
    path = Path(path)
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise PlannerError(f"{what} path {str(path)!r} is a directory; expected a file path such as {str(path / 'out.json')!r}")
    if not parent.is_dir():
        raise PlannerError(f"cannot write {what} {str(path)!r}: directory {str(parent)!r} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise PlannerError(f"cannot write {what} {str(path)!r}: directory {str(parent)!r} is not writable; choose another path")
    return path


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented UTF-8 JSON via a temporary file and rename, so readers never see half a file."""
    path = check_writable(path)
    text = json.dumps(data, indent=1, sort_keys=False, ensure_ascii=False) + "\n"
    write_bytes_atomic(path, text.encode("utf-8"))
    return path


def write_bytes_atomic(path: str | Path, payload: bytes) -> Path:
    """Write ``payload`` to ``path`` atomically (temp file in the same directory, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file the usual mode
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise PlannerError(f"cannot write {str(path)!r}: {exc}; choose another path") from None
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def to_plain(value: Any) -> Any:
    """Mapping proxies and tuples (as the frozen formats hold them) back to JSON-ready dicts and lists."""
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return value
