"""The routes the README gives beyond the CPU default, checked without a GPU or a cluster:
every experiment file dry-runs, fused runs wait for the kernel build, the SLURM profile passes
the pinned executor plugin's own checks, and `make run` loads the local profile."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from repo_paths import ROOT


def test_make_run_loads_the_default_profile():
    """The README says `make run` uses workflow/profiles/default: the Makefile passes it."""
    out = subprocess.run(["make", "-n", "run"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (line,) = [ln for ln in out.stdout.splitlines() if "bin/snakemake" in ln]
    assert "--profile workflow/profiles/default" in line


# ------------------------------------------------------------------ SLURM, without a cluster
def test_slurm_plugin_is_the_pinned_one():
    from importlib.metadata import version

    pyproject = (ROOT / "pyproject.toml").read_text()
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
    profile = yaml.safe_load((ROOT / "workflow/profiles/slurm/config.yaml").read_text())
    for res in profile["set-resources"].values():
        validate_slurm_extra(SimpleNamespace(resources=SimpleNamespace(**res)))


# ------------------------------------------------------------------ what paper scale costs
@pytest.mark.parametrize(("name", "limit"), [("paper.yaml", None), ("paper_1gpu.yaml", 2.0)])
def test_stated_gpu_hours_are_the_computed_ones(gpu_script, name, limit):
    """The cost an experiment file states is what gpu_hours computes (so it cannot drift)."""
    experiment_cost = gpu_script("gpu_hours").experiment_cost

    path = ROOT / "experiments" / name
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
