"""`adaptiveload plan` / `adaptiveload simulate` end to end, and their refusals."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from training_setup import adaptiveload

from adaptiveload.planning.plan import TABLE_COLUMNS
from adaptiveload.step_table import STEP_COLUMNS

SUMMARY_KEYS = [
    "policy",
    "world_size",
    "num_samples",
    "num_planned",
    "num_excluded",
    "num_oversize",
    "num_padding",
    "duplicates",
    "steps",
    "batches",
    "max_tokens_per_batch",
    "constraint_violations",
    "m_tok",
    "m_mem",
    "m_comp",
    "p",
]
PREDICTED = (
    "predicted_imbalance_rate",
    "predicted_idle_fraction",
    "predicted_samples_per_s",
    "predicted_tokens_per_s",
)


def test_plan_then_simulate(plan_inputs):
    root = plan_inputs["root"]
    plan, summary = root / "plan.parquet", root / "summary.json"
    done = adaptiveload(
        "plan",
        "--manifest",
        str(plan_inputs["manifest"]),
        "--policy",
        "adaptiveload-balanced",
        "--world-size",
        "8",
        "--seed",
        "3",
        "--epoch",
        "1",
        "--calibration",
        str(plan_inputs["calibration"]),
        "--model",
        "wan2.1-t2v-1.3b",
        "-o",
        str(plan),
        "--summary",
        str(summary),
    )
    assert done.returncode == 0, done.stderr
    table = pd.read_parquet(plan)
    assert list(table.columns) == list(TABLE_COLUMNS)
    s = json.loads(summary.read_text())
    assert set(SUMMARY_KEYS) | set(PREDICTED) <= set(s)
    assert (s["world_size"], s["seed"], s["epoch"], s["num_samples"]) == (8, 3, 1, 800)
    assert s["m_tok"] == s["m_mem"] == 80_000 and s["predicted_source"] == "model"
    assert 0 < s["predicted_vram_utilization_mean"] <= s["predicted_vram_utilization_max"]
    assert s["num_planned"] + s["num_excluded"] == 800 and s["duplicates"] == 0

    steps, run = root / "steps.parquet", root / "run.json"
    done = adaptiveload(
        "simulate",
        "--plan",
        str(plan),
        "--calibration",
        str(plan_inputs["calibration"]),
        "--allreduce-gbps",
        "400",
        "--json",
        "-o",
        str(steps),
        "--summary",
        str(run),
    )
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads(run.read_text())
    assert printed["policy"] == "adaptiveload-balanced" and printed["source"] == "model"
    assert printed["imbalance_rate"] == pytest.approx(s["predicted_imbalance_rate"])
    assert printed["allreduce_s"] == pytest.approx(2 * 7 / 8 * 5.2e9 / 50e9)
    per_step = pd.read_parquet(steps)
    assert list(per_step.columns) == list(STEP_COLUMNS) and len(per_step) == s["steps"] * 8


def test_pack_tokens_caps_every_pack(plan_inputs):
    out = plan_inputs["root"] / "capped"
    done = adaptiveload("plan", "--manifest", str(plan_inputs["manifest"]), "--policy",
                        "adaptiveload-packed", "--seed", "0", "--world-size", "4",
                        "--calibration", str(plan_inputs["calibration"]), "--pack-tokens", "60000",
                        "-o", str(out.with_suffix(".parquet")),
                        "--summary", str(out.with_suffix(".json")))
    assert done.returncode == 0, done.stderr
    assert " packs, " in done.stdout and "x the steps' lower bound" in done.stdout
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["pack_tokens"] == 60000 and summary["pack_limits"]["tokens"] == 60000
    table = pd.read_parquet(out.with_suffix(".parquet"))
    sums = table.groupby("batch_id").agg(n=("tokens", "size"), s=("tokens", "sum"))
    assert (sums.loc[sums["n"] > 1, "s"] <= 60000).all()


def test_plan_leaves_the_held_out_split_out_as_training_does(
    plan_inputs, tmp_path, monkeypatch, capsys
):
    """`--val-split` (the pipeline passes data.val_split): those rows are scored by training,
    never trained on, so the plan `train --plan` checks must not hold them."""
    from cli_runner import run

    from adaptiveload.data.manifest import load_manifest, write_manifest

    frame = load_manifest(plan_inputs["manifest"])
    frame["split"] = ["val" if i % 8 == 0 else "train" for i in range(len(frame))]
    manifest, summary = tmp_path / "split.parquet", tmp_path / "summary.json"
    write_manifest(manifest, frame)
    args = ["--manifest", str(manifest), "--policy", "equal-token", "--world-size", "4"]
    args += ["--seed", "0", "--m-tok", "80000", "--summary", str(summary)]
    code, _, err = run(monkeypatch, capsys, "plan", *args, "--val-split", "val")
    assert code == 0, err
    assert json.loads(summary.read_text())["num_samples"] == len(frame) - len(frame) // 8
