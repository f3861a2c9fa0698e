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
import yaml
from workflow_setup import REPO, copy_workflow, snakemake

from adaptiveload.experiment import load_layered

EXPERIMENTS = sorted((REPO / "experiments").glob("*.yaml"))


@pytest.fixture(scope="module")
def workflow_copy(tmp_path_factory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("routes"))


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS, ids=lambda p: p.name)
def test_every_experiment_file_dry_runs(workflow_copy, experiment):
    rel = f"experiments/{experiment.name}"
    out = snakemake(workflow_copy, "-n", "--configfile", rel, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    cfg = load_layered(experiment)
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


def test_make_run_loads_the_default_profile():
    """The README says `make run` uses workflow/profiles/default: the Makefile passes it."""
    out = subprocess.run(["make", "-n", "run"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "bin/snakemake" in ln]
    assert "--profile workflow/profiles/default" in line


@pytest.mark.slow
def test_default_profile_is_accepted(workflow_copy):
    out = snakemake(workflow_copy, "-n", "--profile", "workflow/profiles/default", timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Using profile workflow/profiles/default" in out.stderr


# ------------------------------------------------------------------ SLURM, without a cluster
def test_slurm_plugin_is_the_pinned_one():
    from importlib.metadata import version

    pyproject = (REPO / "pyproject.toml").read_text()
    (pin,) = re.findall(r'"snakemake-executor-plugin-slurm==([^"]+)"', pyproject)
    assert version("snakemake-executor-plugin-slurm") == pin


def test_the_plugin_refuses_gpus_in_slurm_extra():
    """The failure the profile avoids: the plugin's own check rejects --gres in slurm_extra."""
    from types import SimpleNamespace

    from snakemake_executor_plugin_slurm.validation import validate_slurm_extra
    from snakemake_interface_common.exceptions import WorkflowError

    with pytest.raises(WorkflowError, match="GRES"):
        validate_slurm_extra(SimpleNamespace(resources=SimpleNamespace(
            slurm_extra="'--gres=gpu:1'")))
    profile = yaml.safe_load((REPO / "workflow/profiles/slurm/config.yaml").read_text())
    for res in profile["set-resources"].values():
        validate_slurm_extra(SimpleNamespace(resources=SimpleNamespace(**res)))


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


@pytest.mark.slow
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


# ------------------------------------------------------------------ what paper scale costs
@pytest.mark.parametrize(("name", "limit"), [("paper.yaml", None), ("paper_1gpu.yaml", 2.0)])
def test_stated_gpu_hours_are_the_computed_ones(gpu_script, name, limit):
    """The cost an experiment file states is what gpu_hours computes (so it cannot drift)."""
    experiment_cost = gpu_script("gpu_hours").experiment_cost

    path = REPO / "experiments" / name
    (stated,) = re.findall(r"^# Cost: ([\d.]+) GPU-hours on one H200", path.read_text(), re.M)
    cost = experiment_cost(path)
    decimals = len(stated.partition(".")[2])
    assert f"{cost['gpu_hours']:.{decimals}f}" == stated, cost["gpu_hours"]
    assert cost["source"].startswith("model from measured (cuda:NVIDIA H200)")
    if limit is not None:
        assert cost["gpu_hours"] <= limit


def test_step_times_follow_the_measured_points(gpu_script):
    gpu_hours = gpu_script("gpu_hours")
    H200_CALIBRATION, StepTimes = gpu_hours.H200_CALIBRATION, gpu_hours.StepTimes

    times = StepTimes.from_calibration(H200_CALIBRATION)
    for tokens, seconds in zip(times.tokens, times.seconds, strict=True):
        assert float(times.t1(tokens)) == pytest.approx(seconds)
    # the unmeasured 75,600-token B = 1 step (1.5x the tokens of the last measured point):
    # between linear (1.5x the time) and pure attention (1.5^2 = 2.25x) growth
    assert 1.5 * times.t1(50400) < times.t1(75600) < 2.25 * times.t1(50400)
    assert 0 < times.fixed_s < times.t1(1560)  # the batch-independent part of a step
    assert times.micro_batch(2, 16380) == pytest.approx(2 * times.t1(16380) - times.fixed_s)
