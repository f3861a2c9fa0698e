"""Atomic file writes: a reader (or a crashed writer) never sees a half-written result."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adaptiveload.errors import UserError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.replace(tmp_path, final)
    finally:
        tmp_path.unlink(missing_ok=True)


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """Parse a JSON file; a missing or malformed one is a UserError naming the file."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: {what} is not valid JSON ({exc})") from None


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def write_parquet(path: str | os.PathLike[str], frame: Any) -> None:
    """Write a pandas DataFrame as Parquet, atomically."""
    with atomic_path(path) as tmp:
        frame.to_parquet(tmp, index=False)


def _json_default(obj: Any) -> Any:
    # numpy scalars and arrays, Paths: the usual suspects in results dictionaries
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
