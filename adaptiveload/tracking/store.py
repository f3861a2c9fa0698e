"""Where runs are tracked, and making sure that place exists and answers before training starts.

Default store: a sqlite file under results/ (no server to run); `MLFLOW_TRACKING_URI`
overrides it (a server, Databricks, another file). Concurrent first creation of a sqlite
store races in MLflow's schema migrations (`duplicate column name`), so the first contact with
a sqlite store holds an exclusive lock on `<file>.lock` beside it: two trainings started at
once on a fresh store take turns creating it. The pipeline still runs
`adaptiveload tracking init` as its own job first.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from adaptiveload.errors import UserError
from adaptiveload.extras import require
from adaptiveload.io import atomic_path, exclusive

DEFAULT_STORE = Path("results") / "mlflow.db"

# Fail fast instead of MLflow's default of minutes of retries: a training step must never
# stall on a tracking server that went away (metrics are spooled locally instead).
_FAST_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "5",
    "MLFLOW_ENABLE_TELEMETRY": "false",
    "DO_NOT_TRACK": "1",
}


MAX_METRICS_PER_CALL = 1000  # MLflow's log_batch limit


def chunked(items: list, size: int = MAX_METRICS_PER_CALL) -> Iterable[list]:
    """Consecutive slices of at most `size` items: one log_batch call each."""
    for i in range(0, len(items), size):
        yield items[i : i + size]


MAX_PARAMS_PER_CALL = 100  # MLflow's log_batch limit for params


def _flatten(prefix: str, value: Any) -> Iterable[tuple[str, str]]:
    if isinstance(value, Mapping):
        for key, sub in value.items():
            yield from _flatten(f"{prefix}.{key}" if prefix else str(key), sub)
    else:
        yield prefix, str(value)[:6000]


def log_params(client, run_id: str, params: Mapping[str, Any]) -> None:
    """Nested params as dotted keys (`run.policy`, `experiment.train.steps`), in batches."""
    from mlflow.entities import Param

    flat = [Param(k, v) for k, v in _flatten("", params)]
    for chunk in chunked(flat, MAX_PARAMS_PER_CALL):
        client.log_batch(run_id, params=chunk, synchronous=True)


# MLflow's sqlite store logs every database error it meets, with its traceback, and then
# raises it (`mlflow.store.db.utils.make_managed_session`): the raise reaches the user as one
# line (`store_errors`, or the spool's one warning), so the log only repeats it, ~30 lines a time.
_RAISED_AND_LOGGED = "mlflow.store.db.utils"


def _drop_logged_raise(record: logging.LogRecord) -> bool:
    """Keep a record of that logger unless it is the log of an error that is raised anyway."""
    return not (record.levelno >= logging.ERROR and record.exc_info)


def configure_environment() -> None:
    """Telemetry off and short HTTP timeouts, unless the user set them explicitly; MLflow's
    logs of store errors it raises anyway silenced (the user gets the raise, in one line)."""
    for key, value in _FAST_HTTP.items():
        os.environ.setdefault(key, value)
    logger = logging.getLogger(_RAISED_AND_LOGGED)
    if _drop_logged_raise not in logger.filters:
        logger.addFilter(_drop_logged_raise)


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else the sqlite file results/mlflow.db (absolute)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{DEFAULT_STORE.resolve()}"


def _client(uri: str):
    configure_environment()
    return require("mlflow.tracking").MlflowClient(tracking_uri=uri)


# MLflow 3's UI files experiments by this tag; without it, it may infer GenAI views for them
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
DESCRIPTION_TAG = "mlflow.note.content"  # the description the UI shows for experiments and runs
# beside a sqlite file: the folder `mlflow server --artifacts-destination` serves
ARTIFACTS_DIR = "mlartifacts"


def store_folder(uri: str) -> Path | None:
    """The folder of a sqlite store's file (results/); None for servers."""
    return Path(uri.removeprefix("sqlite:///")).parent if uri.startswith("sqlite:///") else None


def artifacts_root(uri: str) -> Path | None:
    """The folder a sqlite store's artifacts live in (beside the db file); None for servers."""
    folder = store_folder(uri)
    return None if folder is None else folder / ARTIFACTS_DIR


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment keeps artifacts.

    With a sqlite store: the portable `mlflow-artifacts:/<experiment>`, resolved by whichever
    `mlflow server --artifacts-destination <db folder>/mlartifacts` serves the store, so the
    results folder can move or be shared (an absolute file: URI would pin it to this path).
    With a server: None, the server decides.
    """
    return f"mlflow-artifacts:/{experiment}" if artifacts_root(uri) is not None else None


def run_artifact_dir(uri: str, artifact_uri: str) -> Path | None:
    """The local folder of a run's `mlflow-artifacts:` files in a sqlite store, else None."""
    root = artifacts_root(uri)
    if root is None or not artifact_uri.startswith("mlflow-artifacts:"):
        return None
    return root / urlparse(artifact_uri).path.lstrip("/")


