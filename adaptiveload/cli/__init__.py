"""Console entry point. User errors become one line on stderr and exit status 2; warnings
(an unusual plan, a skipped file) one line each, `warning: ...`."""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import typer

from adaptiveload.cli.app import app
from adaptiveload.errors import UserError
from adaptiveload.extras import missing_extra
from adaptiveload.io import write_failure

# one module per pipeline stage, in data-flow order; each registers its commands on `app`
STAGES = ("manifest", "model", "calibrate", "plan", "compare", "train", "kernel", "analyze")


def _register() -> None:
    for stage in STAGES:
        importlib.import_module(f"adaptiveload.cli.{stage}")


def _warning_line(message: Warning | str, *_: object, **__: object) -> None:
    """`warnings.showwarning` for the console: the message alone, on one line."""
    typer.echo(f"warning: {' '.join(str(message).split())}", err=True)


def main() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    # Idle OpenMP threads that spin steal the core from a concurrent job and scramble per-rank
    # timings (3 concurrent CPU runs: 167 s spinning vs 24 s passive). Set before torch loads,
    # for calibrate and train alike, so the cost model and the measurements agree.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _register()
    warnings.showwarning = _warning_line
    try:
        app()
    except UserError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except ModuleNotFoundError as exc:  # an optional package of an extra that is not installed
        error = missing_extra(exc.name or "")
        if error is None:
            raise
        typer.echo(f"error: {error}", err=True)
        sys.exit(2)
    except OSError as exc:  # a write the disk refused outside atomic_path (logs, spools)
        error = write_failure(exc.filename, exc) if exc.filename else None
        if error is None:
            raise
        typer.echo(f"error: {error}", err=True)
        sys.exit(2)
