"""One MLflow run of one training run, robust to the store going away mid-run.

Records go to the store through `MlflowClient.log_batch` (one call per step, <= 1000 metrics
each). When a call fails the tracker switches to spooling: records are appended to a local JSONL
file (see `spool.py`) with one warning, and every later record retries the upload of the whole
backlog, in order, at most every `retry_s` seconds. `adaptiveload sync SPOOL` uploads what is
left after the run. No step is ever logged twice: before uploading after a failure, or when a
run is resumed, the tracker asks the store for the last step it holds and skips up to it.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from adaptiveload.errors import UserError, notice
from adaptiveload.pipeline import RUN_SPOOL
from adaptiveload.tracking.spool import Spool
from adaptiveload.tracking.store import (
    DESCRIPTION_TAG,
    MAX_METRICS_PER_CALL,
    _client,
    check_reachable,
    chunked,
    experiment_id,
    log_artifact,
    log_params,
    require_existing,
    store_errors,
    store_failure,
    store_folder,
    tracking_uri,
)

log = logging.getLogger(__name__)

RUN_DIR_TAG = "adaptiveload.run_dir"  # the output folder a run writes (`folder_key`)
SUPERSEDED_TAG = "adaptiveload.superseded_by"  # the run that redid this one's work
STEP_KEY = "loss"  # logged at every step: its history says which steps the store holds


class RunTracker:
    """Logs one run's steps, summary, artifacts and status; spools them while the store is down."""

    def __init__(self, uri: str, run_id: str, spool_path: Path, retry_s: float = 5.0):
        from mlflow.entities import Metric

        self._metric_cls = Metric
        self.uri = uri
        self.run_id = run_id
        self.client = _client(uri)
        self.retry_s = retry_s
        self._last_failure: float | None = None
        self.last_error: Exception | None = None  # why the store last refused a record
        self._system = None
        path = Path(spool_path)
        self.spool = Spool.load(path) if path.exists() else Spool(path, run_id, uri)
        self.logged_through = self._store_last_step()

    # -- creation ---------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        uri: str,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
        spool_path: Path,
        resume: Mapping[str, Any] | None = None,
        run_dir: Path | None = None,
        supersede: str | None = None,
        description: str | None = None,
        run_description: str | None = None,
    ) -> RunTracker:
        """Create the run, or reopen the one a checkpoint fed (`resume`: its `run_id` and the
        checkpoint's `step`, the steps it holds); the store must be reachable.

        A new run tagged with `run_dir` supersedes the earlier runs of that folder (and the
        run `supersede`, the one a stale checkpoint fed): they get the tag SUPERSEDED_TAG,
        and those still RUNNING (killed before they could say so) are ended as KILLED.
        Resuming continues in a new run instead when the old one cannot take the resumed
        steps: this store does not hold it (the command rerun with another
        MLFLOW_TRACKING_URI), or it holds steps from the checkpoint's `step` on (logged by
        the stopped process after its last checkpoint, and measured again now). Either is
        said in one line; the trainer re-logs the checkpoint's steps, so the new run has
        every step once, as the per-step table has
        it. `description`: the experiment's, shown by the MLflow UI (set when given, or when
        the experiment has none); `run_description`: the run's (set when it is created).
        """
        run_id, resume_step = (resume["run_id"], resume["step"]) if resume else (None, None)
        stale = Spool.load(spool_path).run_id if Path(spool_path).exists() else None
        if stale is not None and stale != run_id:
            raise UserError(
                f"{spool_path}: holds metrics of an earlier MLflow run ({stale}) that "
                f"never reached the store; upload them with `adaptiveload sync {spool_path}` first"
            )
        client = _client(uri)
        if run_id is not None and not _holds(client, run_id):
            notice(
                f"MLflow run {run_id} of the checkpoint is not in the store {uri}: "
                "logging to a new run there (the checkpoint's steps are logged again)"
            )
            run_id = None
        elif run_id is not None and resume_step is not None and _holds_past(
            client, run_id, spool_path, resume_step
        ):
            notice(
                f"MLflow run {run_id} holds steps from {resume_step} on, logged after the "
                f"checkpoint of step {resume_step} by the process that stopped: continuing in "
                "a new run with the checkpoint's steps and this run's, which supersedes it"
            )
            supersede, run_id = run_id, None
            Path(spool_path).unlink(missing_ok=True)  # the stopped process's: superseded too
        exp_id = experiment_id(client, uri, experiment, description)
        if run_id is None:
            if run_description is not None:
                tags = {**tags, DESCRIPTION_TAG: run_description}
            if run_dir is not None:
                tags = {**tags, RUN_DIR_TAG: folder_key(run_dir, uri)}
            run_id = client.create_run(exp_id, run_name=run_name, tags=dict(tags)).info.run_id
            log_params(client, run_id, params)
            if run_dir is not None:
                _supersede(client, uri, exp_id, run_name, Path(run_dir), run_id, supersede)
        else:
            client.update_run(run_id, status="RUNNING")
        return cls(uri, run_id, spool_path)

    @classmethod
    def open(cls, **start: Any) -> RunTracker:
        """`start` (its arguments but `uri`) on the configured store, with the system metrics
        monitor running: what a training run reports to. An unreachable store is a UserError
        here, before any training."""
        uri = check_reachable()
        with store_errors(uri):  # a read-only or full store: one line, before any training
            tracker = cls.start(uri, **start)
        tracker.start_system_metrics()
        return tracker

    def start_system_metrics(self, sampling_interval: float = 5.0) -> None:
        """MLflow's CPU/GPU/memory monitor (needs psutil; pynvml for GPUs), resumed in place."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._system = SystemMetricsMonitor(
            self.run_id,
            sampling_interval=sampling_interval,
            resume_logging=True,
            tracking_uri=self.uri,
        )
        self._system.start()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps to continue this run after a restart."""
        return {"run_id": self.run_id, "uri": self.uri, "logged_through": self.logged_through}

    # -- what the store already holds --------------------------------------------------------
    def _store_last_step(self) -> int:
        """Highest step of `STEP_KEY` in the store (-1 if none); raises if unreachable."""
        history = self.client.get_metric_history(self.run_id, STEP_KEY)
        return max((m.step for m in history), default=-1)

    # -- records -------------------------------------------------------------------------------
    def log_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """Per-step metrics under stable keys; must include STEP_KEY."""
        if step <= self.logged_through and not self.spool.records:
            return  # resumed run recomputing a step the store already holds
        self._record({"kind": "step", "step": step, "ts": _now_ms(), "metrics": dict(metrics)})

    def log_summary(self, metrics: Mapping[str, float]) -> None:
        self._record({"kind": "summary", "ts": _now_ms(), "metrics": dict(metrics)})

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        record = {"kind": "artifact", "path": str(Path(path).resolve())}
        self._record(record | {"artifact_path": artifact_path})

    def finish(self, status: str = "FINISHED") -> bool:
        """Stop system metrics, try a last upload. True if nothing is left in the spool."""
        if self._system is not None:
            self._system.finish()
            self._system = None
        self._record({"kind": "status", "status": status}, force=True)
        if self.spool.records:
            warnings.warn(
                f"MLflow store {self.uri} unreachable at the end of the run: "
                f"{len(self.spool.records)} record(s) kept in {self.spool.path}; upload them "
                f"with `adaptiveload sync {self.spool.path}`",
                stacklevel=2,
            )
        return not self.spool.records

    def _record(self, record: dict[str, Any], force: bool = False) -> None:
        if self.spool.records:
            self.spool.append(record)
            self.flush(force=force)
            return
        try:
            self._upload(record)
        except Exception as exc:
            self._went_offline(exc)
            self.spool.append(record)

    # -- upload ----------------------------------------------------------------------------------
    def flush(self, force: bool = False) -> bool:
        """Upload the spooled backlog in order; True when the spool is empty afterwards."""
        if not self.spool.records:
            return True
        recent = self._last_failure and time.monotonic() - self._last_failure < self.retry_s
        if recent and not force:
            return False
        try:
            # a failed call may still have landed server-side: ask before re-sending
            self.logged_through = self._store_last_step()
            while self.spool.records:
                self._upload(self.spool.records[0])
                self.spool.records.pop(0)
        except Exception as exc:
            self._went_offline(exc)
            self.spool.rewrite()
            return False
        self.spool.clear()
        log.warning("MLflow store %s reachable again: spooled records uploaded", self.uri)
        self._last_failure = None
        return True

    def _went_offline(self, exc: Exception) -> None:
        self.last_error = exc
        if self._last_failure is None:
            warnings.warn(
                f"MLflow store {self.uri} unreachable ({type(exc).__name__}); training goes on, "
                f"metrics are spooled to {self.spool.path} and uploaded when it is back",
                stacklevel=3,
            )
        self._last_failure = time.monotonic()

    def _upload(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "step":
            if record["step"] <= self.logged_through:
                return
            self._log_metrics(record["metrics"], record["step"], record["ts"])
            self.logged_through = record["step"]
        elif kind == "summary":
            held = self.client.get_run(self.run_id).data.metrics
            if not all(k in held for k in record["metrics"]):
                self._log_metrics(record["metrics"], 0, record["ts"])
        elif kind == "artifact":
            log_artifact(self.client, self.uri, self.run_id, Path(record["path"]),
                         record.get("artifact_path"))
        elif kind == "status":
            self.client.set_terminated(self.run_id, status=record["status"])
        else:
            raise ValueError(f"unknown spool record kind {kind!r}")

    def _log_metrics(self, metrics: Mapping[str, float], step: int, ts: int) -> None:
        batch = [
            self._metric_cls(key, float(value), ts, step)
            for key, value in metrics.items()
            if value is not None
        ]
        for chunk in chunked(batch, MAX_METRICS_PER_CALL):
            self.client.log_batch(self.run_id, metrics=chunk, synchronous=True)


def _holds(client: Any, run_id: str) -> bool:
    """Whether the store holds `run_id` (and has not deleted it)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return False
        raise


def _holds_past(client: Any, run_id: str, spool_path: Path, step: int) -> bool:
    """Whether run `run_id` holds, in the store or in its spool, a step numbered `step` or
    later: one a resumed run from a checkpoint of `step` steps measures again."""
    pending = Spool.load(spool_path).records if Path(spool_path).exists() else []
    spooled = max((r["step"] for r in pending if r.get("kind") == "step"), default=-1)
    history = client.get_metric_history(run_id, STEP_KEY)
    return max(spooled, max((m.step for m in history), default=-1)) >= step


def folder_key(run_dir: Path, uri: str) -> str:
    """How the runs of folder `run_dir` name it (their RUN_DIR_TAG): its path relative to the
    folder of a sqlite store it lies under (`tiny/runs/adaptiveload/seed0/eager` for a store
    results/mlflow.db), so results/ can be moved or copied with its store and its runs are
    still found; else (a server, a folder elsewhere) its absolute path."""
    folder, store = Path(run_dir).resolve(), store_folder(uri)
    if store is not None and folder.is_relative_to(store.resolve()):
        return folder.relative_to(store.resolve()).as_posix()
    return str(folder)


def _folder_keys(run_dir: Path, uri: str) -> list[str]:
    """The tags the runs of `run_dir` may carry: `folder_key`, and the absolute path that
    runs logged before folders were named relative to their store carry."""
    return list(dict.fromkeys([folder_key(run_dir, uri), str(Path(run_dir).resolve())]))


def _supersede(
    client: Any, uri: str, exp_id: str, run_name: str, run_dir: Path, new_id: str,
    stale: str | None,
) -> None:
    """Tag the earlier runs of `run_dir` (and `stale`) superseded by `new_id`; end RUNNING ones."""
    earlier = client.search_runs([exp_id], filter_string=f"attributes.run_name = '{run_name}'")
    keys = _folder_keys(run_dir, uri)
    ids = {r.info.run_id for r in earlier if r.data.tags.get(RUN_DIR_TAG) in keys}
    if stale is not None and _holds(client, stale):
        ids.add(stale)
    for run_id in sorted(ids - {new_id}):
        run = client.get_run(run_id)
        if SUPERSEDED_TAG in run.data.tags:
            continue
        client.set_tag(run_id, SUPERSEDED_TAG, new_id)
        if run.info.status == "RUNNING":
            client.set_terminated(run_id, status="KILLED")


def _now_ms() -> int:
    return int(time.time() * 1000)


def sync(spool_path: str | Path, uri: str | None = None) -> int:
    """Upload a run's spool (`adaptiveload sync`); returns the number of records uploaded.

    Idempotent: a spool that is gone (a run or an earlier sync uploaded everything and
    removed it) or holds no records uploads nothing and returns 0.
    """
    if not Path(spool_path).exists():
        return 0
    spool = Spool.load(spool_path)
    if not spool.records:
        return 0
    pending = len(spool.records)
    uri = uri or spool.uri
    try:
        check_reachable(uri)
        with store_errors(uri):
            tracker = RunTracker(uri, spool.run_id, Path(spool_path))
    except UserError as exc:
        raise UserError(f"{spool_path}: kept, not uploaded: {exc}") from None
    if not tracker.flush(force=True):
        reason = store_failure(uri, tracker.last_error or RuntimeError("upload failed"))
        raise UserError(f"{spool_path}: kept, not uploaded: {reason}")
    return pending


def check_runs(experiment: str, run_dirs: list[Path], uri: str | None = None) -> list[dict]:
    """The end of a pipeline's training: upload what each run folder spooled (`sync`), then
    require that the store holds a FINISHED run of each folder (the newest one not
    superseded). One entry per folder (its MLflow run and the records uploaded); a spool the
    store refuses, or a run that is missing or not FINISHED, is a UserError naming the
    folder and the fix, so a pipeline never ends with runs RUNNING or records only on disk."""
    uri = uri or tracking_uri()
    require_existing(uri)
    report = []
    for run_dir in map(Path, run_dirs):
        spool = run_dir / RUN_SPOOL
        try:
            uploaded = sync(spool, uri)
        except UserError as exc:
            raise UserError(f"{exc}; then run the pipeline again (or `adaptiveload sync "
                            f"{spool}`)") from None
        client = _client(check_reachable(uri))
        with store_errors(uri):
            run = _current_run(client, uri, experiment, run_dir)
        if run is None:
            raise UserError(
                f"{run_dir}: no MLflow run of this folder in {uri} (trained with --no-track, "
                "with another MLFLOW_TRACKING_URI, or moved without the store it was logged "
                "to); point MLFLOW_TRACKING_URI at that store, or delete its summary.json and "
                "run the pipeline again to train it into this one"
            )
        if run.info.status != "FINISHED":
            raise UserError(
                f"{run_dir}: its MLflow run {run.info.run_id} is {run.info.status} though the "
                "run wrote its results; delete its summary.json and run the pipeline again "
                "(the run resumes from its last checkpoint)"
            )
        report.append({"run_dir": str(run_dir), "run_id": run.info.run_id, "uploaded": uploaded})
    return report


def _current_run(client: Any, uri: str, experiment: str, run_dir: Path) -> Any:
    """The newest run of `run_dir` that no later run superseded, or None."""
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = []
    for key in _folder_keys(run_dir, uri):
        key = key.replace("'", "\\'")
        runs += client.search_runs([exp.experiment_id], f"tags.`{RUN_DIR_TAG}` = '{key}'")
    live = [r for r in runs if SUPERSEDED_TAG not in r.data.tags]
    return max(live, key=lambda r: r.info.start_time, default=None)
