"""Time to quality: the learnable source, the held-out set, the validation columns of a real
run, and the analysis (time to target, loss at equal samples seen) on synthetic curves."""

from __future__ import annotations

import json

import pandas as pd
import torch
import yaml

from adaptiveload.analysis.aggregate import RUN_KEYS, RunRef, aggregate
from adaptiveload.analysis.convergence import (
    LOSS_AT_SAMPLES,
    Settings,
    compare,
    curves,
    verdicts,
)
from adaptiveload.tokens import SHAPE_CLASSES
from adaptiveload.training.session import Request, train

torch.set_num_threads(1)


def test_real_runs_log_a_falling_validation_loss_and_feed_the_analysis(tmp_path):
    """2 policies x 2 seeds x 2 whole epochs of 24 samples, the micro model on learnable scenes,
    at both step modes (free, and match: each policy at equal-token's steps per epoch)."""
    policies = ("equal-token", "adaptiveload-balanced")
    config = {
        "name": "tiny_convergence",
        "policies": list(policies),
        "data": {"mixture": "tiny-cpu", "num_samples": 24, "content": "learnable"},
        "model": {"config": "wan2.1-micro"},
        "budgets": {"m_tok": 4096, "m_mem": 4096, "m_comp": 1e6, "p": 1.4},
        "train": {
            "world_size": 2,
            "steps": "epoch",
            "epochs": 2,
            "warmup_steps": 0,
            "lr": 1e-2,
            "val_every": 3,
            "val_per_class": 2,
        },
    }
    refs, epoch_steps = [], {}
    for mode, variant in (("free", "base"), ("match", "steps_per_epoch=match")):
        exp = tmp_path / f"{mode}.yaml"
        exp.write_text(yaml.safe_dump({**config, "plan": {"steps_per_epoch": mode}}))
        for policy in policies:
            for seed in (0, 1):
                out = tmp_path / mode / policy / str(seed)
                quiet = {"progress": False, "checkpoint": False}
                train(Request(config=exp, policy=policy, seed=seed, out=out, **quiet))
                table = pd.read_parquet(out / "steps.parquet")
                scored = table[table["val_loss"].notna()].groupby("step").first()
                assert len(scored) >= 3 and scored.index[0] == 0
                assert scored["val_loss"].iloc[-1] < 0.9 * scored["val_loss"].iloc[0]
                assert scored[[f"val_loss_{c}" for c in SHAPE_CLASSES]].notna().all().all()
                # samples seen: two whole epochs of real samples (the plan's padding left out)
                assert table["samples_seen"].max() == 2 * 24
                summary = json.loads((out / "summary.json").read_text())
                assert summary["steps_per_epoch"] == mode
                epoch_steps[mode, policy, seed] = summary["epoch_steps"]
                refs.append(RunRef("train", variant, out / "summary.json", out / "steps.parquet"))
    # match: every policy's epoch at equal-token's steps per epoch
    for seed in (0, 1):
        assert epoch_steps["match", policies[1], seed] == epoch_steps["free", policies[0], seed]
    result = compare(curves(aggregate(refs).steps), Settings("equal-token", 200, 0))
    assert set(result["policy"]) == {"equal-token", "adaptiveload-balanced"}
    assert set(result["variant"]) == {"base", "steps_per_epoch=match"}  # a group per mode
    times = result["metric"] != LOSS_AT_SAMPLES  # the loss at equal samples has no target
    assert result.loc[times, "target"].gt(0).all() and result.loc[~times, "target"].isna().all()
    assert len(verdicts(result)) == 2 * 2
    assert set(RUN_KEYS) <= set(curves(aggregate(refs).steps).columns)
