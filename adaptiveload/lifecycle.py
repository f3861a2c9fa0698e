"""How a process ends when it is told to stop, so that it can say so on its way out.

Two pieces, both standard library only (the job shell uses them before anything else loads):

* `stop_on_signals`: SIGTERM and SIGHUP end the process through `SystemExit(128 + signal)`
  and SIGINT through `KeyboardInterrupt`, so `finally`/`except` blocks run (a training run
  marks its MLflow run FAILED). Only the first signal raises: a dying parent can deliver two
  SIGTERMs tens of milliseconds apart, and a second exception would interrupt the clean-up
  the first started. Later SIGTERMs and SIGHUPs are ignored; a SIGINT after the grace
  period interrupts the clean-up (a user pressing Ctrl-C again). SIGKILL always works.
* `die_with_parent`: ask Linux (`prctl(PR_SET_PDEATHSIG)`) for a signal when the parent
  dies, even by SIGKILL; returns False where that is not available.
* `adopt_orphans`: become the parent of this process's orphaned descendants (Linux,
  `prctl(PR_SET_CHILD_SUBREAPER)`), so it can wait for them after their parent died.
"""

from __future__ import annotations

import os
import signal
import sys
import time

REPEAT_SIGNAL_IGNORED_S = 10.0  # after the first stop signal, a SIGINT this soon is ignored
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def stop_on_signals(ignore_s: float = REPEAT_SIGNAL_IGNORED_S) -> None:
    """Turn the first SIGTERM/SIGHUP into SystemExit and SIGINT into KeyboardInterrupt. After
    it, SIGTERM and SIGHUP are ignored (`SIG_IGN`, which also holds while the interpreter
    shuts down), and SIGINT within `ignore_s` seconds is too; a later SIGINT interrupts the
    clean-up (the user pressing Ctrl-C again). Main thread only, as Python's handlers are."""
    first: list[float] = []

    def handler(signum: int, _frame: object) -> None:
        now = time.monotonic()
        if first and (signum != signal.SIGINT or now - first[0] < ignore_s):
            return  # the clean-up of the first signal is running: let it finish
        if not first:
            first.append(now)
            for other in (signal.SIGTERM, signal.SIGHUP):
                signal.signal(other, signal.SIG_IGN)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, handler)


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> bool:
    """Have the kernel send `signum` to this process when its parent exits (Linux). If the
    parent is already gone when the request takes effect, the signal is raised now: gone
    since this call, or, given `parent` (the pid of the process that started this one), gone
    before it (the process then has another parent already, which the kernel will not
    signal about). False where the request is not available (not Linux): the caller's docs
    say how to clean up."""
    import ctypes

    parent = os.getppid() if parent is None else parent
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        if libc.prctl(pr_set_pdeathsig, signum, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        signal.raise_signal(signum)
    return True


def adopt_orphans() -> bool:
    """Have the kernel make this process the parent of its descendants that lose theirs
    (`PR_SET_CHILD_SUBREAPER`), so that it can wait for and reap them; False where that is
    not available (not Linux)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_child_subreaper = 36
        return libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
