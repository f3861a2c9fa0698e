"""Where runs are tracked, and making sure that place exists and answers before training starts.

Default store: a sqlite file under results/ (no server to run); `MLFLOW_TRACKING_URI`
overrides it (a server, Databricks, another file). A sqlite store must be created ONCE before
parallel jobs log to it: concurrent first creation races in MLflow's schema migrations, so the
pipeline runs `adaptiveload tracking init` as its own job first.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from adaptiveload.errors import UserError
from adaptiveload.extras import require

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
    return require("mlflow.tracking").MlflowClient(tracking_uri=uri)


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
        _client(uri).search_experiments(max_results=1)
    except Exception as exc:  # MLflow raises many types (connection, OperationalError, ...)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"MLflow tracking store {uri}: not reachable ({first[:200]}); start the server, fix "
            "MLFLOW_TRACKING_URI, or unset it to use the local sqlite file results/mlflow.db"
        ) from None
    return uri
