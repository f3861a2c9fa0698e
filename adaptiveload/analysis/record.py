"""Log the analysis of one experiment to MLflow: its own run ("analysis") beside the training
runs, and its simulations as runs of their own experiment.

The analysis run (experiment `adaptiveload/<experiment>`) holds a handful of headline
metrics, those of the first setup (the measured one where the experiment trains): per policy
its mean samples/s and imbalance and, but for the baseline, its speedup over the baseline with
the interval's ends (`<policy>/speedup`, `<policy>/speedup_ci_low`, ...; `<policy>/<kernel>/...`
with several kernels); every table and figure as artifacts; the resolved experiment as params.
The numbers of every other setup are in the tables; the statistical tests are rows of the
`tables/stats.csv` artifact, not metrics.

The simulations (model estimates) are runs of `adaptiveload/<experiment>/simulations`, one
per simulated setup, variant, policy and seed, tagged `source: model`: their summary metrics
and, per step, imbalance, step time, samples/s and `warmup`.

Re-running replaces the previous analysis run and simulation runs (deleted, i.e. moved to
MLflow's trash) once the new ones are complete, so the experiment shows one current analysis,
never a partial one; a partial run a killed record left (RUNNING, SIGKILL allows no
clean-up) goes with its files.
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

from adaptiveload.analysis.aggregate import SUMMARY_METRICS, per_step
from adaptiveload.analysis.landing import policy_order, speedups
from adaptiveload.pipeline import BASE_VARIANT
from adaptiveload.provenance import git_commit
from adaptiveload.step_table import WARMUP_KEY, timed
from adaptiveload.tracking.store import (
    DESCRIPTION_TAG,
    SIMULATIONS,
    _client,
    check_reachable,
    chunked,
    experiment_id,
    experiment_name,
    log_artifact,
    log_params,
    run_artifact_dir,
    store_errors,
    tracking_uri,
    ui_path,
)

KIND_TAG = "adaptiveload.kind"
HEADLINE_SETUP_TAG = "adaptiveload.headline_setup"  # the setup the headline metrics are of
# the per-step metrics of a simulation run: its per-step table's column -> the metric key
SIM_STEP_METRICS = {"imbalance": "imbalance_rate", "step_time_s": "step_time_s",
                    "samples_per_s": "samples_per_s"}


def _key(*parts: str) -> str:
    """An MLflow metric key of `parts` joined by '/', each reduced to [A-Za-z0-9_.-]."""
    return "/".join(re.sub(r"[^A-Za-z0-9_.\-]+", "_", str(p)).strip("_") for p in parts)


def headline_setup(runs: pd.DataFrame) -> str:
    """The setup the analysis run's metrics are of: the measured one where the experiment
    trains, else its first simulation."""
    return sorted(set(runs["setup"]), key=lambda s: (not s.startswith("train"), s))[0]


def headline_metrics(runs: pd.DataFrame, stats: pd.DataFrame) -> dict[str, float]:
    """The analysis run's metrics (module docstring): of `headline_setup`, base variant, per
    policy (and kernel where there are several)."""
    setup = headline_setup(runs)
    mine = runs[(runs["setup"] == setup) & (runs["variant"] == BASE_VARIANT)]
    ratios = speedups(stats)
    ratios = ratios[ratios["setup"] == setup].set_index(["kernel", "policy"])
    several = mine["kernel"].nunique() > 1
    out: dict[str, float] = {}
    for policy in policy_order(mine["policy"]):
        for kernel, sel in mine[mine["policy"] == policy].groupby("kernel", sort=True):
            name = (policy, kernel) if several else (policy,)
            out[_key(*name, "samples_per_s")] = sel["samples_per_s"].mean()
            out[_key(*name, "imbalance_rate")] = sel["imbalance_rate"].mean()
            if (kernel, policy) in ratios.index:
                row = ratios.loc[(kernel, policy)]
                for col, key in (("estimate", "speedup"), ("ci_low", "speedup_ci_low"),
                                 ("ci_high", "speedup_ci_high")):
                    out[_key(*name, key)] = row[col]
    return {k: float(v) for k, v in out.items() if v is not None and np.isfinite(v)}


def log_analysis(
    experiment: str,
    runs: pd.DataFrame,
    stats: Path,
    artifacts: Sequence[Path],
    config: Mapping[str, Any] | None = None,
    uri: str | None = None,
) -> tuple[str, str]:
    """Create the experiment's analysis run: headline metrics (`headline_metrics` of `runs`
    and the statistics), `config` as params, stats and `artifacts` as files (PNGs under
    figures/, the rest under tables/). Returns its run id and the UI path of its
    experiment's runs (`ui_path`).

    The previous analysis run is deleted only once the new one is complete (FINISHED with
    every file); if anything fails before that, the new run is deleted instead and the
    previous one stays the experiment's analysis. A store that refuses is one UserError."""
    headline = headline_metrics(runs, pd.read_csv(stats))
    files = dict.fromkeys([Path(stats), *map(Path, artifacts)])  # ordered set
    uri = check_reachable(uri or tracking_uri())
    client = _client(uri)
    with store_errors(uri):
        description = (config or {}).get("description")
        exp_id = experiment_id(client, uri, experiment_name(experiment), description)
        previous = client.search_runs([exp_id], filter_string=f"tags.`{KIND_TAG}` = 'analysis'")
        tags = {**_tags(experiment), HEADLINE_SETUP_TAG: headline_setup(runs)}
        run_id = client.create_run(exp_id, run_name="analysis", tags=tags).info.run_id
        try:
            log_params(client, run_id, {"experiment": dict(config or {"name": experiment})})
            _fill(client, uri, run_id, headline, list(files))
        except BaseException:
            _discard(client, uri, run_id)
            raise
        for old in previous:
            _retire(client, uri, old)
    return run_id, ui_path(exp_id)


