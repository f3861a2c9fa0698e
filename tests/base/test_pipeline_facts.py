"""What the workflow rules and the package share (adaptiveload.pipeline): the layout of an
experiment's files, the names of sweep points, the ranks one process may emulate, the run
index; the rules call these, so a command run by hand lands where the pipeline looks."""

from __future__ import annotations

import re

import pytest

from adaptiveload import experiment, pipeline
from adaptiveload.errors import UserError
from adaptiveload.training.session import Request, resolve


def test_layout_gives_patterns_and_paths():
    out = pipeline.Layout("p_sweep")
    assert out.run_dir("{policy}", "{seed}", "{kernel}") == (
        "results/p_sweep/runs/{policy}/seed{seed}/{kernel}"
    )
    assert out.sim_dir("h200", "p=1.4", "adaptiveload", 2) == (
        "results/p_sweep/sim/h200/p=1.4/adaptiveload/seed2"
    )
    assert out.tables == "results/p_sweep/tables"
    assert pipeline.Layout("default").figures == "results/figures"  # published at the top
    assert out.plan("equal-token", 0) == "results/p_sweep/plans/equal-token/seed0.json"


def test_a_hand_run_lands_in_the_pipelines_run_folder(tmp_path, monkeypatch):
    path = tmp_path / "x.yaml"
    path.write_text("name: hand\ntrain: {world_size: 2, steps: 2, warmup_steps: 1}\n")
    monkeypatch.delenv("RANK", raising=False)
    out = resolve(Request(config=path, policy="adaptiveload", seed=3)).out
    assert str(out) == pipeline.Layout("hand").run_dir("adaptiveload", 3, "eager")


def test_variants_name_every_sweep_point_and_parse_back():
    sweeps = {"p": [1.2, 1.5], "m_comp_scale": [0.5], "world_sizes": [64], "mixtures": ["x"]}
    names = pipeline.variants(sweeps)
    assert names == ["base", "p=1.2", "p=1.5", "m_comp=0.5", "world_size=64", "mixture=x"]
    assert [pipeline.parse_variant(v) for v in names[:2]] == [("", ""), ("p", "1.2")]
    sim = {"world_size": 16, "mixture": "paper-mixed"}
    assert pipeline.sweep_point(sim, "world_size=64") == pipeline.SweepPoint(64, "paper-mixed")
    assert pipeline.sweep_point(sim, "mixture=x").mixture == "x"
    assert pipeline.sweep_point(sim, "m_comp=0.5").m_comp_scale == 0.5
    assert pipeline.sweep_point(sim, "base") == pipeline.SweepPoint(16, "paper-mixed")
    for bad in ("p=", "q=1", "world_size=1.5", "base2"):
        with pytest.raises(UserError, match="variant"):
            pipeline.parse_variant(bad)


@pytest.mark.parametrize("n", [0, 1025, True])
def test_world_size_bounds_name_the_field(n):
    with pytest.raises(UserError, match=r"--emulate-world-size .*between 1 and 1024"):
        pipeline.check_world_size(n, "--emulate-world-size")


def test_run_index_lists_every_training_run_and_simulation(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text(
        "name: idx\nseeds: [0, 1]\npolicies: [equal-token, adaptiveload]\n"
        "model: {kernels: [eager, fused]}\nsweeps: {p: [1.3]}\nsimulate:\n"
        "  - {name: s, calibration: c.json, mixture: paper-mixed}\n"
    )
    index = pipeline.run_index(experiment.load(path))
    train = [r for r in index if r["setup"] == "train"]
    sims = [r for r in index if r["setup"] == "sim/s"]
    assert len(train) == 2 * 2 * 2 and len(sims) == 2 * 2 * 2  # policies x seeds x kernels|variants
    assert {r["variant"] for r in sims} == {"base", "p=1.3"}
    assert train[0]["summary"] == "results/idx/runs/equal-token/seed0/eager/summary.json"
    assert all(r["calibration"] == "c.json" for r in sims)
    assert len(pipeline.run_files(index)) == 2 * len(index)


def _load(tmp_path, text: str) -> dict:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return experiment.load(path)


STEP_MODES = "name: sm\nseeds: [0]\npolicies: [equal-token, adaptiveload]\n" + (
    "train: {step_modes: [free, match, 30]}\n"
)


def test_step_modes_are_training_variants_and_the_plans_own_mode_keeps_its_paths(tmp_path):
    config = _load(tmp_path, STEP_MODES)
    variants = pipeline.train_variants(config)
    assert variants == ["base", "steps_per_epoch=match", "steps_per_epoch=30"]
    parsed = [pipeline.parse_variant(v) for v in variants[1:]]
    assert parsed == [("steps_per_epoch", "match"), ("steps_per_epoch", "30")]
    levels = [pipeline.variant_level(v) for v in variants]
    assert [pipeline.level_variant(lv) for lv in levels] == variants  # one inverts the other
    assert all(re.fullmatch(pipeline.LEVEL_PATTERN, lv) for lv in levels)
    out = pipeline.Layout("sm")
    runs = "results/sm/runs"
    assert out.run_dir("adaptiveload", 0, "eager", levels[0]) == f"{runs}/adaptiveload/seed0/eager"
    matched = out.run_dir("adaptiveload", 0, "eager", levels[1])
    assert matched == f"{runs}/steps_per_epoch=match/adaptiveload/seed0/eager"
    plan = out.plan("adaptiveload", 0, levels[2])
    assert plan == "results/sm/plans/steps_per_epoch=30/adaptiveload/seed0.json"
    # the mode reaches the plan stage and training through the variant's view of the config
    modes = [pipeline.steps_per_epoch(pipeline.at_variant(config, v)) for v in variants]
    assert modes == ["free", "match", 30]
    view = pipeline.stage_view(config, "train", variants[1])
    assert view["plan"] == {"steps_per_epoch": "match"}
    assert config["plan"]["steps_per_epoch"] == "free"  # the variant's view copies, never edits
    index = pipeline.run_index(config)
    assert len(index) == 3 * 2 and {r["variant"] for r in index} == set(variants)
    assert index[2]["steps"] == f"{matched.replace('adaptiveload', 'equal-token')}/steps.parquet"


def test_without_step_modes_training_runs_at_the_plans_mode_alone(tmp_path):
    matched = "name: m\nplan: {steps_per_epoch: match}\n"
    assert pipeline.train_variants(_load(tmp_path, matched)) == ["base"]
    both = _load(tmp_path, matched + "train: {step_modes: [free, match]}\n")
    assert pipeline.train_variants(both) == ["steps_per_epoch=free", "base"]
    assert not re.fullmatch(pipeline.LEVEL_PATTERN, "steps_per_epoch=many/")
    with pytest.raises(UserError, match="variant"):
        pipeline.parse_variant("steps_per_epoch=0")
