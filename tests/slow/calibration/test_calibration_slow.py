"""Calibration: a real (tiny, CPU) measurement writes a valid file; bad input writes nothing;
the shipped priors are reproducible from the code."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pandas as pd
import pytest
import yaml
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env

from adaptiveload.calibration.grid import (
    memory_points,
)
from adaptiveload.costmodel import Calibration
from adaptiveload.planning.policies import POLICIES


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return adaptiveload("calibrate", *args, env=cli_env(), cwd=ROOT)


# These tests check what a calibration writes, not how good this machine's timings are (a
# loaded 2-core machine is no reference): the leave-one-out gate is opened wide
# (--max-loo-error 10), and the CPU-robust timer (one thread, its CPU seconds) is used.
ROBUST = ("--threads", "1", "--timer", "cpu", "--max-loo-error", "10", "--quiet")


def test_tiny_cpu_calibration_follows_the_grid_rules_and_writes_a_valid_file(tmp_path):
    out = tmp_path / "cal.json"
    proc = run_cli(
        "measure", "--model", "wan2.1-tiny", "--device", "cpu", "--batch-sizes", "2,4",
        "--tokens", "16,64,256,1024", "--repeats", "2", "--capacity-gb", "0.5",
        "--max-batch-tokens", "2048", "--mixture", "tiny-cpu", "--num-samples", "300", *ROBUST,
        "-o", str(out),
    )
    assert proc.returncode == 0, proc.stderr
    cal = Calibration.load(out)
    assert (cal.model, cal.source) == ("wan2.1-tiny", "measured")
    assert cal.device.startswith("cpu:") and cal.extra["memory_source"] == "model"
    # B = 1 at every size (though not asked for) and at the largest bucket of the manifest;
    # the cap dropped only B > 1 points, and says which
    largest = cal.extra["manifest"]["tokens_max"]
    shapes = {(p["batch"], p["tokens"]) for p in cal.extra["points"]}
    assert {(1, s) for s in (16, 64, 256, 1024, largest)} <= shapes
    assert cal.extra["grid"]["dropped_by_max_batch_tokens"] == [[4, 1024]]
    assert (4, 1024) not in shapes and (2, 1024) in shapes and len(shapes) == 12
    assert cal.extra["grid"]["process_warmup_steps"] >= 1 and cal.extra["grid"]["warmup"] >= 1
    for p in cal.extra["points"]:
        assert p["time_s"] == min(p["cpu_s_passes"]) > 0 and len(p["cpu_s_passes"]) == 2
        assert p["spread"] == pytest.approx(max(p["cpu_s_passes"]) / p["time_s"] - 1)
        assert p["loo_rel_err"] >= 0
    assert all(p["peak_bytes"] is None for p in cal.extra["points"])
    assert {"torch", "cuda", "date", "device"} <= set(cal.extra["provenance"])
    assert cal.extra["model_config"]["dim"] == 64
    assert 1.0 <= cal.p <= 2.0 and cal.m_mem > 0 and cal.m_comp > 0
    assert cal.cost.m_tok > 0  # analytic memory filled in on CPU
    budgets = cal.extra["budgets"]
    assert budgets["m_comp"] == pytest.approx(budgets["ref_batch"] * budgets["ref_tokens"] ** cal.p)
    assert cal.m_tok == budgets["m_tok"] == budgets["ref_batch"] * budgets["ref_tokens"]
    assert Calibration.load(out).to_dict()["m_tok"] == cal.m_tok
    fit = cal.extra["fit"]
    assert fit["num_points"] == 12 and fit["form"] in ("floored", "three-term")
    assert cal.cost.a > 0 and cal.cost.b > 0 and 1.0 < cal.p < 2.0
    assert "R^2" in proc.stderr and "leave-one-out" in proc.stderr
    # memory up to the derived budgets: listed (a CPU measures no memory), by the grid's rule
    grid = cal.extra["grid"]
    assert grid["memory_targets"]["m_mem"] == pytest.approx(cal.m_mem)
    assert grid["memory_targets"]["largest_pack"] > 0
    reached = max(b * s for b, s in shapes)
    want = memory_points(list(grid["memory_targets"].values()), grid["tokens"], reached, cal.cost)
    assert grid["memory_points_not_measured"] == [list(bs) for bs in want] != []
    assert cal.measured_memory_tokens is None and "memory_points" not in cal.extra


def test_validate_times_micro_batches_drawn_from_every_policys_plan(tmp_path):
    out = tmp_path / "cal.json"
    proc = run_cli(
        "measure", "--model", "wan2.1-micro", "--batch-sizes", "1,2", "--tokens",
        "16,64,256,1024", "--repeats", "2", "--capacity-gb", "0.05", "--mixture", "tiny-cpu",
        "--num-samples", "200", "--validate", "6", "--validate-world-size", "4",
        "--validate-max-seconds", "0.2", *ROBUST, "-o", str(out),
    )
    assert proc.returncode == 0, proc.stderr
    cal = Calibration.load(out)
    val = cal.extra["validation"]
    assert (val["k"], val["world_size"], val["num_measured"]) == (6, 4, 6)
    assert val["planned_micro_batches"] > val["excluded_over_max_seconds"]
    rows = val["micro_batches"]
    assert [r["policy"] for r in rows].count("equal-token") == 2
    # every policy of the project's whose micro-batches are of one shape (packs are the grid's
    # `packs` job; the field's methods are not the project's to check)
    assert {r["policy"] for r in rows} == {
        n for n, cls in POLICIES.items() if not (cls.packed or cls.peer)
    }
    for r in rows:
        assert r["predicted_s"] == pytest.approx(float(cal.cost.step_time(r["batch"], r["tokens"])))
        assert r["predicted_s"] <= 0.2 and r["measured_s"] > 0
        assert r["rel_err"] == pytest.approx(abs(r["predicted_s"] / r["measured_s"] - 1))
    errors = [r["rel_err"] for r in rows]
    assert val["median_rel_err"] == pytest.approx(float(np.median(errors)))
    assert val["p95_rel_err"] == pytest.approx(float(np.percentile(errors, 95)))
    assert "validation: 6 planned micro-batches" in proc.stderr


def test_calibrate_takes_its_settings_from_an_experiment_file(tmp_path):
    exp = {
        "name": "calib-test",
        "data": {"mixture": "tiny-cpu", "num_samples": 200, "grid": "tiny"},
        "model": {"config": "wan2.1-micro"},
        "calibration": {"batch_sizes": [1, 2], "tokens": [16, 64, 256, 1024], "repeats": 2,
                        "capacity_gb": 0.1, "threads": 1, "timer": "cpu", "warmup": 2,
                        "max_loo_error": 10},
        "budgets": {"m_tok": "auto", "m_mem": "auto", "m_comp": "auto", "p": "auto"},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(exp))
    out = tmp_path / "cal.json"
    proc = run_cli("measure", "--config", str(path), "--quiet", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["model"] == "wan2.1-micro"
    assert data["grid"]["tokens"] == [16, 64, 256, 1024]
    assert (data["grid"]["timer"], data["grid"]["warmup"], data["fit"]["max_loo"]) == ("cpu", 2, 10)
    assert data["provenance"]["cpu_threads"] == 1 and data["manifest"]["num_samples"] == 200
    assert data["capacity_bytes"] == pytest.approx(0.1e9)
    # a flag wins over the file
    again = run_cli("measure", "--config", str(path), "--repeats", "3", "--quiet", "-o", str(out))
    assert again.returncode == 0, again.stderr
    assert json.loads(out.read_text())["grid"]["repeats"] == 3


def test_empty_manifest_is_rejected_before_writing(tmp_path):
    manifest = tmp_path / "empty.csv"
    pd.DataFrame(columns=["sample_id", "num_frames", "height", "width"]).to_csv(
        manifest, index=False
    )
    out = tmp_path / "cal.json"
    proc = run_cli(
        "measure", "--model", "wan2.1-micro", "--batch-sizes", "1,2", "--tokens", "16,64",
        "--capacity-gb", "0.1", "--manifest", str(manifest), "--quiet", "-o", str(out),
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert not out.exists()
