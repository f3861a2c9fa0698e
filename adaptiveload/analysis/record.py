"""Log the analysis of one experiment to MLflow as its own run ("analysis"), beside the training
runs: a few headline numbers per paper-table row as metrics, every table (the paper table,
stats.csv with all tests, ...) and figure as artifacts, the resolved experiment as params.

Metric keys are short and stable, `<setup>/<kernel>/<policy>/<column>` of the paper table's
numeric columns in `HEADLINE` (e.g. `train/eager/adaptiveload/throughput_change`); the
statistical tests are rows of the `tables/stats.csv` artifact, not metrics. Re-running the
analysis replaces the previous analysis run (it is deleted, i.e. moved to MLflow's trash) once
the new one is complete, so the experiment shows one current analysis, never a partial one;
a partial run a killed record left (RUNNING, SIGKILL allows no clean-up) goes with its files.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload.provenance import git_commit
from adaptiveload.tracking.store import (
    DESCRIPTION_TAG,
    _client,
    check_reachable,
    chunked,
    experiment_id,
    log_artifact,
    log_params,
    run_artifact_dir,
    store_errors,
    tracking_uri,
)

KIND_TAG = "adaptiveload.kind"
# paper-table columns logged as metrics: means over seeds, changes vs the baseline (fractions)
HEADLINE = (
    "imbalance_rate", "idle_fraction", "vram_utilization", "samples_per_s", "padding_fraction",
    "samples_per_step_mean", "throughput_change", "imbalance_change", "vs_epoch_lower_bound",
    "min_steps_per_epoch",
)


def _key(*parts: str) -> str:
    """An MLflow metric key of `parts` joined by '/', each reduced to [A-Za-z0-9_.-]."""
    return "/".join(re.sub(r"[^A-Za-z0-9_.\-]+", "_", str(p)).strip("_") for p in parts)


def metrics_of(paper: pd.DataFrame) -> dict[str, float]:
    """Headline metrics: `<setup>/<kernel>/<policy>/<column>` for each column in HEADLINE."""
    out: dict[str, float] = {}
    columns = [c for c in HEADLINE if c in paper.columns]
    for _, row in paper.iterrows():
        for col in columns:
            out[_key(*str(row["setup"]).split("/"), row["kernel"], row["policy"], col)] = row[col]
    return {k: float(v) for k, v in out.items() if v is not None and np.isfinite(v)}


def log_analysis(
    experiment: str,
    paper_table: Path,
    stats: Path,
    artifacts: Sequence[Path],
    config: Mapping[str, Any] | None = None,
    uri: str | None = None,
) -> str:
    """Create the experiment's analysis run: headline metrics, `config` as params, the paper
    table, stats and `artifacts` as files (PNGs under figures/, the rest under tables/).

    The previous analysis run is deleted only once the new one is complete (FINISHED with
    every file); if anything fails before that, the new run is deleted instead and the
    previous one stays the experiment's analysis. A store that refuses is one UserError."""
    headline = metrics_of(pd.read_csv(paper_table))
    files = dict.fromkeys([Path(paper_table), Path(stats), *map(Path, artifacts)])  # ordered set
    uri = check_reachable(uri or tracking_uri())
    client = _client(uri)
    with store_errors(uri):
        description = (config or {}).get("description")
        exp_id = experiment_id(client, uri, experiment, description)
        previous = client.search_runs([exp_id], filter_string=f"tags.`{KIND_TAG}` = 'analysis'")
        run_id = client.create_run(exp_id, run_name="analysis", tags=_tags(experiment)).info.run_id
        try:
            log_params(client, run_id, {"experiment": dict(config or {"name": experiment})})
            _fill(client, uri, run_id, headline, list(files))
        except BaseException:
            _discard(client, uri, run_id)
            raise
        for old in previous:
            if old.info.status == "FINISHED":
                client.delete_run(old.info.run_id)  # to MLflow's trash, files kept
            else:  # a killed record's partial run: nothing to restore, its files go too
                _discard(client, uri, old.info.run_id)
    return run_id


def _tags(experiment: str) -> dict[str, str]:
    return {
        KIND_TAG: "analysis",
        "git_commit": git_commit(),
        "experiment": experiment,
        DESCRIPTION_TAG: (
            f"Analysis of experiment {experiment}: the paper table's headline numbers per "
            "setup/kernel/policy as metrics (changes are fractions vs the baseline); every "
            "test (Mann-Whitney U, Welch's t, paired tests, bootstrap CIs) in tables/stats.csv."
        ),
    }


def _fill(client: Any, uri: str, run_id: str, headline: dict[str, float], files: list[Path]):
    """The headline metrics and every file of the analysis run (PNGs under figures/, the rest
    under tables/), then FINISHED."""
    from mlflow.entities import Metric

    ts = int(pd.Timestamp.now().timestamp() * 1000)
    metrics = [Metric(k, v, ts, 0) for k, v in sorted(headline.items())]
    for chunk in chunked(metrics):
        client.log_batch(run_id, metrics=chunk, synchronous=True)
    for path in files:
        log_artifact(client, uri, run_id, path, "figures" if path.suffix == ".png" else "tables")
    client.set_terminated(run_id)


def _discard(client: Any, uri: str, run_id: str) -> None:
    """Best effort after a failed analysis run: end and delete it and, in a sqlite store,
    remove the files it got, so the experiment shows the previous, complete analysis only."""
    local = None
    with contextlib.suppress(Exception):
        local = run_artifact_dir(uri, client.get_run(run_id).info.artifact_uri)
    with contextlib.suppress(Exception):
        client.set_terminated(run_id, status="FAILED")
    with contextlib.suppress(Exception):
        client.delete_run(run_id)
    if local is not None:  # <experiment>/<run id>/artifacts: the run's folder goes too
        shutil.rmtree(local, ignore_errors=True)
        with contextlib.suppress(OSError):
            local.parent.rmdir()