def log_simulations(
    experiment: str, runs: pd.DataFrame, steps: pd.DataFrame, uri: str | None = None
) -> list[str]:
    """Log every simulation of `runs` (setup `sim/...`) as a run of the experiment's
    simulations experiment, tagged `source: model` (module docstring); the previous ones are
    deleted once all are logged, the new ones if any fails. Returns the new run ids."""
    sims = runs[runs["setup"].str.startswith("sim/")]
    if sims.empty:
        return []
    table = per_step(steps[steps["setup"].str.startswith("sim/")], timed_only=False)
    uri = check_reachable(uri or tracking_uri())
    client = _client(uri)
    created: list[str] = []
    with store_errors(uri):
        exp_id = experiment_id(
            client, uri, experiment_name(experiment, SIMULATIONS),
            f"Simulations of experiment {experiment}: model estimates through a calibration, "
            "one run per setup, variant, policy and seed",
        )
        previous = client.search_runs(
            [exp_id], filter_string=f"tags.`{KIND_TAG}` = 'simulation'", max_results=50_000)
        try:
            for _, run in sims.iterrows():
                created.append(_create_simulation(client, exp_id, experiment, run))
                _fill_simulation(client, created[-1], run, table)
        except BaseException:
            for run_id in created:
                _discard(client, uri, run_id)
            raise
        for old in previous:
            _retire(client, uri, old)
    return created


# what identifies a simulation run, as its params and tags
SIM_LABELS = ("setup", "variant", "policy", "seed", "world_size", "device", "label")


def _sim_labels(run: pd.Series) -> dict[str, str]:
    return {k: str(run[k]) for k in SIM_LABELS if k in run.index}


def _create_simulation(client: Any, exp_id: str, experiment: str, run: pd.Series) -> str:
    """A simulation's MLflow run, its labels as tags; returns its id."""
    labels = _sim_labels(run)
    tags = {**labels, KIND_TAG: "simulation", "source": "model", "experiment": experiment,
            DESCRIPTION_TAG: f"{run['policy']}, seed {run['seed']}: {run['setup']} "
                             f"({run['variant']}), {run['label']}"}
    name = f"{run['setup'].removeprefix('sim/')}/{run['variant']}/{run['policy']}/s{run['seed']}"
    return client.create_run(exp_id, run_name=name, tags=tags).info.run_id


def _fill_simulation(client: Any, run_id: str, run: pd.Series, table: pd.DataFrame) -> None:
    """A simulation run's labels as params, its summary and per-step metrics, then FINISHED."""
    from mlflow.entities import Metric

    log_params(client, run_id, {"sim": _sim_labels(run)})
    ts = int(pd.Timestamp.now().timestamp() * 1000)
    summary = [Metric(_key("summary", m), float(run[m]), ts, 0) for m in SUMMARY_METRICS
               if m in run.index and pd.notna(run[m]) and np.isfinite(run[m])]
    mine = table[(table["setup"] == run["setup"]) & (table["variant"] == run["variant"])
                 & (table["policy"] == run["policy"]) & (table["seed"] == run["seed"])]
    per = [Metric(key, float(value), ts, int(step))
           for col, key in SIM_STEP_METRICS.items()
           for step, value in zip(mine["step"], mine[col], strict=True) if np.isfinite(value)]
    warm = ~timed(mine["step"], int(run["warmup_steps"]))
    per += [Metric(WARMUP_KEY, float(w), ts, int(step))
            for step, w in zip(mine["step"], warm, strict=True)]
    for chunk in chunked(summary + per):
        client.log_batch(run_id, metrics=chunk, synchronous=True)
    client.set_terminated(run_id)


def _retire(client: Any, uri: str, old: Any) -> None:
    """A run the new analysis replaces: a FINISHED one to MLflow's trash with its files kept; a
    killed record's partial run (RUNNING), with nothing to restore, goes with its files."""
    if old.info.status == "FINISHED":
        client.delete_run(old.info.run_id)
    else:
        _discard(client, uri, old.info.run_id)


def _tags(experiment: str) -> dict[str, str]:
    return {
        KIND_TAG: "analysis",
        "git_commit": git_commit(),
        "experiment": experiment,
        DESCRIPTION_TAG: (
            f"Analysis of experiment {experiment}: the headline numbers of its first setup "
            "as metrics (per policy: samples/s, imbalance, speedup over the baseline with its "
            "interval); every table and figure as files, every test in tables/stats.csv; the "
            "simulations are runs of the experiment's simulations experiment."
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
