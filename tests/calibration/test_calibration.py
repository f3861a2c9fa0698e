"""Calibration: a real (tiny, CPU) measurement writes a valid file; bad input writes nothing;
the shipped priors are reproducible from the code."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest
import torch
from repo_paths import CALIBRATIONS, H200_PRIOR, ROOT
from training_setup import adaptiveload, cli_env

from adaptiveload.calibration.files import fit_points
from adaptiveload.calibration.grid import (
    MAX_AXIS,
    bucket_shape,
    build_grid,
    latent_grid,
    memory_points,
)
from adaptiveload.calibration.measure import calibrate
from adaptiveload.calibration.mix import grid_token_mix, mixture_token_mix
from adaptiveload.calibration.prior import prior
from adaptiveload.calibration.settings import BudgetRules, CalibrationConfig, Grid
from adaptiveload.costmodel import Calibration, CostModel, derive_budgets
from adaptiveload.errors import UserError
from adaptiveload.model.analytic import TrainingSetup
from adaptiveload.model.architectures import get_config


def cli_app():
    """The `adaptiveload` command with every stage registered, to call in this process."""
    from adaptiveload.cli import _register
    from adaptiveload.cli.app import app

    _register()
    return app


def test_an_experiment_becomes_one_calibration_config():
    """Every field of a measurement comes from the experiment's sections (the workflow's
    thread rule too); the step measured is the one training runs (activation checkpointing)."""
    from adaptiveload.experiment import validate

    exp = validate({"name": "x", "calibration": {"tokens": [16, 64, 256], "capacity_gb": 0.2,
                                                 "ref_tokens": 200, "repeats": 4},
                    "data": {"mixture": "tiny-cpu", "num_samples": 50},
                    "train": {"activation_checkpointing": True}}, "test")
    cfg = CalibrationConfig.from_experiment(exp)
    assert cfg.grid == Grid(batch_sizes=(1, 2, 4), tokens=(16, 64, 256), repeats=4)
    assert cfg.budgets == BudgetRules(capacity_gb=0.2, ref_tokens=200)
    assert (cfg.mix.mixture, cfg.mix.num_samples, cfg.mix.grid) == ("tiny-cpu", 50, "tiny")
    assert cfg.activation_checkpointing and cfg.model == "wan2.1-tiny"
    assert cfg.clock() == ("cpu", 1) and cfg.job_threads(16) == 1
    wall = CalibrationConfig.from_experiment(
        validate({"name": "x", "calibration": {"timer": "wall"}}, "test")
    )
    assert wall.clock() == ("wall", None) and wall.job_threads(16) == 16
    cuda = CalibrationConfig(device="cuda", threads=8)
    assert cuda.clock() == ("wall", 8)
    with pytest.raises(UserError, match="timer 'cpu' needs"):
        CalibrationConfig(timer="cpu", threads=2)
    with pytest.raises(UserError, match="headroom"):
        BudgetRules(headroom=1.0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "wan2.1-huge"], "unknown model config"),
        (["--tokens", "64"], "at least 2 distinct token counts"),
        (["--batch-sizes", "0,1"], "batch sizes"),
        (["--tokens", "16,x"], "comma-separated integers"),
        (["--repeats", "1"], "expected >= 2 passes"),
        (["--validate", "4"], "--validate needs a --manifest or --mixture"),
        ([], "--capacity-gb is required on CPU"),
    ],
)
def test_bad_input_is_refused_before_measuring_and_writes_nothing(tmp_path, args, message):
    """The command's own code path, in this process (refused before torch is imported); the
    exit status 2 of a UserError is the CLI's (`test_bad_input_exits_2`)."""
    out = tmp_path / "cal.json"
    base = ["--model", "wan2.1-micro", "--batch-sizes", "1,2", "--tokens", "16,64,256"]
    if "--capacity-gb is required" not in message:
        base += ["--capacity-gb", "0.1"]
    with pytest.raises(UserError, match=re.escape(message)):
        cli_app()(["calibrate", "measure", *base, *args, "--quiet", "-o", str(out)],
                  standalone_mode=False)
    assert not out.exists()


def test_bad_input_exits_2(tmp_path):
    out = tmp_path / "cal.json"
    proc = adaptiveload("calibrate", "measure", "--model", "wan2.1-huge", "--capacity-gb", "0.1",
                        "-o", str(out), env=cli_env(), cwd=ROOT)
    assert proc.returncode == 2 and "unknown model config" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_user_error():
    with pytest.raises(UserError, match="no CUDA GPU"):
        calibrate(CalibrationConfig(model="wan2.1-micro", device="cuda", budgets=BudgetRules(1.0),
                                    grid=Grid(batch_sizes=(1, 2), tokens=(16, 64))))


