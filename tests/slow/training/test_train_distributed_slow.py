"""torchrun with 2 gloo processes (real DDP, FSDP2) trains exactly like 2 emulated ranks.

Launched as the README launches a training stage by hand: the `torchrun` beside this Python,
`-m adaptiveload train` with --kernel, --manifest and --out."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch
from mlflow.tracking import MlflowClient
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, free_port, write_experiment

from adaptiveload.tracking.store import experiment_name

TORCHRUN = Path(sys.executable).parent / "torchrun"
SAME = ["step", "rank", "samples", "tokens", "frames", "height", "width"]


def test_torchrun_ddp_matches_emulated(tmp_path):
    exp = write_experiment(tmp_path, world_size=2, steps=3, checkpoint_every=3)
    manifest = tmp_path / "manifest.parquet"
    made = adaptiveload("manifest", "synth", "--mixture", "tiny-cpu", "-n", "120", "--seed", "0",
                        "-o", str(manifest), env=cli_env(), cwd=ROOT)
    assert made.returncode == 0, made.stderr
    args = ["--config", str(exp), "--policy", "adaptiveload", "--seed", "0", "--kernel", "eager",
            "--manifest", str(manifest)]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = cli_env(uri)
    assert adaptiveload("tracking", "init", env=env, cwd=ROOT).returncode == 0

    emu = adaptiveload("train", *args, "--emulate-world-size", "2", "--no-track",
                       "--out", str(tmp_path / "emu"), env=env, cwd=ROOT, timeout=600)
    assert emu.returncode == 0, emu.stderr[-3000:]
    dist = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()),
         "-m", "adaptiveload", "train", *args, "--out", str(tmp_path / "ddp")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert dist.returncode == 0, dist.stderr[-3000:]

    a = pd.read_parquet(tmp_path / "emu" / "steps.parquet")
    b = pd.read_parquet(tmp_path / "ddp" / "steps.parquet")
    pd.testing.assert_frame_equal(a[SAME], b[SAME])
    pd.testing.assert_series_equal(a["loss"], b["loss"], rtol=1e-5, atol=0)
    assert (b["wait_s"] >= 0).all() and (b["compute_s"] > 0).all()

    # same weights after the same steps: DDP's averaged gradient == the emulated accumulation
    wa = torch.load(tmp_path / "emu" / "checkpoints" / "ckpt-00000003.pt", weights_only=False)
    wb = torch.load(tmp_path / "ddp" / "checkpoints" / "ckpt-00000003.pt", weights_only=False)
    for name, tensor in wa["model"].items():
        torch.testing.assert_close(wb["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
    assert wb["config"]["launch_mode"] == "distributed"

    client = MlflowClient(uri)
    mlexp = client.get_experiment_by_name(experiment_name("t"))
    (run,) = client.search_runs(mlexp.experiment_id)
    assert run.data.tags["launch_mode"] == "distributed"
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert steps == [0, 1, 2]  # logged by rank 0 only, once per step


def test_torchrun_fsdp2_matches_emulated(tmp_path):
    """FSDP2 fully_shard (the 14B option) on 2 gloo processes: same losses and weights."""
    exp = write_experiment(tmp_path, world_size=2, steps=2, checkpoint_every=2)
    sharded = write_experiment(tmp_path, name="fsdp", world_size=2, steps=2, checkpoint_every=2,
                               fsdp=True)
    args = ["--policy", "adaptiveload", "--seed", "0", "--no-track"]
    env = cli_env()
    emu = adaptiveload("train", "--config", str(exp), *args, "--emulate-world-size", "2",
                       "--out", str(tmp_path / "emu"), env=env, cwd=ROOT, timeout=600)
    assert emu.returncode == 0, emu.stderr[-3000:]
    dist = subprocess.run(
        [TORCHRUN, "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()),
         "-m", "adaptiveload", "train", "--config", str(sharded), *args,
         "--out", str(tmp_path / "fsdp")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert dist.returncode == 0, dist.stderr[-3000:]
    a = pd.read_parquet(tmp_path / "emu" / "steps.parquet")
    b = pd.read_parquet(tmp_path / "fsdp" / "steps.parquet")
    pd.testing.assert_series_equal(a["loss"], b["loss"], rtol=1e-5, atol=0)
    wa = torch.load(tmp_path / "emu" / "checkpoints" / "ckpt-00000002.pt", weights_only=False)
    wb = torch.load(tmp_path / "fsdp" / "checkpoints" / "ckpt-00000002.pt", weights_only=False)
    assert set(wa["model"]) == set(wb["model"])  # full (unsharded) state dict
    for name, tensor in wa["model"].items():
        torch.testing.assert_close(wb["model"][name], tensor, rtol=1e-4, atol=1e-6, msg=name)
