"""The repository's workflow, run for real: a copy of what a user's checkout runs Snakemake
from, and Snakemake on it (the package itself is the installed one)."""

from __future__ import annotations

import os
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
