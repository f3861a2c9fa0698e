"""Run state around changes and failures, end to end with real `adaptiveload train` processes
and a real sqlite MLflow store: a changed input never resumes stale state, a killed run
never stays RUNNING beside its rerun, another tracking store gets a fresh run, and a killed
parent (Snakemake) takes its training child with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from fault_setup import alive
from mlflow.tracking import MlflowClient
from repo_paths import ROOT
from training_setup import adaptiveload, cli_env, notes, write_experiment

from adaptiveload.tracking.run import RUN_DIR_TAG, SUPERSEDED_TAG
from adaptiveload.tracking.store import experiment_name, init_store
from adaptiveload.training.inputs import prepare_data, run_identity
from adaptiveload.training.settings import from_experiment


def _train(exp: Path, out: Path, env: dict[str, str], *extra: str):
    return adaptiveload(
        "train", "--config", str(exp), "--policy", "adaptiveload", "--seed", "0",
        "--out", str(out), *extra, env=env, cwd=ROOT, timeout=600,
    )


def _runs(uri: str, experiment: str) -> list:
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment_name(experiment))
    return [] if exp is None else client.search_runs([exp.experiment_id])


def test_identity_covers_budgets_calibration_data_and_plan(tmp_path):
    """Each input that changes the results changes the identity (no training needed)."""
    from adaptiveload import experiment

    def identity(**changes) -> dict[str, str]:
        path = write_experiment(tmp_path, steps=2, warmup_steps=1)
        raw = yaml.safe_load(path.read_text())
        for section, values in changes.items():
            raw[section].update(values)
        path.write_text(yaml.safe_dump(raw))
        exp = experiment.load(path)
        cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=3)
        return run_identity(cfg, prepare_data(exp, cfg))

    base = identity()
    assert identity() == base  # deterministic
    budget = identity(budgets={"m_comp": 50000})
    assert budget["budgets"] != base["budgets"] and budget["identity"] != base["identity"]
    data = identity(data={"num_samples": 90})
    assert data["data"] != base["data"] and data["plan"] != base["plan"]
    lr = identity(train={"lr": 2e-4})
    assert lr["config"] != base["config"] and lr["identity"] != base["identity"]
    assert base["code"].count("+") == 1  # package version + source hash


def test_changed_inputs_start_over_and_supersede_the_old_run(tmp_path):
    """A finished run, then its data change (a plan of another length): the rerun starts
    over with a one-line note instead of re-emitting the old table or crashing."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    env = cli_env(uri)
    exp = write_experiment(tmp_path, steps=2, warmup_steps=1, checkpoint_every=2)
    out = tmp_path / "run"
    first = _train(exp, out, env)
    assert first.returncode == 0, first.stderr[-2000:]
    old_steps = pd.read_parquet(out / "steps.parquet")

    raw = yaml.safe_load(exp.read_text())
    raw["data"]["num_samples"] = 60
    exp.write_text(yaml.safe_dump(raw))
    second = _train(exp, out, env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Traceback" not in second.stderr
    (note,) = notes(second.stderr)
    assert "another run" in note and "starting over from step 0" in note

    reference = _train(exp, tmp_path / "fresh", env, "--no-track")
    assert reference.returncode == 0, reference.stderr[-2000:]
    new_steps = pd.read_parquet(out / "steps.parquet")
    same = ["step", "rank", "samples", "tokens"]
    pd.testing.assert_frame_equal(
        new_steps[same], pd.read_parquet(tmp_path / "fresh" / "steps.parquet")[same]
    )
    assert not new_steps[same].equals(old_steps[same])

    runs = {r.info.run_id: r for r in _runs(uri, "t")}
    assert len(runs) == 2
    (old,) = [r for r in runs.values() if SUPERSEDED_TAG in r.data.tags]
    (new,) = [r for r in runs.values() if SUPERSEDED_TAG not in r.data.tags]
    assert old.data.tags[SUPERSEDED_TAG] == new.info.run_id
    assert new.info.status == "FINISHED" and old.info.status != "RUNNING"

    # the same finished command against another store: a fresh run there, said in one line
    other = init_store(f"sqlite:///{tmp_path / 'other.db'}")
    third = _train(exp, out, cli_env(other))
    assert third.returncode == 0, third.stderr[-2000:]
    assert "Traceback" not in third.stderr
    (note,) = notes(third.stderr)
    assert "not in the store" in note and new.info.run_id in note
    (moved,) = _runs(other, "t")
    assert moved.info.status == "FINISHED"
    assert "summary/imbalance_rate_mean_of_steps" in moved.data.metrics


def test_run_killed_before_its_first_checkpoint_is_not_left_running(tmp_path):
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    env = cli_env(uri)
    exp = write_experiment(tmp_path, steps=3, warmup_steps=1, checkpoint_every=100)
    out = tmp_path / "run"
    cmd = ["train", "--config", str(exp), "--policy", "adaptiveload", "--seed", "0",
           "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "adaptiveload", *cmd], env=env, cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not _runs(uri, "t") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
    (orphan,) = _runs(uri, "t")
    assert orphan.info.status == "RUNNING"

    again = adaptiveload(*cmd, env=env, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    runs = {r.info.run_id: r for r in _runs(uri, "t")}
    assert len(runs) == 2
    killed = runs[orphan.info.run_id]
    (new_id,) = set(runs) - {orphan.info.run_id}
    assert killed.info.status == "KILLED"
    assert killed.data.tags[SUPERSEDED_TAG] == new_id
    assert runs[new_id].info.status == "FINISHED"
    assert runs[new_id].data.tags[RUN_DIR_TAG] == "run"  # relative to the store's folder


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_training_child_dies_with_its_killed_parent_and_ends_its_run_failed(tmp_path):
    """As the Snakemake rule runs it (`exec` under bash): SIGKILL the parent, the trainer
    goes too instead of training on unobserved, and its MLflow run ends FAILED, not RUNNING
    (the dying parent can deliver two SIGTERMs; the second must not interrupt the first's
    clean-up)."""
    uri = init_store(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = write_experiment(tmp_path, steps=10000, warmup_steps=1, checkpoint_every=1)
    out = tmp_path / "run"
    rule = (
        f"OMP_NUM_THREADS=1 ADAPTIVELOAD_DIE_WITH_PARENT=1 exec {sys.executable} -m adaptiveload "
        f"train --config {exp} --policy adaptiveload --seed 0 --out {out}"
    )
    parent_code = (
        "import subprocess, sys\n"
        f"p = subprocess.Popen(['bash', '-c', {rule!r}], stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "p.wait()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code], env=cli_env(uri), cwd=ROOT, stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 300
        ckpt = out / "checkpoints" / "ckpt-00000001.pt"
        while not ckpt.exists() and alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ckpt.exists(), "training did not start"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the trainer outlived its killed parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)
    (run,) = _runs(uri, "t")
    assert run.info.status == "FAILED"
