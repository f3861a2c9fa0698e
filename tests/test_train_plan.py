"""A run executes the plan `adaptiveload plan` wrote (what the pipeline's train rule passes as
--plan), or refuses before writing anything; and its ranks come from one place."""

from __future__ import annotations

from pathlib import Path

import pytest
from training_setup import ROOT, adaptiveload, cli_env, write_experiment

from adaptiveload import experiment
from adaptiveload.data.manifest import write_manifest
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.io import read_json
from adaptiveload.training.distributed import Ranks, resolve_ranks
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


@pytest.mark.slow
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


def test_ranks_are_resolved_from_torchrun_else_the_flag_else_the_config(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resolve_ranks(None, 4) == Ranks.emulated(4) == Ranks(4, (0, 1, 2, 3), False)
    assert resolve_ranks(2, 4) == Ranks.emulated(2)
    assert resolve_ranks(2, 4).launch_mode == "emulated"
    with pytest.raises(UserError, match="--emulate-world-size 0"):
        resolve_ranks(0, 4)

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ranks = resolve_ranks(None, 4)
    assert ranks == Ranks(2, (1,), True, process_rank=1, local_rank=1)
    assert ranks.launch_mode == "distributed" and not ranks.is_main
    with pytest.raises(UserError, match="not with torchrun"):
        resolve_ranks(2, 4)


def test_a_run_says_what_its_ln_modulate_sites_executed():
    """`ln_modulate_impl` (tag and summary): eager is eager; fused is the CUDA kernel only on
    CUDA with the library loaded, else the op's reference math, which `session.resolve`
    refuses on CUDA so that a fused GPU row never measures reference math."""
    from adaptiveload.ops import ln_modulate as lm
    from adaptiveload.training.settings import TrainConfig
    from adaptiveload.training.summary import ln_modulate_impl

    def impl(kernel: str, device: str) -> str:
        cfg = TrainConfig("e", "adaptiveload", 0, "wan2.1-micro", kernel=kernel, device=device)
        return ln_modulate_impl(cfg)

    assert impl("eager", "cpu") == impl("eager", "cuda") == "eager"
    assert impl("fused", "cpu") == "reference math"
    assert impl("fused", "cuda") == ("cuda kernel" if lm.fused_available() else "reference math")
