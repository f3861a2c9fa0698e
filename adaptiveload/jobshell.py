"""`adaptiveload-job`: the shell the pipeline runs every job in, so that no job outlives a
killed Snakemake.

Snakemake starts each shell job as `<shell> -c "<command>"`; the Snakefile names this program
as that shell (`shell.executable`). It runs the command with bash, in a process group of its
own, and

* asks the kernel for SIGTERM when its parent (Snakemake) exits, even by SIGKILL (Linux,
  `lifecycle.die_with_parent`), and starts nothing if Snakemake died while this program was
  starting (it is not its parent any more; Snakemake exports its pid as `PARENT_ENV`);
* passes SIGTERM, SIGINT and SIGHUP on to the whole group (bash and everything it started:
  a compiler, both commands of an `a && b`) and waits for the group to end, up to
  `KILL_AFTER_S` seconds, then SIGKILLs what is left, so a job that ignores them cannot linger
  either. Every job gets that grace, not only one that bash `exec`s: bash itself dies at
  once on SIGTERM, and the commands it started (`adaptiveload analyze record` deleting its
  unfinished MLflow run) are waited for as its orphans, which this program adopts
  (`lifecycle.adopt_orphans`) and reaps;
* exits with bash's status, or 128 + n after signal n, as a shell does.

A job started by Snakemake through plain bash would instead keep running, unobserved, and
write its outputs beside a rerun's. It imports only the standard library and
`adaptiveload.lifecycle`: it starts before every job.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import NoReturn

from adaptiveload.lifecycle import STOP_SIGNALS, adopt_orphans, die_with_parent

# seconds a stopped job gets to end cleanly (a trainer marks its MLflow run FAILED) before SIGKILL
KILL_AFTER_S = 30
PARENT_ENV = "ADAPTIVELOAD_JOB_PARENT"  # the pid of the Snakemake that starts the jobs


def main() -> NoReturn:
    """Run `bash ARGS...` (what Snakemake passes: `-c COMMAND`) as described above."""
    group: list[int] = []  # the job's process group, once started
    stopped: list[int] = []  # the stop signal received, if any

    def stop(signum: int, _frame: object) -> None:
        if not stopped:
            stopped.append(signum)
            signal.alarm(KILL_AFTER_S)
        _signal_group(group, signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, stop)
    signal.signal(signal.SIGALRM, lambda _s, _f: _signal_group(group, signal.SIGKILL))
    parent = os.environ.get(PARENT_ENV, "")
    die_with_parent(signal.SIGTERM, int(parent) if parent.isdigit() else None)
    if stopped:  # Snakemake is gone already: start nothing
        sys.exit(128 + stopped[0])
    adopt_orphans()
    bash = shutil.which("bash") or "/bin/bash"
    job = subprocess.Popen([bash, *sys.argv[1:]], start_new_session=True)
    group.append(job.pid)
    if stopped:  # stopped while starting it
        _signal_group(group, stopped[0])
    code = job.wait()
    if stopped:  # the job's commands finish their clean-up (SIGALRM: SIGKILL at the deadline)
        _wait_for_group(job.pid)
    sys.exit(128 - code if code < 0 else code)


def _wait_for_group(pgid: int) -> None:
    """Until no process of group `pgid` is left, reaping the adopted ones as they end."""
    while True:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:  # a member changed its user: not ours to wait for
            return
        time.sleep(0.05)


def _signal_group(group: list[int], signum: int) -> None:
    if group:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group[0], signum)
