"""Time to quality end to end at a tiny size: learnable scenes, the held-out set, both step
modes as the pipeline's training variants, real training runs, `adaptiveload analyze
convergence` and the figure."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import yaml

from adaptiveload import experiment, pipeline
from adaptiveload.analysis import figures
from adaptiveload.analysis.aggregate import RunRef, aggregate
from adaptiveload.analysis.convergence import LOSS_AT_SAMPLES
from adaptiveload.cli import main
from adaptiveload.tokens import SHAPE_CLASSES
from adaptiveload.training.session import Request, train

torch.set_num_threads(1)


def test_the_convergence_path_end_to_end_at_a_tiny_size(tmp_path, monkeypatch, capsys):
    """What experiments/convergence.yaml runs, at a tiny size through the real code: learnable
    scenes, the held-out set, both step modes as the pipeline's training variants (the views it
    writes), equal-token and packed (whose model takes packed micro-batches) x 2 seeds x 2
    whole epochs of 24 samples on the micro model, then `adaptiveload analyze convergence`
    and the figure on the aggregated steps."""
    policies = ("equal-token", "adaptiveload-packed")
    raw = {
        "name": "tiny_convergence",
        "policies": list(policies),
        "data": {"mixture": "tiny-cpu", "num_samples": 24, "content": "learnable"},
        "model": {"config": "wan2.1-micro"},
        "budgets": {"m_tok": 4096, "m_mem": 4096, "m_comp": 1e6, "p": 1.4},
        "train": {
            "step_modes": ["free", "match"],
            "world_size": 2,
            "steps": "epoch",
            "epochs": 2,
            "warmup_steps": 0,
            "lr": 2e-2,
            "val_every": 3,
            "val_per_class": 2,
        },
    }
    (tmp_path / "exp.yaml").write_text(yaml.safe_dump(raw))
    config = experiment.load(tmp_path / "exp.yaml")
    variants = pipeline.train_variants(config)
    assert variants == ["base", "steps_per_epoch=match"]
    refs, epoch_steps = [], {}
    for variant in variants:
        view = tmp_path / variant / "train.yaml"
        view.parent.mkdir()
        view.write_text(yaml.safe_dump(pipeline.stage_view(config, "train", variant)))
        for policy in policies:
            for seed in (0, 1):
                out = tmp_path / variant / policy / str(seed)
                quiet = {"progress": False, "checkpoint": False}
                # as the train rule runs it: the view and the kernel (a view has no kernels)
                run = Request(view, policy, seed, kernel="eager", out=out, **quiet)
                train(run)
                table = pd.read_parquet(out / "steps.parquet")
                scored = table[table["val_loss"].notna()].groupby("step").first()
                assert len(scored) >= 3 and scored.index[0] == 0
                # it learns: packed's 6 steps cut the loss by 7-10% on the micro model
                assert scored["val_loss"].iloc[-1] < 0.95 * scored["val_loss"].iloc[0]
                assert scored[[f"val_loss_{c}" for c in SHAPE_CLASSES]].notna().all().all()
                # samples seen: two whole epochs of real samples (the plan's padding left out)
                assert table["samples_seen"].max() == 2 * 24
                summary = json.loads((out / "summary.json").read_text())
                assert summary["batch_layout"] == ("packed" if "packed" in policy else "dense")
                epoch_steps[variant, policy, seed] = summary["epoch_steps"]
                refs.append(RunRef("train", variant, out / "summary.json", out / "steps.parquet"))
    for seed in (0, 1):  # match: packed's epoch at equal-token's steps per epoch
        free = epoch_steps["base", "equal-token", seed]
        assert epoch_steps["steps_per_epoch=match", "adaptiveload-packed", seed] == free
        assert epoch_steps["base", "adaptiveload-packed", seed] < free
    steps = aggregate(refs).steps
    steps.to_parquet(tmp_path / "steps.parquet")
    csv, md = tmp_path / "convergence.csv", tmp_path / "convergence.md"
    monkeypatch.setattr(sys, "argv", ["adaptiveload", "analyze", "convergence", "--steps",
                                      str(tmp_path / "steps.parquet"), "--csv", str(csv),
                                      "--md", str(md)])
    with pytest.raises(SystemExit) as done:  # the real entry point, in this process
        main()
    assert done.value.code in (0, None)
    result = pd.read_csv(csv)
    assert set(result["policy"]) == set(policies)
    assert set(result["variant"]) == set(variants)  # a comparison group per step mode
    times = result["metric"] != LOSS_AT_SAMPLES  # the loss at equal samples has no target
    assert result.loc[times, "target"].gt(0).all() and result.loc[~times, "target"].isna().all()
    text = md.read_text()
    assert text.count("adaptiveload-packed (train / ") == len(variants)  # a verdict per mode
    png = figures.render("convergence", SimpleNamespace(steps=steps), tmp_path / "conv.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "convergence" in capsys.readouterr().out
