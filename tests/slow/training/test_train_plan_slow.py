"""A run executes the plan `adaptiveload plan` wrote (what the pipeline's train rule passes as
--plan), or refuses before writing anything; and its ranks come from one place."""

from __future__ import annotations

from pathlib import Path

import pytest
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, write_experiment

from adaptiveload import experiment
from adaptiveload.data.manifest import write_manifest
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.io import read_json
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.settings import from_experiment


def _plan(tmp_path: Path, exp: dict, manifest: Path, world_size: int) -> Path:
    """The plan summary `adaptiveload plan` writes from the experiment's settings, as
    workflow/rules/plan.smk passes them."""
    data, budgets = exp["data"], exp["budgets"]
    summary = tmp_path / f"plan-n{world_size}.json"
    made = adaptiveload(
        "plan", "--manifest", str(manifest), "--policy", "adaptiveload", "--seed", "0",
        "--world-size", str(world_size), "--bucketing", data["bucketing"], "--grid", data["grid"],
        "--max-frames", str(data["max_frames"]), "--m-tok", str(budgets["m_tok"]),
        "--m-mem", str(budgets["m_mem"]), "--m-comp", str(budgets["m_comp"]),
        "--p", str(budgets["p"]), "-o", str(tmp_path / f"plan-n{world_size}.parquet"),
        "--summary", str(summary), env=cli_env(), cwd=ROOT,
    )
    assert made.returncode == 0, made.stderr
    return summary


def test_run_checks_its_plan_against_the_pipelines(tmp_path):
    exp = experiment.load(write_experiment(tmp_path))
    manifest = tmp_path / "manifest.parquet"
    write_manifest(manifest, synthesize("tiny-cpu", 120, 0))
    cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=3)

    same = _plan(tmp_path, exp, manifest, world_size=3)
    data = prepare_data(exp, cfg, manifest=manifest, plan=same)
    assert data.builder(0).summary["plan_digest"] == read_json(same)["plan_digest"]

    other = _plan(tmp_path, exp, manifest, world_size=2)
    with pytest.raises(UserError) as info:
        prepare_data(exp, cfg, manifest=manifest, plan=other)
    message = str(info.value)
    assert message.startswith(f"{other}: field world_size is 2 but this run plans 3")
    assert "\n" not in message and "--plan" in message