def log_artifact(client, uri: str, run_id: str, path: Path, artifact_path: str | None = None):
    """Attach a file to a run: written into the store's artifact folder for sqlite stores (the
    client cannot upload `mlflow-artifacts:` without a server), uploaded otherwise."""
    local = run_artifact_dir(uri, client.get_run(run_id).info.artifact_uri)
    if local is None:
        client.log_artifact(run_id, str(path), artifact_path)
        return
    folder = local / artifact_path if artifact_path else local
    with atomic_path(folder / Path(path).name) as tmp:  # a failed copy leaves no partial file
        shutil.copyfile(path, tmp)


def artifact_paths(client, uri: str, run_id: str) -> list[str]:
    """Every file of a run, as paths relative to its artifact root ('figures/x.png'), sorted.
    Reads a sqlite store's folder directly (no server needed), else asks the server."""
    local = run_artifact_dir(uri, client.get_run(run_id).info.artifact_uri)
    if local is not None:
        return sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    found, folders = [], [None]
    while folders:
        for info in client.list_artifacts(run_id, folders.pop()):
            (folders if info.is_dir else found).append(info.path)
    return sorted(found)


def experiment_id(client, uri: str, name: str, description: str | None = None) -> str:
    """The id of experiment `name`, created if missing, with its kind set and its description:
    `description` when given, else a generic one if it has none (a stage that does not read
    the experiment's description leaves the one another stage set)."""
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            exp_id = client.create_experiment(name, artifact_location=artifact_location(uri, name))
        except Exception:  # a parallel job created it first
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
        else:
            exp = client.get_experiment(exp_id)
    client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
    if description or DESCRIPTION_TAG not in exp.tags:
        text = description or f"AdaptiveLoad experiment {name}"
        client.set_experiment_tag(exp.experiment_id, DESCRIPTION_TAG, text)
    return exp.experiment_id


def init_store(uri: str | None = None) -> str:
    """Create the store (sqlite schema, default experiment) if missing; return its URI."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    check_reachable(uri)
    return uri


def require_existing(uri: str) -> None:
    """UserError unless a sqlite store's file exists: reading one that vanished (deleted,
    another working directory, a moved results folder) would create an empty store and
    report every run missing from it, or worse, nothing at all."""
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise UserError(f"{uri}: no tracking store there (the runs were logged to another "
                        "one, or it was deleted or moved); point MLFLOW_TRACKING_URI at the "
                        "store the runs were logged to, or run the pipeline again to log them")


def check_reachable(uri: str | None = None) -> str:
    """Raise UserError if the store cannot be reached; called before any training starts."""
    uri = uri or tracking_uri()
    with store_errors(uri), _creation_lock(uri):
        _client(uri).search_experiments(max_results=1)
    return uri


@contextlib.contextmanager
def store_errors(uri: str) -> Iterator[None]:
    """Turn what a tracking store raises (MLflow, sqlite, HTTP and OS errors of many types)
    into a UserError of one line: the store, what it said, the fix (`store_failure`)."""
    try:
        yield
    except UserError:
        raise
    except Exception as exc:
        raise UserError(store_failure(uri, exc)) from None


def store_failure(uri: str, exc: BaseException) -> str:
    """The one-line message for a store that refused an operation: unreachable, read-only,
    not a store at all (a damaged or foreign file), or on a full disk, and what to do."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    first = text.split(" [SQL:")[0][:200]
    where = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else uri
    said, code = first.lower(), getattr(exc, "errno", None)
    if code in (errno.EROFS, errno.EACCES) or any(
        w in said for w in ("readonly", "read-only", "permission denied")
    ):
        fix = (f"the store is read-only: make {where} and its folder writable, or set "
               "MLFLOW_TRACKING_URI to a writable store")
    elif "not a database" in said or "malformed" in said:
        fix = (f"{where} is not an MLflow store (damaged, or another file): move it aside "
               "and run `adaptiveload tracking init`, or set MLFLOW_TRACKING_URI")
    elif code in (errno.ENOSPC, errno.EDQUOT) or "disk is full" in said or "no space" in said:
        fix = f"the disk that holds {where} is full: free space there and run it again"
    else:
        return (f"MLflow tracking store {uri}: not reachable ({first}); start the server, fix "
                "MLFLOW_TRACKING_URI, or unset it to use the local sqlite file "
                "results/mlflow.db")
    return f"MLflow tracking store {uri}: {first}; {fix}"


@contextlib.contextmanager
def _creation_lock(uri: str) -> Iterator[None]:
    """Exclusive lock on `<db>.lock` for a sqlite URI whose folder exists (POSIX); else none."""
    db = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    if db is None or not db.parent.is_dir():
        yield
        return
    with exclusive(f"{db}.lock", wait=True):
        yield
