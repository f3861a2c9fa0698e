"""Emulated CPU ranks are timed by the computing thread's CPU time, beside the wall clock, and
every output says which clock it used: the per-step table, the summary, the label the
analysis gives the run and the MLflow run's `timer` tag. No assertion on speed: only on what
must hold however busy the machine is."""

from __future__ import annotations

import pandas as pd
import torch
from mlflow.tracking import MlflowClient
from training_setup import write_experiment

from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.tracking.run import RunTracker
from adaptiveload.tracking.store import experiment_name, init_store
from adaptiveload.training.distributed import THREAD_TIME
from adaptiveload.training.session import Request, train


def test_emulated_cpu_run_is_thread_timed_and_says_so(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    init_store(uri)
    exp = write_experiment(tmp_path, name="timer", steps=4, warmup_steps=1)
    out = tmp_path / "run"
    threads = torch.get_num_threads()
    req = Request(config=exp, policy="adaptiveload-balanced", seed=0, out=out, progress=False,
                  checkpoint=False)
    summary = train(req, open_sink=RunTracker.open)
    assert torch.get_num_threads() == threads  # one thread while training, then restored

    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == 4 * 3
    assert (steps["compute_s"] > 0).all()
    # one thread's CPU time cannot exceed the wall time of the same span (1 ms: clock ticks)
    assert (steps["compute_s"] <= steps["compute_wall_s"] + 1e-3).all()
    per_step = steps.groupby("step")
    critical = per_step["compute_s"].max()
    assert (per_step["step_time_s"].first() >= critical).all()
    assert (per_step["step_wall_s"].first() >= per_step["compute_wall_s"].max()).all()
    assert (steps["wait_s"] == critical.loc[steps["step"]].to_numpy() - steps["compute_s"]).all()

    assert summary["timer"] == THREAD_TIME
    timed = steps[steps["step"] >= 1].groupby("step").first()
    assert summary["samples_per_s"] == steps[steps["step"] >= 1]["samples"].sum() / (
        timed["step_time_s"].sum()
    )
    assert summary["samples_per_s_wall"] == steps[steps["step"] >= 1]["samples"].sum() / (
        timed["step_wall_s"].sum()
    )

    client = MlflowClient(uri)
    mlexp = client.get_experiment_by_name(experiment_name("timer"))
    (run,) = client.search_runs([mlexp.experiment_id])
    assert run.data.tags["timer"] == THREAD_TIME
    assert "summary/samples_per_s_wall" in run.data.metrics

    index = [{"setup": "train", "summary": str(out / "summary.json"),
              "steps": str(out / "steps.parquet")}]
    label = aggregate(parse_index(index)).runs["label"].iloc[0]
    assert label.startswith(f"measured ({THREAD_TIME}, cpu:")