@pytest.mark.parametrize("tokens", [1, 16, 221, 1547, 3740, 4096, 32760, 75600, 97])
def test_latent_grid_has_the_requested_tokens(tokens):
    f, h, w = latent_grid(tokens)
    assert f * h * w == tokens and max(f, h, w) <= MAX_AXIS
    frames, height, width = bucket_shape(tokens)
    from adaptiveload.tokens import token_count

    assert token_count(frames, height, width) == tokens


def test_old_calibration_files_without_m_tok_still_load(tmp_path):
    data = json.loads(H200_PRIOR.read_text())
    del data["m_tok"]
    assert Calibration.from_dict(data).m_tok is None
    with pytest.raises(UserError, match="'m_tok' must be a positive number"):
        Calibration.from_dict({**data, "m_tok": -1})


def test_prior_budgets_at_the_capacity_it_is_given(tmp_path):
    """`calibrate prior --capacity-gb 80` derives the budgets for 80 GB (the H200's own 141 GB
    without it), as `budgets --capacity-gb` does from the same cost model."""
    out = tmp_path / "p80.json"
    cli_app()(["calibrate", "prior", "--model", "wan2.1-t2v-1.3b", "--mixture", "paper-mixed",
               "--capacity-gb", "80", "-o", str(out)], standalone_mode=False)
    cal = Calibration.load(out)
    assert cal.capacity_bytes == pytest.approx(80e9)
    shipped = Calibration.load(H200_PRIOR)
    mix = mixture_token_mix("paper-mixed", 20000, seed=0, grid="wan")
    derived = derive_budgets(shipped.cost, mix.tokens, 80e9, shipped.headroom)  # `budgets`' rule
    for name in ("m_mem", "m_tok", "m_comp", "p"):
        assert getattr(cal, name) == pytest.approx(getattr(derived, name), rel=1e-9), name
    assert cal.m_mem < 0.6 * shipped.m_mem  # not the 141 GB device's


