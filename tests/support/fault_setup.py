"""Real faults for the fault tests: a small filesystem that fills up, one that turns read-only,
a file made immutable, processes stopped by real signals, a planted malicious checkpoint. No
mocks: a full disk is a tmpfs of a few hundred KiB.

Mounting needs root (CAP_SYS_ADMIN); where it is not permitted the tests that need a mount
skip with the reason, and the disk-full code paths keep a test that needs none
(`limited_writer`: RLIMIT_FSIZE makes the kernel refuse a write past the limit, as a full disk
refuses it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import resource
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int) -> Iterator[Path]:
    """A tmpfs of `size_kib` KiB mounted at `path` (created) for the block; skips the test
    where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[Path]:
    """`chattr +i path` for the block: the file reads but even root cannot write it (a
    store the user may not write); skips where the filesystem or user cannot set it."""
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"chattr +i is not permitted here: {done.stderr.strip()[:200]}")
    try:
        yield path
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def fill(path: Path, leave_bytes: int = 0) -> None:
    """Fill the filesystem of `path` up to `leave_bytes` free, with one file `filler`."""
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(path / "filler", "wb") as fh, contextlib.suppress(OSError):
        fh.write(b"\0" * max(free - leave_bytes, 0))


def read_only(path: Path) -> None:
    """Remount the tmpfs at `path` read-only (its files stay, writes fail with EROFS); no
    process may hold a file there open for writing."""
    done = subprocess.run(["mount", "-o", "remount,ro", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def limited_writer(max_bytes: int):
    """A `preexec_fn` for subprocess: the child may write no file past `max_bytes` (the write
    fails with EFBIG instead of killing the process with SIGXFSZ)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def wait_for(condition: Callable[[], bool], proc: subprocess.Popen, timeout: float = 300) -> None:
    """Poll `condition` until it holds while `proc` runs (fails if `proc` ends first)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the process ended early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children of any of its threads: Snakemake starts jobs from
    worker threads)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in children.read_text().split()]
    return found + [d for c in found for d in descendants(c)]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


class _Payload:
    """Unpickling this writes `marker`: what an attacker's ckpt-*.pt would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def plant_checkpoint(path: Path, marker: Path) -> None:
    """A checkpoint file at `path` that writes `marker` if anything unpickles it."""
    from adaptiveload.training import checkpoint

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps({"format": checkpoint.FORMAT_VERSION, "x": _Payload(marker)}))
