"""The routes the README gives beyond the CPU default, checked without a GPU or a cluster:
every experiment file dry-runs, fused runs wait for the kernel build, the SLURM profile passes
the pinned executor plugin's own checks, and `make run` loads the local profile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import ROOT
from workflow_setup import copy_workflow, snakemake

from adaptiveload import pipeline
from adaptiveload.experiment import load_layered

EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("routes"))


def user_inputs(cfg: dict) -> list[str]:
    """The paths of what the user brings (pipeline.USER_INPUTS) an experiment file names."""
    paths = (cfg[section].get(field) for section, field, _ in pipeline.USER_INPUTS)
    return [p for p in paths if p not in (None, "scratch")]


@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=lambda p: p.name)
def test_every_experiment_file_dry_runs(workflow_copy, experiment):
    rel = f"experiments/{experiment.name}"
    cfg = load_layered(experiment)
    for path in user_inputs(cfg):  # stand-ins: a dry run needs them to exist, no more
        (workflow_copy / path).parent.mkdir(parents=True, exist_ok=True)
        (workflow_copy / path).touch()
    out = snakemake(workflow_copy, "-n", "--configfile", rel, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if not (cfg["train"]["enabled"] and "fused" in cfg["model"]["kernels"]):
        return
    # every fused training job depends on the job that writes the kernel library's record
    dag = snakemake(workflow_copy, "--dag", "--configfile", rel, timeout=300)
    assert dag.returncode == 0, dag.stderr[-3000:]
    labels = dict(re.findall(r'^\s*(\d+)\[label = "([^"]*)"', dag.stdout, re.M))
    edges = set(re.findall(r"^\s*(\d+) -> (\d+)", dag.stdout, re.M))
    build = {n for n, label in labels.items() if label == "kernel_build"}
    fused = {n for n, label in labels.items()
             if label.startswith("train") and "kernel: fused" in label}
    assert len(build) == 1 and fused, labels
    assert all((next(iter(build)), n) in edges for n in fused)


def test_a_missing_user_input_is_refused_in_one_line(workflow_copy):
    """An experiment naming a manifest the user has not made yet stops before Snakemake
    builds a DAG, naming the file, the field and how to make it."""
    (workflow_copy / "experiments" / "mine.yaml").write_text(
        "name: mine\ndata: {manifest: data/not-made-yet/manifest.csv}\n")
    out = snakemake(workflow_copy, "-n", "--configfile", "experiments/mine.yaml", timeout=300)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    line = next(x for x in text.splitlines() if "does not exist" in x)
    assert line.startswith("experiments/mine.yaml: data.manifest: data/not-made-yet/manifest.csv")
    assert "adaptiveload manifest import" in line
    assert "MissingInputException" not in text


def test_default_profile_is_accepted(workflow_copy):
    out = snakemake(workflow_copy, "-n", "--profile", "workflow/profiles/default", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Using profile workflow/profiles/default" in out.stderr


def submitted(workdir: Path, *targets: str) -> dict[str, str]:
    """Run the real SLURM executor with the profile; sbatch records its command line and
    refuses, so nothing runs. Returns rule name -> sbatch arguments."""
    fake = workdir / "fakebin"
    fake.mkdir(exist_ok=True)
    (fake / "sbatch").write_text('#!/bin/sh\necho "$*" >> "$SBATCH_LOG"\necho refused >&2\n'
                                 "exit 1\n")
    (fake / "sacct").write_text("#!/bin/sh\nexit 0\n")  # no account to guess
    (fake / "sinfo").write_text("#!/bin/sh\nprintf 'PARTITION\\ncpu*\\ngpu\\n'\n")
    for tool in ("sbatch", "sacct", "sinfo"):
        (fake / tool).chmod(0o755)
    log = workdir / "sbatch.log"
    log.unlink(missing_ok=True)
    env = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}",
           "SBATCH_LOG": str(log)}
    out = subprocess.run(
        [sys.executable, "-m", "snakemake", "--profile", "workflow/profiles/slurm",
         "--configfile", "experiments/paper.yaml", "--rerun-triggers", "mtime", "--retries",
         "0", "--keep-going", "--slurm-init-seconds-before-status-checks", "1", *targets],
        cwd=workdir, env=env, capture_output=True, text=True, timeout=300,
    )
    text = out.stdout + out.stderr
    assert "sbatch failed" in text, text[-4000:]  # failed at sbatch, after the plugin's checks
    calls = log.read_text().splitlines()
    return {re.search(r"--comment rule_(\w+?)(_wildcards|\s)", c).group(1): c for c in calls}


def test_slurm_profile_submits_gpu_jobs_the_plugins_way(tmp_path):
    work = copy_workflow(tmp_path)
    res = "results/paper"
    have = [f"{res}/config.yaml", f"{res}/data/manifest.parquet"]
    for path in have:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).touch()
    first = submitted(work, f"{res}/calibration/calibration.json", "build/kernels/build.json")
    have += [f"{res}/calibration/calibration.json", f"{res}/plans/adaptiveload/seed0.json",
             f"{res}/tracking/store.ready", "build/kernels/build.json"]
    for path in have:
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).touch()
    second = submitted(work, f"{res}/runs/adaptiveload/seed0/fused/summary.json",
                       f"{res}/kernel/bench.csv")
    calls = {**first, **second}
    assert set(calls) == {"calibrate", "kernel_build", "train", "kernel_bench"}
    for rule in ("calibrate", "train", "kernel_bench"):
        assert " --gpus=1" in calls[rule] and "-p gpu" in calls[rule], calls[rule]
    build = calls["kernel_build"]  # the cluster's default partition, no GPU
    assert "-p cpu" in build and "--gpus" not in build and "--gres" not in build, build
    assert " -t 360 " in calls["train"] and "--mem 128000" in calls["train"]
    assert "--cpus-per-task=16" in calls["train"]
