"""`train.steps: epoch`: the warm-up replays the epoch's first batches, then exactly one whole
epoch is timed, so every policy's timed window holds the same samples; a resume at the seam
(the step where the epoch starts again) continues the same batches."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from training_setup import write_experiment

from adaptiveload.step_table import WHOLE_EPOCH
from adaptiveload.training.session import Request, train

WARMUP = 2
SAME = ["step", "rank", "samples", "tokens", "frames", "height", "width"]


def _run(exp, out, **kw) -> dict:
    return train(Request(config=exp, policy="adaptiveload-balanced", seed=0, out=out,
                         progress=False, **kw))


def test_whole_epoch_is_timed_after_a_replayed_warmup(tmp_path):
    exp = write_experiment(tmp_path, steps=WHOLE_EPOCH, warmup_steps=WARMUP)
    out = tmp_path / "run"
    summary = _run(exp, out, checkpoint=False)
    plan = json.loads((out / "plan_summary.json").read_text())
    steps = pd.read_parquet(out / "steps.parquet")

    assert summary["timed_window"] == "epoch"
    assert steps["step"].nunique() == summary["steps_total"] == WARMUP + plan["steps"]
    timed = steps[steps["step"] >= WARMUP]
    # the timed window is epoch 0 whole: every planned sample (and the plan's padding) once
    assert timed["samples"].sum() == plan["num_planned"] + plan["num_padding"]
    # throughput counts each real sample once; the plan's padding repeats stand beside it
    assert timed["padding_samples"].sum() == summary["padding_samples"] == plan["num_padding"]
    assert summary["samples_per_s"] * summary["timed_s"] == pytest.approx(plan["num_planned"])
    assert summary["epoch_steps"] == plan["steps"]
    assert summary["samples_per_step_mean"] == pytest.approx(plan["num_planned"] / plan["steps"])
    # the warm-up ran the epoch's first batches, which the timed window runs again
    warm = steps[steps["step"] < WARMUP].reset_index(drop=True)
    again = timed[timed["step"] < 2 * WARMUP].reset_index(drop=True)
    again = again.assign(step=again["step"] - WARMUP)
    pd.testing.assert_frame_equal(warm[SAME], again[SAME])


def test_resume_at_the_seam_runs_the_same_batches(tmp_path):
    exp = write_experiment(tmp_path, steps=WHOLE_EPOCH, warmup_steps=WARMUP,
                           checkpoint_every=WARMUP)
    out = tmp_path / "run"
    _run(exp, out)
    reference = pd.read_parquet(out / "steps.parquet")
    # leave the run as if killed right after the warm-up's checkpoint
    for path in (out / "checkpoints").glob("ckpt-*.pt"):
        if path.name != f"ckpt-{WARMUP:08d}.pt":
            path.unlink()
    for name in ("steps.parquet", "summary.json"):
        (out / name).unlink()
    _run(exp, out)
    resumed = pd.read_parquet(out / "steps.parquet")
    pd.testing.assert_frame_equal(reference[SAME], resumed[SAME])
    pd.testing.assert_series_equal(reference["loss"], resumed["loss"], rtol=1e-6, atol=0)