@pytest.mark.parametrize("model", ["wan2.1-t2v-1.3b", "wan2.1-t2v-14b"])
def test_shipped_priors_are_reproducible(model):
    shipped = Calibration.load(CALIBRATIONS / f"h200-{model}.json")
    assert shipped.source == "model" and "analytic prior" in shipped.device
    mix = mixture_token_mix("paper-mixed", 20000, seed=0, grid="wan")
    fresh = prior(model, "h200", mix)
    assert fresh.p == pytest.approx(shipped.p, rel=1e-9)
    assert fresh.m_mem == pytest.approx(shipped.m_mem, rel=1e-9)
    assert fresh.m_comp == pytest.approx(shipped.m_comp, rel=1e-9)
    assert fresh.m_tok == pytest.approx(shipped.m_tok, rel=1e-9)
    for name in ("c0", "a", "b", "c_seq", "m_static", "m_tok", "m_seq"):
        assert getattr(fresh.cost, name) == pytest.approx(getattr(shipped.cost, name), rel=1e-9)
    # the budgets admit the largest bucket at B=1 and the prior's fit is exact
    assert shipped.extra["budgets"]["max_fits"] and shipped.extra["fit"]["r2"] > 0.9999
    # reference batch: the heaviest bucket within M_mem (the 14B's M_mem, ~72k tokens, is
    # below the 720p clips' 75.6k, so its reference is the next bucket down, 61.2k)
    b = shipped.extra["budgets"]
    assert b["ref_tokens"] == max(s for s in set(mix.tokens.tolist()) if s <= shipped.m_mem)
    assert b["ref_tokens"] == {"wan2.1-t2v-1.3b": 75600, "wan2.1-t2v-14b": 61200}[model]
    assert b["ref_batch"] == max(1, int(shipped.m_mem // b["ref_tokens"]))
    assert shipped.m_tok == b["ref_batch"] * b["ref_tokens"] <= shipped.m_mem
    assert shipped.m_comp == pytest.approx(b["ref_batch"] * b["ref_tokens"] ** shipped.p)
    assert np.isclose(shipped.capacity_bytes, 141e9)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_calibration_measures_memory():
    grid = Grid(batch_sizes=(1, 2), tokens=(256, 1024, 4096, 8192), repeats=2)
    cal = calibrate(CalibrationConfig(model="wan2.1-tiny", device="cuda", grid=grid),
                    progress=False)
    assert cal.extra["memory_source"] == "measured" and cal.source == "measured"
    assert all(p["peak_bytes"] > 0 for p in cal.extra["points"])
    assert cal.cost.m_tok > 0 and cal.extra["fit"]["mem_r2"] is not None
    # memory measured up to the budgets it derived (or recorded out of memory)
    targets = cal.extra["grid"]["memory_targets"]
    measured = [p for p in cal.extra.get("memory_points", []) if p["status"] == "ok"]
    assert cal.measured_memory_tokens >= min(max(targets.values()), 8192 * 2) or any(
        p["status"] == "oom" for p in cal.extra.get("memory_points", [])
    )
    assert all(p["peak_bytes"] > 0 for p in measured)


def test_grid_rules():
    grid, dropped = build_grid(
        [2, 4], [16, 256], largest_bucket=1000, max_batch_tokens=600
    )
    assert (1, 16) in grid and (1, 256) in grid and (1, 1000) in grid
    assert dropped == [(4, 256)] and (2, 256) in grid and (4, 16) in grid
    assert all(b == 1 for b, s in grid if s == 1000)  # the largest bucket: B = 1 only
    # a cap below a B = 1 point never drops it
    grid, dropped = build_grid([2], [16, 256], 256, max_batch_tokens=10)
    assert grid == [(1, 16), (1, 256)] and dropped == [(2, 16), (2, 256)]


def test_memory_points_reach_every_budget_beyond_the_grid():
    # M_mem 2,500 and a pack of 3,100 tokens over a grid that measured 1,024 tokens
    linear = CostModel(c0=0.1, a=1e-3, b=0.0)  # no attention: every shape costs the same
    quadratic = CostModel(c0=0.1, a=1e-3, b=1e-4)  # long samples cost more per token
    assert memory_points([2_500, 3_100], [100, 1_000], 1_024, quadratic) == [
        (25, 100),
        (31, 100),
    ]
    per_sample = CostModel(c0=0.1, a=1e-3, b=0.0, c_seq=1.0)  # a large per-sample constant
    assert memory_points([2_500], [100, 1_000], 1_024, per_sample) == [(3, 1_000)]
    for b, s in memory_points([2_500, 3_100], [100, 1_000], 1_024, linear):
        assert b * s >= 2_500
    assert memory_points([900], [100, 1_000], 1_024, quadratic) == []  # measured already


def test_memory_points_join_the_memory_fit_and_an_oom_one_is_kept_out():
    """Memory points (one pass each) refit memory, not time; one out of memory stays in the
    file with its status and enters no fit; the file's measured range then covers them."""
    cost = {"m_static": 1e9, "m_tok": 2e4, "m_seq": 1e6}

    def point(b, s, t, status="ok"):
        peak = cost["m_static"] + b * (cost["m_tok"] * s + cost["m_seq"])
        peak = peak if status == "ok" else None
        return {"batch": b, "tokens": s, "time_s": t, "status": status, "peak_bytes": peak}

    sizes = [(b, s) for b in (1, 2) for s in (256, 1024, 4096, 8192)]
    grid = [point(b, s, 0.01 + b * (1e-5 * s + 1e-9 * s * s)) for b, s in sizes]
    extra = [point(4, 8192, 99.0), point(8, 8192, None, status="oom")]
    cfg = get_config("wan2.1-micro")

    mix = grid_token_mix([256, 8192])
    cal = fit_points(
        cfg, "cuda:test", grid, mix, 80e9, BudgetRules(0.1), TrainingSetup(), 1_000,
        memory_measured=True, max_loo=10, memory_points=extra,
    )
    assert cal.measured_memory_tokens == 4 * 8192  # the oom point is no measurement
    assert [p["status"] for p in cal.extra["memory_points"]] == ["ok", "oom"]
    assert cal.cost.m_tok == pytest.approx(cost["m_tok"], rel=1e-6)
    assert cal.extra["fit"]["num_points"] == len(grid)  # the time fit: the grid alone


def test_a_lora_experiment_is_calibrated_on_its_lora_step_and_training_checks_it():
    """`train.lora` reaches the measurement (adapters on a frozen base, optimizer state for
    them alone), the file records the step it timed, and a LoRA run planned with another
    step's calibration is warned once; with its own, nothing is said."""
    pytest.importorskip("peft")
    from adaptiveload.experiment import validate
    from adaptiveload.model.lora import spec_record
    from adaptiveload.training.finetune import FinetuneWarning, check_calibration

    exp = validate({"name": "x", "model": {"config": "wan2.1-micro"},
                    "calibration": {"batch_sizes": [1, 2], "tokens": [16, 64, 256, 512, 1024],
                                    "repeats": 2, "warmup": 0, "capacity_gb": 0.005,
                                    "max_loo_error": 10},
                    "train": {"lora": {"rank": 4}}}, "test")
    cfg = CalibrationConfig.from_experiment(exp)
    assert cfg.lora is not None and cfg.lora.rank == 4
    cal = calibrate(cfg, progress=False)
    assert cal.extra["setup"]["lora"] == spec_record(cfg.lora)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_calibration(cfg.lora, cal)  # the step it times: silent
    full = Calibration.from_dict({**cal.to_dict(), "setup": {"lora": None}})
    with pytest.warns(FinetuneWarning, match=r"train\.lora: .* timed full training steps"):
        check_calibration(cfg.lora, full)
