"""Kill a real training run with SIGKILL, start the same command again: it resumes from the
last checkpoint, consumes the batches it would have, continues the same MLflow run and logs
no step twice. Checked against an uninterrupted reference run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pandas as pd
from mlflow.tracking import MlflowClient
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, write_experiment

from adaptiveload.tracking.store import artifact_paths, experiment_name

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
