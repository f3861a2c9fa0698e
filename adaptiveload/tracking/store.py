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
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from adaptiveload.errors import UserError

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


def configure_environment() -> None:
    """Telemetry off and short HTTP timeouts, unless the user set them explicitly."""
    for key, value in _FAST_HTTP.items():
        os.environ.setdefault(key, value)


def tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else the sqlite file results/mlflow.db (absolute)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{DEFAULT_STORE.resolve()}"


def _client(uri: str):
    configure_environment()
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def artifact_location(uri: str) -> str | None:
    """Where a new experiment keeps artifacts: beside a sqlite db file, not in the working
    directory; None lets a server decide (proxied artifacts)."""
    if uri.startswith("sqlite:///"):
        return (Path(uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None


def init_store(uri: str | None = None) -> str:
    """Create the store (sqlite schema, default experiment) if missing; return its URI."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        Path(uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    check_reachable(uri)
    return uri


def check_reachable(uri: str | None = None) -> str:
    """Raise UserError if the store cannot be reached; called before any training starts."""
    uri = uri or tracking_uri()
    try:
        with _creation_lock(uri):
            _client(uri).search_experiments(max_results=1)
    except Exception as exc:  # MLflow raises many types (connection, OperationalError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"MLflow tracking store {uri}: not reachable ({first[:200]}); start the server, fix "
            "MLFLOW_TRACKING_URI, or unset it to use the local sqlite file results/mlflow.db"
        ) from None
    return uri


@contextlib.contextmanager
def _creation_lock(uri: str) -> Iterator[None]:
    """Exclusive lock on `<db>.lock` for a sqlite URI whose folder exists (POSIX); else none."""
    db = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
    try:
        import fcntl
    except ImportError:  # Windows: no flock; create the store with `tracking init` first
        fcntl = None
    if db is None or fcntl is None or not db.parent.is_dir():
        yield
        return
    with open(f"{db}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
