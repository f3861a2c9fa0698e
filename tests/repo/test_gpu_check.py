"""The prepared H200 check (experiments/gpu): its calibration grid cap, its training budgets,
checkpoint-free training, the all-to-all part recorded as not applicable on fewer than 2 GPUs,
and the whole script dry-run on CPU and imported back."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from repo_paths import GPU_SCRIPTS, H200_MEASURED, H200_PRIOR

from adaptiveload import experiment
from adaptiveload.calibration.additivity import held_out
from adaptiveload.calibration.measure import calibrate
from adaptiveload.calibration.settings import BudgetRules, CalibrationConfig, Grid
from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError


def test_max_batch_tokens_that_leaves_too_few_points_is_refused():
    with pytest.raises(UserError, match="leaves 3 grid point"):
        grid = Grid(batch_sizes=(1, 2), tokens=(16, 64), max_batch_tokens=64)
        calibrate(CalibrationConfig(model="wan2.1-micro", grid=grid, budgets=BudgetRules(0.1)),
                  progress=False)


def _script_calibration(variable: str, *extra: str) -> CalibrationConfig:
    """The CalibrationConfig h200.sh's `variable` (CAL_FLAGS_CUDA or CAL_FLAGS_DRY) gives,
    through the command line's own parser and its one place flags become a config."""
    import typer

    from adaptiveload.cli.app import app
    from adaptiveload.cli.calibrate import _settings

    script = (GPU_SCRIPTS / "h200.sh").read_text()
    flags = re.search(rf'^{variable}="(.*?)"$', script, re.S | re.M).group(1)
    measure = typer.main.get_command(app).commands["calibrate"].commands["measure"]
    ctx = measure.make_context("measure", [*shlex.split(flags.replace("\\\n", " ")), *extra,
                                           "-o", "unused.json"])
    return _settings(None, dict(ctx.params, max_loo=ctx.params["max_loo_error"]))


def _device_seconds(seconds: float, grid: Grid) -> float:
    """Device time of one grid point or pack of `seconds` a step (all above the 50 ms that
    buys a probe step): its warm-up steps (the last one timed), then one step per pass."""
    return (grid.warmup + grid.repeats) * seconds


def test_the_device_check_times_mixed_packs_within_the_h200_and_its_part_limit():
    """The calibrate part's packs (CAL_FLAGS_CUDA): mixes of short and long segments, each
    within the H200's memory and the grid's largest bucket by the measured calibration; grid
    and packs together predicted to leave the part's limit room for the model's start and the
    validation (model: the measured 1.3B calibration's step times)."""
    cfg = _script_calibration("CAL_FLAGS_CUDA", "--model", "wan2.1-t2v-1.3b", "--device", "cuda")
    grid, cal = cfg.grid, Calibration.load(H200_MEASURED)
    assert [p.name for p in grid.packs] == ["floor", "short", "medium", "long"]
    usable = cal.usable_bytes
    for pack in grid.packs:
        assert min(pack.tokens) == 1560 and len(set(pack.tokens)) >= 2
        assert max(pack.tokens) <= max(grid.tokens)
        assert cal.cost.set_memory(pack.tokens) < 0.5 * usable, pack.name
    assert cal.cost.set_time(grid.packs[0].tokens) < 1.25 * cal.cost.t_floor  # under the floor
    packs_s = sum(_device_seconds(cal.cost.set_time(p.tokens), grid) for p in grid.packs)
    from adaptiveload.calibration.measure import _checked_grid

    points, _ = _checked_grid(grid, largest=75600)
    grid_s = sum(_device_seconds(float(cal.cost.step_time(b, s)), grid)
                 for b, s in points)
    limit = int(re.search(r"CALIBRATE_S:-(\d+)", (GPU_SCRIPTS / "h200.sh").read_text()).group(1))
    # then memory up to the budgets: M_mem and the largest pack of the 16-rank packed plan
    from adaptiveload.calibration.grid import memory_points
    from adaptiveload.calibration.measure import _memory_targets
    from adaptiveload.calibration.mix import mixture_token_mix

    mix = mixture_token_mix("paper-mixed", 20_000)
    targets = _memory_targets(cal, mix, cfg.validation.world_size, cfg.seed)
    assert targets["largest_pack"] > targets["m_mem"] > 3.5 * cal.measured_memory_tokens
    reached = max(b * s for b, s in points)
    memory = memory_points(list(targets.values()), grid.tokens, reached, cal.cost)
    assert all(b * s >= t for (b, s), t in zip(memory, sorted(targets.values()), strict=True))
    assert all(cal.cost.memory(b, s) < usable for b, s in memory)  # measurable on the H200
    memory_s = sum(float(cal.cost.step_time(b, s)) for b, s in memory)  # one pass each
    assert packs_s < 25 and memory_s < 30
    assert grid_s + packs_s + memory_s < limit - 50, (grid_s, packs_s, memory_s, limit)
    dry = _script_calibration("CAL_FLAGS_DRY", "--model", "wan2.1-micro")
    assert [p.name for p in dry.grid.packs] == ["short", "mixed"]


