"""Atomic file writes: a reader (or a crashed writer) never sees a half-written result.

Files get the mode an ordinary `open(path, "w")` would give them (0666 minus the umask), not
mkstemp's private 0600, so colleagues sharing a results folder can read them. Files are read
only when they are regular files (`regular_file`): a FIFO or a device would block `open` or
stream forever, past any signal a reader waits for.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from adaptiveload.errors import UserError


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it onto `path` only if the block succeeds.

    A write the disk refuses (full, read-only, over quota) is a UserError naming `path` and
    the fix, and leaves neither the temporary nor a changed `path` behind."""
    final = Path(path)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    except OSError as exc:
        raise _refused(final, exc) from None
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, final)
    except OSError as exc:
        raise _refused(final, exc) from None
    finally:
        tmp_path.unlink(missing_ok=True)


# what a disk says when it refuses a write, and what the user does about it
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


def write_failure(path: str | os.PathLike[str], exc: OSError) -> str | None:
    """The one-line message for a write to `path` the disk refused (`exc`): what happened and
    the fix; None if `exc` is not such a refusal (a bug, to be reported as it is)."""
    folder = Path(path).parent
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno in DISK_FULL:
        fix = f"free space on the disk that holds {folder} (`df -h {folder}`) and run it again"
    elif exc.errno in NOT_WRITABLE:
        fix = f"make {folder} writable (or write the results elsewhere) and run it again"
    else:
        return None
    return f"{path}: cannot write it ({reason}); {fix}"


def _refused(path: Path, exc: OSError) -> OSError | UserError:
    message = write_failure(path, exc)
    return exc if message is None else UserError(message)


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


class LockHeld(Exception):
    """`exclusive` without waiting found the lock taken; `holder` says by whom, as the holder
    wrote it into the lock file (pid, host, command), or that it could not be read."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path}: held by {holder}")
        self.path, self.holder = path, holder


@contextlib.contextmanager
def exclusive(path: str | os.PathLike[str], wait: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created, with its folder, if missing) for
    the block; `wait`: block until it is free, else raise LockHeld at once.

    The lock is the kernel's (`flock`): a holder that dies, even by SIGKILL, releases it, so
    a dead process never keeps a folder. The holder writes its pid, host and command into
    the file for the message of whoever is refused, and removes the file when it is done (a
    process that locked a file just unlinked retries on the new one). POSIX only: elsewhere
    the block runs unlocked.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no flock
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fh = open(path, "a+")  # noqa: SIM115 - held open for the whole block
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            fh.seek(0)
            holder = " ".join(fh.read().split()) or "another process"
            fh.close()
            raise LockHeld(path, holder) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        fh.close()  # locked a file its holder had just removed: take the new one
    try:
        with contextlib.suppress(OSError):  # who holds it is for messages only (a full disk)
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} on {socket.gethostname()}: {' '.join(sys.argv)[:300]}\n")
            fh.flush()
        yield
    finally:
        path.unlink(missing_ok=True)
        fh.close()


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """Parse a JSON file; a missing or malformed one is a UserError naming the file."""
    try:
        return json.loads(read_text(path, what))
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: {what} is not valid JSON ({exc})") from None


def regular_file(
    path: str | os.PathLike[str], what: str = "file", root: str | os.PathLike[str] | None = None
) -> Path:
    """`path`, checked before anything opens it: a regular file (not a FIFO, socket or device,
    whose `open` can block forever) and, given `root`, inside `root` once links and `..` are
    resolved (a name in a checkpoint index or a manifest must not reach files elsewhere).
    UserError otherwise, naming the file; a missing file is left to the opener's message."""
    path = Path(path)
    if root is not None:
        resolved, base = Path(os.path.realpath(path)), Path(os.path.realpath(root))
        if not resolved.is_relative_to(base):
            raise UserError(f"{path}: {what} resolves to {resolved}, outside {base}; "
                            "keep the files it names inside that folder")
    with contextlib.suppress(FileNotFoundError):
        mode = os.stat(path).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UserError(f"{path}: {what} is not a regular file (a FIFO, socket or device); "
                            "give a file")
    return path


def read_text(path: str | os.PathLike[str], what: str = "file") -> str:
    """A UTF-8 text file's content; missing, a directory, a FIFO or device, unreadable or
    binary is a UserError."""
    path = regular_file(path, what)
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


def read_table(path: str | os.PathLike[str], what: str, fix: str) -> Any:
    """A CSV (by its suffix) or else Parquet table as a pandas DataFrame. Missing, a folder or
    unreadable (truncated by a full disk, corrupted, not a table) is a UserError naming the
    file, with `fix`, what the user does about it, after the reason."""
    import pandas as pd

    path = regular_file(path, what)
    if path.is_dir():  # pyarrow would read it as an (empty) dataset
        raise UserError(f"{path}: {what} (a file) expected, found a directory")
    try:
        return pd.read_csv(path) if path.suffix.lower() == ".csv" else pd.read_parquet(path)
    except FileNotFoundError:
        raise UserError(f"{path}: {what} not found; {fix}") from None
    except Exception as exc:  # parsers raise many library-specific types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(f"{path}: {what} cannot be read ({first}); {fix}") from None


def write_text(path: str | os.PathLike[str], text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def json_text(obj: Any) -> str:
    """`obj` as the JSON files of this package are written (indented, numpy values as numbers)."""
    return json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n"


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    write_text(path, json_text(obj))


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
