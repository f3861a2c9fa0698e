"""Log the analysis of one experiment to MLflow as its own run ("analysis"), beside the training
runs: the paper table's numbers and the tests as metrics, tables and figures as artifacts.

Re-running the analysis replaces the previous analysis run (it is deleted, i.e. moved to
MLflow's trash), so the experiment shows one current analysis.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload.tracking.store import (
    artifact_location,
    chunked,
    configure_environment,
    tracking_uri,
)

KIND_TAG = "adaptiveload.kind"


def _key(*parts: str) -> str:
    """An MLflow-safe metric key (alphanumerics, _ - . / and spaces)."""
    return "/".join(re.sub(r"[^A-Za-z0-9_.\- ]+", "_", str(p)).strip("_") for p in parts)


def metrics_of(paper: pd.DataFrame, stats: pd.DataFrame) -> dict[str, float]:
    """Flat metric dict: table/<setup>/<kernel>/<policy>/<column> and stats/.../{estimate,p}."""
    out: dict[str, float] = {}
    numeric = paper.select_dtypes("number").columns
    for _, row in paper.iterrows():
        for col in numeric:
            out[_key("table", row["setup"], row["kernel"], row["policy"], col)] = row[col]
    for _, row in stats.iterrows():
        stem = ("stats", row["setup"], row["variant"], row["kernel"], row["policy"],
                row["metric"], row["test"])
        out[_key(*stem, "estimate")] = row["estimate"]
        out[_key(*stem, "p_value")] = row["p_value"]
    return {k: float(v) for k, v in out.items() if v is not None and np.isfinite(v)}


def log_analysis(
    experiment: str,
    paper: pd.DataFrame,
    stats: pd.DataFrame,
    artifacts: Sequence[Path],
    uri: str | None = None,
) -> str:
    """Create the experiment's analysis run, log metrics in batches and the files; return its id."""
    configure_environment()
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    uri = uri or tracking_uri()
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = (exp.experiment_id if exp is not None
              else client.create_experiment(experiment, artifact_location=artifact_location(uri)))
    for old in client.search_runs([exp_id], filter_string=f"tags.`{KIND_TAG}` = 'analysis'"):
        client.delete_run(old.info.run_id)
    run = client.create_run(exp_id, run_name="analysis", tags={KIND_TAG: "analysis"})
    run_id = run.info.run_id
    ts = int(pd.Timestamp.now().timestamp() * 1000)
    metrics = [Metric(k, v, ts, 0) for k, v in sorted(metrics_of(paper, stats).items())]
    for chunk in chunked(metrics):
        client.log_batch(run_id, metrics=chunk, synchronous=True)
    for path in artifacts:
        folder = "figures" if path.suffix == ".png" else "tables"
        client.log_artifact(run_id, str(path), artifact_path=folder)
    client.set_terminated(run_id)
    return run_id
