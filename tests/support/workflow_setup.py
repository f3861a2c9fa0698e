"""The repository's workflow, run for real: a copy of what a user's checkout runs Snakemake
from, and Snakemake on it (the package itself is the installed one)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from repo_paths import ROOT, TINY


def snakemake(workdir: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env.update(OMP_NUM_THREADS="1", MLFLOW_ENABLE_TELEMETRY="false", DO_NOT_TRACK="1")
    return subprocess.run(
        [sys.executable, "-m", "snakemake", *args],
        cwd=workdir, capture_output=True, text=True, timeout=timeout, env=env,
    )


def copy_workflow(dest: Path) -> Path:
    """The files a user's checkout runs Snakemake from (the package itself is installed)."""
    shutil.copy(ROOT / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "experiments"):
        shutil.copytree(ROOT / folder, dest / folder)
    shutil.copy(TINY, dest / "experiments" / "tiny.yaml")
    return dest


def dry_run_jobs(dry_run: subprocess.CompletedProcess) -> dict[str, int]:
    """Rule -> job count of a dry run's "Job stats" table ({} for "Nothing to be done")."""
    text = dry_run.stdout + dry_run.stderr
    assert dry_run.returncode == 0, text[-3000:]
    table = re.search(r"Job stats:\n.*?\n-+\s+-+\n(.*?)\n\s*total", text, re.S)
    if table is None:
        assert "Nothing to be done" in text, text[-3000:]
        return {}
    rows = (line.split() for line in table.group(1).splitlines())
    return {rule: int(count) for rule, count in rows if rule != "all"}
