"""Packed micro-batches in the trainer: a plan whose cells mix bucket shapes trains, each row
reports its cell (samples = segments, tokens = sum S_i, the largest sample's shape,
peak_bytes_model = pack_memory), the step's gradient is the mean over all its samples; under
`adaptiveload train` the packed layout trains like the dense one (emulated and torchrun with
gloo, eager and fused); a dense run refuses mixed cells."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from mlflow.tracking import MlflowClient
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, free_port, write_experiment

from adaptiveload import experiment as experiment_config
from adaptiveload.io import read_json
from adaptiveload.tracking.store import experiment_name
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.settings import from_experiment

TORCHRUN = Path(sys.executable).parent / "torchrun"
SAME = ["step", "rank", "samples", "tokens", "tokens_sq", "frames", "height", "width"]


def _train(exp: Path, out: Path, kernel: str, env: dict, *extra: str, policy="adaptiveload"):
    return adaptiveload(
        "train", "--config", str(exp), "--policy", policy, "--seed", "0",
        "--kernel", kernel, "--emulate-world-size", "2", "--out", str(out), *extra,
        env=env, cwd=ROOT, timeout=600,
    )


def test_adaptiveload_train_runs_the_packing_planners_packs(tmp_path):
    """Policy adaptiveload-packed under `adaptiveload train` (layout auto, so packed): every
    row is the cell the plan made, most cells mix shapes; a dense layout is refused in one
    line naming the file and field, before anything is written."""
    exp_path = write_experiment(tmp_path, world_size=2, steps=3, checkpoint_every=3)
    env = cli_env()
    done = _train(exp_path, tmp_path / "run", "fused", env, "--no-track",
                  policy="adaptiveload-packed")
    assert done.returncode == 0, done.stderr[-3000:]
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    exp = experiment_config.load(exp_path)
    cfg = from_experiment(exp, "adaptiveload-packed", 0, launch_mode="emulated", world_size=2)
    plan = prepare_data(exp, cfg).builder(0).table
    plan = plan.assign(tokens_sq=plan["tokens"] ** 2)
    cells = plan.groupby(["step", "rank"]).agg(
        samples=("tokens", "size"), tokens=("tokens", "sum"), tokens_sq=("tokens_sq", "sum"),
        shapes=("frames", "nunique"),
    )
    got = steps.set_index(["step", "rank"])[["samples", "tokens", "tokens_sq"]]
    want = cells.loc[got.index, ["samples", "tokens", "tokens_sq"]]
    pd.testing.assert_frame_equal(got, want, check_dtype=False)
    assert (cells["shapes"] > 1).mean() > 0.5
    assert read_json(tmp_path / "run" / "summary.json")["batch_layout"] == "packed"

    dense = write_experiment(tmp_path, name="dense", model={"batch_layout": "dense"},
                             world_size=2, steps=3)
    refused = _train(dense, tmp_path / "refused", "eager", env, "--no-track",
                     policy="adaptiveload-packed")
    assert refused.returncode == 2
    line = refused.stderr.strip().splitlines()[-1]
    assert str(dense) in line and "model.batch_layout" in line and "packed" in line
    assert not (tmp_path / "refused").exists() or not any((tmp_path / "refused").iterdir())


def test_adaptiveload_train_packed_equals_dense_and_records_its_backend(tmp_path):
    """Today's plans (one shape per cell) through the packed path: same batches, same losses;
    the layout and the attention backend are tagged and summarised."""
    train = {"world_size": 2, "steps": 3, "checkpoint_every": 3}
    dense = write_experiment(tmp_path, name="dense", **train)
    packed = write_experiment(tmp_path, name="packed", model={"batch_layout": "packed"}, **train)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = cli_env(uri)
    assert adaptiveload("tracking", "init", env=env, cwd=ROOT).returncode == 0
    runs = {}
    for name, exp in (("dense", dense), ("packed", packed)):
        done = _train(exp, tmp_path / name, "eager", env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = pd.read_parquet(tmp_path / name / "steps.parquet")
    pd.testing.assert_frame_equal(runs["dense"][SAME], runs["packed"][SAME])
    pd.testing.assert_series_equal(runs["dense"]["loss"], runs["packed"]["loss"], rtol=1e-5,
                                   atol=0)

    summary = read_json(tmp_path / "packed" / "summary.json")
    assert (summary["batch_layout"], summary["attention_backend"]) == ("packed", "sdpa-runs")
    client = MlflowClient(uri)
    for name, backend in (("dense", "sdpa"), ("packed", "sdpa-runs")):
        mlexp = client.get_experiment_by_name(experiment_name(name))
        (run,) = client.search_runs(mlexp.experiment_id)
        assert run.data.tags["batch_layout"] == name
        assert run.data.tags["attention_backend"] == backend


def test_torchrun_gloo_trains_packed_batches_like_emulated_ranks(tmp_path):
    """2 gloo processes (DDP) on the packing planner's packs with the fused op's CPU path:
    the same batches, losses and weights as 2 emulated ranks."""
    exp = write_experiment(tmp_path, world_size=2, steps=3, checkpoint_every=3)
    env = cli_env()
    emu = _train(exp, tmp_path / "emu", "fused", env, "--no-track", policy="adaptiveload-packed")
    assert emu.returncode == 0, emu.stderr[-3000:]
    dist = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), "-m", "adaptiveload", "train", "--config", str(exp),
         "--policy", "adaptiveload-packed", "--seed", "0", "--kernel", "fused", "--no-track",
         "--out", str(tmp_path / "ddp")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert dist.returncode == 0, dist.stderr[-3000:]
    a = pd.read_parquet(tmp_path / "emu" / "steps.parquet")
    b = pd.read_parquet(tmp_path / "ddp" / "steps.parquet")
    pd.testing.assert_frame_equal(a[SAME], b[SAME])
    pd.testing.assert_series_equal(a["loss"], b["loss"], rtol=1e-5, atol=0)
    wa = torch.load(tmp_path / "emu" / "checkpoints" / "ckpt-00000003.pt", weights_only=False)
    wb = torch.load(tmp_path / "ddp" / "checkpoints" / "ckpt-00000003.pt", weights_only=False)
    assert wb["config"]["batch_layout"] == "packed"
    for name, tensor in wa["model"].items():
        torch.testing.assert_close(wb["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
