"""`adaptiveload train | sync | tracking init`: measured training runs and their tracking."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from adaptiveload.cli.app import app, examples, group
from adaptiveload.errors import UserError
from adaptiveload.pipeline import Layout
from adaptiveload.planning.policies import POLICIES
from adaptiveload.step_table import WHOLE_EPOCH

tracking_app = group("tracking", "The MLflow tracking store.")

# set to 1 by the Snakemake rule, which `exec`s the trainer: a killed `snakemake` then takes
# its training jobs with it instead of leaving them running (Linux; see docs/robustness.md)
DIE_WITH_PARENT = "ADAPTIVELOAD_DIE_WITH_PARENT"


def _steps(text: str | None) -> int | str | None:
    if text is None or text == WHOLE_EPOCH:
        return text
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--steps {text!r}: expected a step count or '{WHOLE_EPOCH}'") from None


def _start_process() -> None:
    """What a training process sets up before it imports torch: signals that end its run
    FAILED (not RUNNING), dying with a Snakemake parent, the tracking environment."""
    from adaptiveload.lifecycle import die_with_parent, stop_on_signals
    from adaptiveload.tracking.store import configure_environment

    stop_on_signals()  # a stopped run ends FAILED in MLflow, not RUNNING
    if os.environ.get(DIE_WITH_PARENT) == "1":
        die_with_parent()
    configure_environment()


@app.command("train", epilog=examples(
    "adaptiveload train --config experiments/default.yaml --policy adaptiveload --seed 0",
    "torchrun --nproc-per-node 8 -m adaptiveload train --config results/paper/config.yaml "
    "--policy adaptiveload --seed 0 --kernel fused",
))
def train(
    config: Annotated[Path, typer.Option("--config", help="experiment YAML")],
    policy: Annotated[str, typer.Option("--policy", help=" | ".join(POLICIES))],
    seed: Annotated[int, typer.Option("--seed")],
    steps: Annotated[
        str | None,
        typer.Option("--steps", help=f"override train.steps: a count or '{WHOLE_EPOCH}'"),
    ] = None,
    emulate_world_size: Annotated[
        int | None,
        typer.Option("--emulate-world-size", help="run N ranks in turn on one device"),
    ] = None,
    kernel: Annotated[str | None, typer.Option("--kernel", help="eager | fused")] = None,
    calibration: Annotated[Path | None, typer.Option(help="calibration JSON")] = None,
    manifest: Annotated[Path | None, typer.Option(help="manifest instead of the mixture")] = None,
    plan: Annotated[
        Path | None,
        typer.Option("--plan", help="plan summary JSON (adaptiveload plan) to match"),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(
            "--out", help="run directory",
            show_default=Layout("<experiment>").run_dir("<policy>", "<seed>", "<kernel>"),
        )
    ] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu | cuda")] = None,
    no_track: Annotated[bool, typer.Option("--no-track", help="no MLflow run")] = False,
    no_checkpoint: Annotated[
        bool,
        typer.Option("--no-checkpoint", help="write no checkpoints (no resume); short runs"),
    ] = False,
) -> None:
    """Train Wan 2.1 on a policy's plan, measuring every rank's step; resumes if interrupted.

    Under `torchrun --nproc-per-node N -m adaptiveload train ...` each process is one rank
    (DDP; gloo on CPU, NCCL on CUDA); otherwise one process emulates the ranks in turn.
    """
    _start_process()
    from adaptiveload.tracking.run import RunTracker
    from adaptiveload.training.session import Request
    from adaptiveload.training.session import train as run

    summary = run(
        Request(
            config=config, policy=policy, seed=seed, steps=_steps(steps),
            emulate_world_size=emulate_world_size, kernel=kernel, calibration=calibration,
            manifest=manifest, plan=plan, out=out, device=device, checkpoint=not no_checkpoint,
        ),
        open_sink=None if no_track else RunTracker.open,
    )
    if summary:
        keys = ("policy", "seed", "launch_mode", "imbalance_rate", "samples_per_s", "tokens_per_s")
        typer.echo(json.dumps({k: summary[k] for k in keys}))


@app.command("sync", epilog=examples(
    "adaptiveload sync results/default/runs/adaptiveload/seed0/eager/tracking.spool.jsonl",
))
def sync(
    spool: Annotated[Path, typer.Argument(help="a run's tracking.spool.jsonl")],
    tracking_uri: Annotated[
        str | None, typer.Option("--tracking-uri", help="upload here instead")
    ] = None,
) -> None:
    """Upload metrics a run spooled while its tracking store was unreachable (idempotent)."""
    from adaptiveload.tracking.run import sync as upload
    from adaptiveload.tracking.store import configure_environment

    configure_environment()
    n = upload(spool, tracking_uri)
    if n:
        typer.echo(f"{spool}: {n} record(s) uploaded", err=True)
    else:
        typer.echo(f"{spool}: nothing to sync (every record is in the store)", err=True)


@tracking_app.command("init", epilog=examples(
    "adaptiveload tracking init", "adaptiveload tracking init --uri http://127.0.0.1:5000",
))
def init(
    uri: Annotated[
        str | None,
        typer.Option(
            "--uri", help="tracking store",
            show_default="$MLFLOW_TRACKING_URI, else sqlite:///results/mlflow.db",
        ),
    ] = None,
) -> None:
    """Create the tracking store once, before parallel jobs log to it."""
    from adaptiveload.tracking.store import init_store

    typer.echo(f"tracking store ready: {init_store(uri)}", err=True)


@tracking_app.command("check", epilog=examples(
    "adaptiveload tracking check --experiment default results/default/runs/*/seed*/* "
    "-o results/default/tracking/check.json",
))
def check(
    run_dirs: Annotated[list[Path], typer.Argument(help="training run folders")],
    experiment: Annotated[str, typer.Option("--experiment", help="their MLflow experiment")],
    out: Annotated[Path, typer.Option("--out", "-o", help="JSON report of the check")],
) -> None:
    """The end of training: upload every run folder's spooled records, then require that each
    folder's MLflow run is FINISHED (the pipeline's check before its analysis)."""
    from adaptiveload.io import write_json
    from adaptiveload.tracking.run import check_runs
    from adaptiveload.tracking.store import configure_environment, tracking_uri

    configure_environment()
    report = check_runs(experiment, run_dirs)
    write_json(out, {"tracking_uri": tracking_uri(), "runs": report})
    uploaded = sum(r["uploaded"] for r in report)
    typer.echo(f"{len(report)} run(s) FINISHED in the store; {uploaded} spooled record(s) "
               "uploaded", err=True)
