"""Faults never end in a false success: real processes stopped by real signals, real full and
read-only filesystems (tmpfs mounts, skipped where mounting is not permitted), a real sqlite
MLflow store. Each test backs one row of the fault table in docs/robustness.md."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fault_setup import (
    alive,
    descendants,
    wait_for,
)
from repo_paths import ROOT, TINY
from training_setup import cli_env

from adaptiveload.io import LockHeld, exclusive

# -- stop signals ---------------------------------------------------------------------------
_CLEANUP = """
import sys, time
from pathlib import Path
from adaptiveload.lifecycle import stop_on_signals
stop_on_signals()
marker = Path(sys.argv[1])
try:
    marker.write_text("ready")
    time.sleep(60)
finally:
    time.sleep(0.5)  # a clean-up that takes a while, as finishing an MLflow run does
    marker.write_text("cleaned up")
"""


def test_a_second_sigterm_does_not_interrupt_the_clean_up_of_the_first(tmp_path):
    """A dying parent delivers two SIGTERMs tens of milliseconds apart: only the first ends
    the process, so the clean-up it starts completes."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", _CLEANUP, str(marker)], env=cli_env())
    wait_for(lambda: marker.exists(), proc, timeout=60)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.03)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert marker.read_text() == "cleaned up"


# -- one writer per run folder --------------------------------------------------------------
_HOLD = """
import sys, time
from adaptiveload.io import exclusive
with exclusive(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_folder_lock_is_exclusive_and_a_killed_holder_keeps_nothing(tmp_path):
    lock = tmp_path / "run" / ".train.lock"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)], env=cli_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockHeld) as held, exclusive(lock):
            pass
        assert f"pid {holder.pid} " in held.value.holder
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with exclusive(lock):  # the kernel released the dead holder's lock
        assert lock.exists()
    assert not lock.exists()  # the last holder removes the file


# -- the pipeline's job shell ---------------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_job_and_everything_it_started_die_with_its_killed_parent(tmp_path):
    """`adaptiveload-job -c "a & b; wait"` as Snakemake starts it: SIGKILL the parent and
    both commands go, within the job shell's grace period, instead of running on."""
    shell = Path(sys.executable).parent / "adaptiveload-job"
    parent_code = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen([{str(shell)!r}, '-c', 'sleep 300 & sleep 301; wait'])\n"
        "print(p.pid, flush=True)\n"
        "p.wait()\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE,
                              text=True)
    job = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while len([p for p in descendants(job) if b"sleep" in Path(f"/proc/{p}/cmdline")
               .read_bytes()]) < 2:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.05)
    started = [job, *descendants(job)]
    parent.kill()
    parent.wait()
    try:
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in started if alive(p)]
    finally:
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_every_rule_of_the_workflow_runs_in_the_job_shell():
    """Shell and script jobs run through `adaptiveload-job`; a `run:` block would run in a
    process of Snakemake's own that outlives a killed Snakemake."""
    rules = sorted((ROOT / "workflow" / "rules").glob("*.smk"))
    assert rules
    for path in rules:
        assert not re.search(r"^\s+run:\s*$", path.read_text(), re.M), path.name


def test_the_job_shell_exits_with_the_status_of_its_command(tmp_path):
    shell = str(Path(sys.executable).parent / "adaptiveload-job")
    assert subprocess.run([shell, "-c", "exit 3"]).returncode == 3
    done = subprocess.run([shell, "-c", "set -euo pipefail; false | cat; echo no"],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "no" not in done.stdout
    assert subprocess.run([shell, "-c", "kill -TERM $$"]).returncode == 128 + signal.SIGTERM


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_every_job_gets_the_grace_to_clean_up_when_stopped(tmp_path, signum):
    """A job bash does not `exec` (two commands: the rules' `set -euo pipefail; ...`): bash
    dies at once on the signal, and its command still finishes its clean-up (as `analyze
    record` deletes its unfinished run) before the job shell ends; before, the job shell
    SIGKILLed it as soon as bash was gone."""
    shell = str(Path(sys.executable).parent / "adaptiveload-job")
    marker = tmp_path / "marker"
    command = f"set -euo pipefail; {sys.executable} -c '{_CLEANUP}' {marker}; true"
    job = subprocess.Popen([shell, "-c", command], env=cli_env())
    wait_for(lambda: marker.exists(), job, timeout=60)
    job.send_signal(signum)
    assert job.wait(timeout=60) == 128 + signum
    assert marker.read_text() == "cleaned up"


# -- stage views: a stage depends on the fields it reads --------------------------------------
def test_a_stage_view_holds_exactly_what_its_stage_reads(tmp_path):
    """Each stage configured from its view gets the settings it gets from the whole
    experiment; a field outside the view is absent (a stage reading it fails loudly, never
    with a silent default)."""
    from adaptiveload import experiment, pipeline
    from adaptiveload.calibration.settings import CalibrationConfig
    from adaptiveload.training.settings import from_experiment

    full = experiment.load(TINY)
    views = {}
    for stage in pipeline.STAGE_FIELDS:
        path = tmp_path / f"{stage}.yaml"
        path.write_text(yaml.safe_dump(pipeline.stage_view(full, stage)))
        views[stage] = experiment.load(path)
    assert CalibrationConfig.from_experiment(views["calibrate"]) == (
        CalibrationConfig.from_experiment(full)
    )
    ranks = {"launch_mode": "emulated", "world_size": 2, "kernel": "eager"}
    assert from_experiment(views["train"], "adaptiveload", 0, **ranks) == (
        from_experiment(full, "adaptiveload", 0, **ranks)
    )
    assert views["paper_map"]["paper_map"] == full["paper_map"]
    for stage, view in views.items():
        assert "description" not in view and "analysis" not in view, stage
    assert "steps" not in views["calibrate"]["train"]
    with pytest.raises(KeyError):
        views["train"]["simulate"]
