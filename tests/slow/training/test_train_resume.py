"""Kill a real training run with SIGKILL, start the same command again: it resumes from the
last checkpoint, consumes the batches it would have, continues the same MLflow run and logs
no step twice. Checked against an uninterrupted reference run; likewise a packed LoRA
fine-tune from a tiny pretrained checkpoint, whose checkpoints hold the adapters alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pandas as pd
import torch
from finetune_setup import write_pretrained
from mlflow.tracking import MlflowClient
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, write_experiment

from adaptiveload.model.lora import is_lora_key
from adaptiveload.tracking.store import artifact_paths, experiment_name
from adaptiveload.training import checkpoint

STEPS, EVERY, KILL_AFTER = 12, 4, 4
SAME = ["step", "rank", "samples", "tokens", "frames", "height", "width"]


def _command(exp, out) -> list[str]:
    return ["train", "--config", str(exp), "--policy", "adaptiveload-balanced", "--seed", "1",
            "--emulate-world-size", "3", "--out", str(out)]


def test_sigkill_and_restart_matches_uninterrupted_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = cli_env(uri)
    assert adaptiveload("tracking", "init", env=env, cwd=ROOT).returncode == 0
    train = {"steps": STEPS, "checkpoint_every": EVERY, "warmup_steps": 2}
    ref_exp = write_experiment(tmp_path, name="ref", **train)
    kill_exp = write_experiment(tmp_path, name="kill", **train)
    ref_out, kill_out = tmp_path / "ref", tmp_path / "kill"

    ref = adaptiveload(*_command(ref_exp, ref_out), env=env, cwd=ROOT, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]

    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptiveload", *_command(kill_exp, kill_out)],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    ckpt = kill_out / "checkpoints" / f"ckpt-{KILL_AFTER:08d}.pt"
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"
    assert ckpt.exists() and not (kill_out / "steps.parquet").exists()
    client = MlflowClient(uri)
    mlexp = client.get_experiment_by_name(experiment_name("kill"))
    (run,) = client.search_runs(mlexp.experiment_id)
    logged_before = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert logged_before and logged_before[-1] < STEPS - 1

    again = adaptiveload(*_command(kill_exp, kill_out), env=env, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]

    # same batches per step and rank, same losses: the data order and the math resumed exactly
    a = pd.read_parquet(ref_out / "steps.parquet")
    b = pd.read_parquet(kill_out / "steps.parquet")
    assert len(a) == len(b) == STEPS * 3
    pd.testing.assert_frame_equal(a[SAME], b[SAME])
    pd.testing.assert_series_equal(a["loss"], b["loss"], rtol=1e-6, atol=0)

    # one MLflow run, every step exactly once, finished, summary and artifacts present
    mlexp = client.get_experiment_by_name(experiment_name("kill"))
    runs = client.search_runs(mlexp.experiment_id)
    assert [r.info.run_id for r in runs] == [run.info.run_id]
    for key in ("loss", "step_time_s", "imbalance_rate", "rank0/compute_s", "rank2/compute_s"):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == list(range(STEPS)), key
    final = client.get_run(run.info.run_id)
    assert final.info.status == "FINISHED"
    assert "summary/imbalance_rate_mean_of_steps" in final.data.metrics
    artifacts = set(artifact_paths(client, uri, run.info.run_id))
    assert {"steps.parquet", "plan_summary.json", "summary.json"} <= artifacts


def _kill_at(command: list[str], ckpt, env) -> None:
    """Start `adaptiveload COMMAND` and SIGKILL it once checkpoint file `ckpt` exists."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptiveload", *command],
        env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run finished before it could be killed"


def test_a_packed_lora_fine_tune_killed_and_restarted_equals_the_uninterrupted_run(tmp_path):
    steps, every = 24, 4
    pretrained = write_pretrained(tmp_path / "pretrained", "diffusers")
    exp = write_experiment(
        tmp_path, name="ft", model={"init_from": str(pretrained), "batch_layout": "packed"},
        steps=steps, checkpoint_every=every, warmup_steps=2, lora={"rank": 4, "alpha": 8.0},
    )
    env = cli_env()

    def command(out):
        return ["train", "--config", str(exp), "--policy", "adaptiveload-packed", "--seed", "1",
                "--emulate-world-size", "3", "--out", str(out), "--no-track"]

    ref_out, kill_out = tmp_path / "ref", tmp_path / "kill"
    ref = adaptiveload(*command(ref_out), env=env, cwd=ROOT, timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    _kill_at(command(kill_out), kill_out / "checkpoints" / f"ckpt-{every:08d}.pt", env)
    assert not (kill_out / "steps.parquet").exists()
    again = adaptiveload(*command(kill_out), env=env, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]

    a = pd.read_parquet(ref_out / "steps.parquet")
    b = pd.read_parquet(kill_out / "steps.parquet")
    assert len(a) == len(b) == steps * 3
    pd.testing.assert_frame_equal(a[SAME], b[SAME])
    assert a["loss"].tolist() == b["loss"].tolist()  # bit for bit: same batches, same math

    last = f"ckpt-{steps:08d}.pt"
    want = checkpoint.load_one(ref_out / "checkpoints" / last)
    got = checkpoint.load_one(kill_out / "checkpoints" / last)
    # the adapters alone are saved and stepped: the base is init_from's, fixed by its digest
    assert got["model"] and all(is_lora_key(k) for k in got["model"])
    assert len(got["optimizer"]["state"]) == len(got["model"])
    assert got["config"]["init_digest"] == want["config"]["init_digest"]
    assert got["model"].keys() == want["model"].keys()
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])

    # the same command once more: the run is complete, nothing trains, nothing changes
    stamp = (kill_out / "checkpoints" / last).stat().st_mtime_ns
    rerun = adaptiveload(*command(kill_out), env=env, cwd=ROOT, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (kill_out / "checkpoints" / last).stat().st_mtime_ns == stamp
    pd.testing.assert_frame_equal(pd.read_parquet(kill_out / "steps.parquet"), b)
