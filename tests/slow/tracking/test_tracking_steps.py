"""A training run planned at matched steps says so in MLflow: the step mode as a tag and a
param, the plan's steps per epoch and K_min as summary metrics, read back from a real sqlite
store; the plan it trained has equal-token's step count."""

from __future__ import annotations

import yaml
from mlflow.tracking import MlflowClient
from training_setup import write_experiment

from adaptiveload import experiment
from adaptiveload.tracking.run import RunTracker
from adaptiveload.tracking.store import experiment_name, init_store
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.session import Request, train
from adaptiveload.training.settings import from_experiment


def test_matched_run_logs_its_step_mode_and_epoch_terms(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    init_store(uri)
    path = write_experiment(tmp_path, name="matched", steps=3, warmup_steps=1)
    cfg = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**cfg, "plan": {"steps_per_epoch": "match"}}))
    exp = experiment.load(path)
    world = exp["train"]["world_size"]

    def planned_steps(policy: str, mode: str) -> int:
        at = {**exp, "plan": {"steps_per_epoch": mode}}
        run = from_experiment(at, policy, 0, launch_mode="emulated", world_size=world)
        return prepare_data(at, run).builder(0).summary["steps"]

    target = planned_steps("equal-token", "free")
    assert planned_steps("adaptiveload-packed", "free") < target  # matching changes its plan

    req = Request(config=path, policy="adaptiveload-packed", seed=0, out=tmp_path / "run",
                  progress=False, checkpoint=False)
    summary = train(req, open_sink=RunTracker.open)
    assert summary["steps_per_epoch"] == "match" and summary["epoch_steps"] == target

    client = MlflowClient(uri)
    mlexp = client.get_experiment_by_name(experiment_name("matched"))
    (run,) = client.search_runs([mlexp.experiment_id])
    assert run.data.tags["steps_per_epoch"] == "match"
    assert run.data.params["experiment.plan.steps_per_epoch"] == "match"
    assert run.data.metrics["summary/epoch_steps"] == target
    k_min = summary["min_steps_per_epoch"]
    assert k_min is not None and 1 <= k_min <= target
    assert run.data.metrics["summary/min_steps_per_epoch"] == k_min
