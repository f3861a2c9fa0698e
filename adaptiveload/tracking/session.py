"""A tracked training run end to end: experiment file -> plan -> training -> table, summary,
MLflow. What `adaptiveload train` calls; usable from Python the same way.

Outputs under `out` (all written atomically):
    steps.parquet        the per-step table (one row per (step, rank), shared schema)
    summary.json         the run summary (metrics over steps >= warmup_steps)
    plan_summary.json    the plan's summary (epoch 0)
    checkpoints/         ckpt-<step>.pt, the newest two
    tracking.spool.jsonl metrics waiting for an unreachable store (only while some are)
Starting the same command again resumes from the newest checkpoint, in the same MLflow run,
if the run's identity (config, budgets, calibration, data, plan, code) is unchanged; otherwise
it starts over in a new MLflow run and tags the old one superseded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaptiveload import config as experiment_config
from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError
from adaptiveload.io import write_json, write_parquet
from adaptiveload.provenance import device_name, git_commit
from adaptiveload.tracking.run import RunTracker
from adaptiveload.tracking.store import DESCRIPTION_TAG, check_reachable, tracking_uri
from adaptiveload.training import checkpoint
from adaptiveload.training.config import MAX_WORLD_SIZE, TrainConfig, from_experiment
from adaptiveload.training.distributed import timer_of, under_torchrun
from adaptiveload.training.inputs import prepare_data, run_identity
from adaptiveload.training.loop import Trainer
from adaptiveload.training.summary import run_summary


@dataclass
class Request:
    """What the user asked for on the command line."""

    config: Path
    policy: str
    seed: int
    steps: int | str | None = None  # a count or config.WHOLE_EPOCH
    emulate_world_size: int | None = None
    kernel: str | None = None
    calibration: Path | None = None
    manifest: Path | None = None
    out: Path | None = None
    device: str | None = None
    track: bool = True
    progress: bool = True
    checkpoint: bool = True  # False: no checkpoints, so no resume (short measurement runs)


def resolve(req: Request) -> tuple[dict[str, Any], TrainConfig, Calibration | None, Path]:
    """Validate everything (files, fields, flags) before any output is written."""
    exp = experiment_config.load(req.config)
    if req.emulate_world_size is not None and under_torchrun():
        raise UserError("--emulate-world-size: not with torchrun (one process per rank there)")
    if under_torchrun():
        mode, world = "distributed", int(os.environ["WORLD_SIZE"])
    elif req.emulate_world_size is not None:
        mode, world = "emulated", req.emulate_world_size
        if not 1 <= world <= MAX_WORLD_SIZE:
            raise UserError(f"--emulate-world-size {world}: must be between 1 and {MAX_WORLD_SIZE}")
    else:
        mode, world = "emulated", exp["train"]["world_size"]
    cfg = from_experiment(
        exp, req.policy, req.seed, launch_mode=mode, world_size=world, steps=req.steps,
        kernel=req.kernel, device=req.device,
    )  # fmt: skip
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device visible; use --device cpu")
    cal_path = req.calibration or exp["calibration"]["file"]
    calibration = Calibration.load(cal_path) if cal_path else None
    if calibration is not None:
        calibration.require_model(cfg.model, cal_path)
    # the pipeline's layout (workflow/rules/common.smk), so a hand-run lands beside its runs
    default_out = (Path("results") / cfg.experiment / "runs" / cfg.policy / f"seed{cfg.seed}"
                   / cfg.kernel)  # fmt: skip
    out = req.out or default_out
    return exp, cfg, calibration, Path(out)


# Summary fields whose MLflow key says which formula they are (adaptiveload.metrics): both are
# means over the timed steps of a per-step ratio; only the first is the mean of the per-step
# metric `imbalance_rate`. Every other field is logged as summary/<field>.
SUMMARY_KEYS = {
    "imbalance_rate": "summary/imbalance_rate_mean_of_steps",  # (max - min) / max per step
    "imbalance_rate_mean": "summary/imbalance_vs_mean_rate_mean_of_steps",  # (max - mean) / max
}


def _numeric(summary: dict[str, Any]) -> dict[str, float]:
    return {
        SUMMARY_KEYS.get(k, f"summary/{k}"): float(v)
        for k, v in summary.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("seed",)
    }


def train(req: Request) -> dict[str, Any]:
    """Run (or resume) one training run; returns its summary (on the main process)."""
    exp, cfg, calibration, out = resolve(req)
    data = prepare_data(exp, cfg, calibration, req.manifest)
    ckpt_dir = out / "checkpoints" if req.checkpoint else None
    main = int(os.environ.get("RANK", 0)) == 0
    identity = run_identity(cfg, data)
    found = (
        checkpoint.find(ckpt_dir, identity["identity"], tidy=main)
        if ckpt_dir
        else checkpoint.Found()
    )
    resume = found.state
    tracker = None
    if req.track and main:
        uri = check_reachable(tracking_uri())  # clear error before any training
        tracker = RunTracker.start(
            uri,
            experiment=cfg.experiment,
            run_name=cfg.run_name,
            params={
                "experiment": exp,
                "run": cfg.to_dict(),
                "calibration": calibration.label if calibration else "none",
                "identity": identity,
            },
            tags={
                "git_commit": git_commit(),
                "device": device_name(cfg.device),
                "torch": torch.__version__,
                "cuda": str(torch.version.cuda),
                "experiment": cfg.experiment,
                "policy": cfg.policy,
                "seed": str(cfg.seed),
                "kernel": cfg.kernel,
                "launch_mode": cfg.launch_mode,
                "world_size": str(cfg.world_size),
                "source": "measured",
                DESCRIPTION_TAG: (
                    f"{cfg.policy}, seed {cfg.seed}, kernel {cfg.kernel}: {cfg.model} trained "
                    f"on {cfg.world_size} {cfg.launch_mode} ranks ({device_name(cfg.device)}); "
                    "per-step and summary metrics measured"
                ),
                "timer": timer_of(cfg.launch_mode, cfg.device),
                "timed_window": cfg.timed_window,
            },
            spool_path=out / "tracking.spool.jsonl",
            run_id=(resume or {}).get("tracking", {}).get("run_id"),
            run_dir=out,
            supersede=(found.stale or {}).get("tracking", {}).get("run_id"),
            description=exp.get("description"),
        )
        tracker.start_system_metrics()
    trainer = None
    try:
        trainer = Trainer(
            cfg, data, ckpt_dir, sink=tracker, resume=resume, progress=req.progress,
            identity=identity["identity"],
        )  # fmt: skip
        result = trainer.run()
    except BaseException:
        if tracker is not None:
            tracker.finish(status="FAILED")
        raise
    finally:
        if trainer is not None:
            trainer.close()
    if not main:
        return {}
    summary = run_summary(cfg, result.steps, data.builder, calibration, trainer.capacity)
    plan_summary = data.builder(0).summary
    write_parquet(out / "steps.parquet", result.steps)
    write_json(out / "plan_summary.json", plan_summary)
    write_json(out / "summary.json", summary)
    if tracker is not None:
        tracker.log_summary(_numeric(summary))
        for name in ("steps.parquet", "plan_summary.json", "summary.json"):
            tracker.log_artifact(out / name)
        tracker.finish()
    return summary