def test_the_summary_reports_the_additivity_of_the_packs(tmp_path, gpu_script):
    summarize = gpu_script("summarize")
    cal = Calibration.load(H200_MEASURED)
    rows = [{"pack": "mixed", "tokens": [32760, 1560], "samples": 2, "sum_tokens": 34320,
             "status": "ok", "time_s": 3.3, "peak_bytes": 30e9},
            {"pack": "huge", "tokens": [75600, 75600, 1560], "samples": 3, "sum_tokens": 152760,
             "status": "oom", "time_s": None, "peak_bytes": None}]
    data = cal.to_dict()
    data["additivity"] = held_out(cal.cost, rows, memory_measured=True, timer="wall")
    (tmp_path / "calibration").mkdir()
    (tmp_path / "calibration" / "h200.json").write_text(json.dumps(data))
    summarize.main(tmp_path)
    add = json.loads((tmp_path / "summary.json").read_text())["calibration"]["additivity"]
    assert (add["num_packs"], add["num_measured"], add["worst_pack"]) == (2, 1, "mixed")
    pred = cal.cost.set_time([32760, 1560])
    assert add["packs"][0]["predicted_s"] == pytest.approx(pred)
    assert add["max_rel_err"] == pytest.approx(abs(pred / 3.3 - 1))
    assert "cpu_s_passes" not in add["packs"][0]  # the headline, not the raw passes
    text = (tmp_path / "summary.txt").read_text()
    assert "additivity: 1 of 2 mixed packs held out of the fit (wall-clock seconds)" in text
    assert "  mixed: 32760 + 1560 = 34320 tokens: measured 3.3 s" in text
    assert "  huge: 75600x2 + 1560 = 152760 tokens: oom" in text
    del data["additivity"]  # a calibration of before the packs
    (tmp_path / "calibration" / "h200.json").write_text(json.dumps(data))
    summarize.main(tmp_path)
    assert "additivity: no packs in this calibration" in (tmp_path / "summary.txt").read_text()


def test_training_budgets_fit_the_longest_bucket_and_keep_the_measured_model(gpu_script):
    train_budgets = gpu_script("train_budgets")
    prior = Calibration.load(H200_PRIOR)
    exp = experiment.load(GPU_SCRIPTS / "h200_train.yaml")
    out = train_budgets.scaled(prior, exp, fill=1.0)
    longest = out.extra["manifest"]["tokens_max"]
    assert longest == 7200  # 5 frames of 720p: 2 latent frames x 45 x 80
    assert out.m_mem == pytest.approx(longest)
    assert out.extra["budgets"]["max_fits"]
    assert out.cost == prior.cost and out.source == prior.source
    assert out.capacity_bytes < prior.capacity_bytes
    b = out.extra["budgets"]
    assert out.m_comp == pytest.approx(b["ref_batch"] * b["ref_tokens"] ** out.p)
    # M_mem sized to the longest bucket exactly: rounding must not drop it as the reference
    assert (b["ref_tokens"], b["ref_batch"]) == (longest, 1) and out.m_tok == longest
    roomy = train_budgets.scaled(prior, exp, fill=1.5)  # the script's default
    assert roomy.m_mem == pytest.approx(1.5 * longest) and roomy.m_tok == longest
    assert out.extra["paper_scale_budgets"]["m_mem"] == prior.m_mem
    with pytest.raises(UserError, match="--fill"):
        train_budgets.scaled(prior, exp, fill=0.5)
