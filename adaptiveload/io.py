"""Atomic file writes: a reader (or a crashed writer) never sees a half-written result.

Files get the mode an ordinary `open(path, "w")` would give them (0666 minus the umask), not
mkstemp's private 0600, so colleagues sharing a results folder can read them.
"""

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
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, final)
    finally:
        tmp_path.unlink(missing_ok=True)


def _umask() -> int:
    """The process umask: from /proc on Linux, else by setting it and putting it straight back
    (which a thread creating a file in between would see)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_temporaries(directory: str | os.PathLike[str], name_glob: str = "*") -> list[Path]:
    """Delete what killed writers left of `atomic_path` (`.<name>.*.tmp`) in `directory`.

    Call it on start-up, from the one process that owns the folder: a live writer's
    temporary looks the same.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    stale = sorted(directory.glob(f".{name_glob}.*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """Parse a JSON file; a missing or malformed one is a UserError naming the file."""
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: {what} is not valid JSON ({exc})") from None


def read_text(path: str | os.PathLike[str], what: str = "file") -> str:
    """A UTF-8 text file's content; missing, a directory, unreadable or binary is a UserError."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found") from None
    except IsADirectoryError:
        raise UserError(f"{path}: {what} expected, found a directory") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: {what} is not UTF-8 text (a binary file?)") from None
    except OSError as exc:
        raise UserError(f"{path}: {what} cannot be read ({exc.strerror})") from None


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
