"""A tracked training run end to end: experiment file -> plan -> training -> table, summary,
MLflow. What `adaptiveload train` calls; usable from Python the same way.

Training owns the run; tracking is a sink (`RunSink`) the caller passes in: it gets plain
numbers and paths, and neither package imports the other.
The ranks are resolved once here (`distributed.resolve_ranks`) and passed down. With
`Request.plan` (the pipeline's plan summary) the run checks that the epoch-0 plan it executes
is that plan (`inputs.check_plan`) before anything is written.

Outputs under `out` (all written atomically):
    steps.parquet        the per-step table (one row per (step, rank), shared schema)
    summary.json         the run summary (metrics over steps >= warmup_steps)
    plan_summary.json    the plan's summary (epoch 0)
    checkpoints/         ckpt-<step>.pt, the newest two
    tracking.spool.jsonl metrics waiting for an unreachable store (only while some are)
    .train.lock          held while a trainer writes the folder (one writer per folder)
Starting the same command again resumes from the newest checkpoint if the run's identity
(config, budgets, calibration, data, plan, code) is unchanged: in the same MLflow run, or in
a new one that re-logs the checkpoint's steps when the store holds steps the stopped process
logged after that checkpoint (MLflow then agrees with the per-step table); otherwise it
starts over in a new MLflow run. Either way the old run is tagged superseded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from adaptiveload import experiment
from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError
from adaptiveload.io import LockHeld, exclusive, write_json, write_parquet
from adaptiveload.ops import ln_modulate as lm
from adaptiveload.pipeline import RUN_SPOOL, Layout
from adaptiveload.provenance import device_name, git_commit
from adaptiveload.training import checkpoint
from adaptiveload.training.distributed import Ranks, resolve_ranks, timer_of
from adaptiveload.training.inputs import check_layout, prepare_data, run_identity
from adaptiveload.training.loop import StepSink, TrainData, Trainer, total_steps
from adaptiveload.training.refine import check_refine
from adaptiveload.training.settings import TrainConfig, from_experiment
from adaptiveload.training.sp_plan import check_groups
from adaptiveload.training.summary import ln_modulate_impl, run_summary


@dataclass
class Request:
    """What the user asked for on the command line."""

    config: Path
    policy: str
    seed: int
    steps: int | str | None = None  # a count or WHOLE_EPOCH
    emulate_world_size: int | None = None
    kernel: str | None = None
    calibration: Path | None = None
    manifest: Path | None = None
    plan: Path | None = None  # the plan summary JSON this run must reproduce (the pipeline's)
    out: Path | None = None
    device: str | None = None
    progress: bool = True
    checkpoint: bool = True  # False: no checkpoints, so no resume (short measurement runs)


@dataclass(frozen=True)
class Resolved:
    """A request checked and resolved: the experiment, the run's config, its ranks, the
    calibration (if any) and the run folder."""

    exp: dict[str, Any]
    cfg: TrainConfig
    ranks: Ranks
    calibration: Calibration | None
    out: Path


def resolve(req: Request) -> Resolved:
    """Validate everything (files, fields, flags) before any output is written."""
    exp = experiment.load(req.config)
    ranks = resolve_ranks(req.emulate_world_size, exp["train"]["world_size"])
    cfg = from_experiment(
        exp, req.policy, req.seed, launch_mode=ranks.launch_mode, world_size=ranks.world_size,
        steps=req.steps, kernel=req.kernel, device=req.device,
    )
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device visible; use --device cpu")
    if cfg.device == "cuda" and ln_modulate_impl(cfg) == "reference math":
        # the op would run its reference math on the GPU: a "fused" row measuring that
        raise UserError(
            f"{req.config}: model.kernels fused on cuda, but the fused kernel is not loaded "
            f"({lm.fused_unavailable_reason()}); build it with `adaptiveload kernel build` "
            "or train with --kernel eager"
        )
    cal_path = req.calibration or exp["calibration"]["file"]
    calibration = Calibration.load(cal_path) if cal_path else None
    if calibration is not None:
        calibration.require_model(cfg.model, cal_path)
    check_refine(cfg, calibration)
    # the pipeline's layout, so a hand-run lands beside the pipeline's runs
    out = req.out or Layout(cfg.experiment).run_dir(cfg.policy, cfg.seed, cfg.kernel)
    return Resolved(exp, cfg, ranks, calibration, Path(out))


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


class RunSink(StepSink, Protocol):
    """Where a run's records go besides its files: every step's metrics (`StepSink`), then
    the summary, the output files and the final status. `adaptiveload.tracking`'s RunTracker
    implements it; training hands it plain numbers, strings and paths, and imports nothing of
    tracking (the caller passes the opener: `RunTracker.open`)."""

    def log_summary(self, metrics: Mapping[str, float]) -> None: ...

    def log_artifact(self, path: Path) -> None: ...

    def finish(self, status: str = "FINISHED") -> Any: ...


# opens a run's sink from the keyword arguments `train` describes the run with (experiment,
# run_name, params, tags, run_description, spool_path, resume, run_dir, supersede, description)
OpenSink = Callable[..., RunSink]


def run_tags(cfg: TrainConfig) -> dict[str, str]:
    """The MLflow tags of a training run: provenance, its settings, and how it was timed."""
    return {
        "git_commit": git_commit(),
        "device": device_name(cfg.device),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "experiment": cfg.experiment,
        "policy": cfg.policy,
        "seed": str(cfg.seed),
        "kernel": cfg.kernel,
        "batch_layout": cfg.execution.layout,
        "attention_backend": cfg.execution.attention,
        "precision": cfg.precision,
        "ln_modulate_impl": ln_modulate_impl(cfg),
        "launch_mode": cfg.launch_mode,
        "world_size": str(cfg.world_size),
        "source": "measured",
        "timer": timer_of(cfg.launch_mode, cfg.device),
        "timed_window": cfg.timed_window,
    }


def train(req: Request, open_sink: OpenSink | None = None) -> dict[str, Any]:
    """Run (or resume) one training run; returns its summary (on the main process).

    `open_sink`: where the main process reports the run (None: nowhere), opened after every
    input is checked and before training starts, so an unreachable store fails early. The
    main process holds the run folder's lock (`run_folder`) from before it reads a
    checkpoint until its outputs are written."""
    run = resolve(req)
    data = prepare_data(run.exp, run.cfg, run.calibration, req.manifest, req.plan)
    check_layout(data.builder(0).table, run.cfg, req.config)
    check_groups(data.builder(0).table, run.cfg, run.ranks.distributed, req.config)
    with run_folder(run.out) if run.ranks.is_main else nullcontext():
        return _train(req, run, data, open_sink)


# the lock file of a run folder while a trainer writes it (removed when it is done)
LOCK_NAME = ".train.lock"


@contextmanager
def run_folder(out: Path) -> Iterator[None]:
    """One writer per run folder: a second trainer of the same folder (a hand-started run
    with the pipeline's policy and seed, say) is refused in one line instead of resuming the
    live run's checkpoint and MLflow run; a dead holder does not keep the lock (the kernel
    releases it). A folder this call created is removed again if nothing was written."""
    created = not out.exists()
    try:
        with exclusive(out / LOCK_NAME):
            yield
    except LockHeld as held:
        raise UserError(
            f"{out}: another `adaptiveload train` is writing this run folder ({held.holder}); "
            "wait for it to end or stop it, or train into another --out"
        ) from None
    finally:
        if created:
            with suppress(OSError):
                out.rmdir()  # only if empty: the run failed before writing anything


def _train(
    req: Request, run: Resolved, data: TrainData, open_sink: OpenSink | None
) -> dict[str, Any]:
    cfg, ranks, calibration, out = run.cfg, run.ranks, run.calibration, run.out
    ckpt_dir = out / "checkpoints" if req.checkpoint else None
    main = ranks.is_main
    identity = run_identity(cfg, data)
    found = (
        checkpoint.find(ckpt_dir, identity["identity"], tidy=main, last=total_steps(cfg, data))
        if ckpt_dir
        else checkpoint.Found()
    )
    resume = found.state
    sink = _open(open_sink, run, identity, found) if open_sink is not None and main else None
    if main:
        _retract(out)
    trainer = None
    try:
        trainer = Trainer(
            cfg, data, ckpt_dir, ranks, sink=sink, resume=resume, progress=req.progress,
            identity=identity["identity"],
        )
        result = trainer.run()
    except BaseException:
        if sink is not None:
            sink.finish(status="FAILED")
        raise
    finally:
        if trainer is not None:
            trainer.close()
    if not main:
        return {}
    # the plans the run executed: with train.refine, replanned at its refits
    summary = run_summary(cfg, result.steps, trainer.source, calibration, trainer.capacity)
    plan_summary = data.builder(0).summary
    write_parquet(out / "steps.parquet", result.steps)
    write_json(out / "plan_summary.json", plan_summary)
    if trainer.closed_loop is not None:  # every refit's calibration: replays the run's plans
        write_json(out / REFITS, trainer.closed_loop.record())
    write_json(out / "summary.json", summary)  # last of RESULTS: the run is complete
    if sink is not None:
        sink.log_summary(_numeric(summary))
        for name in RESULTS:
            sink.log_artifact(out / name)
        if trainer.closed_loop is not None:
            sink.log_artifact(out / REFITS)
        sink.finish()
    return summary


# what a finished run leaves in its folder (the pipeline's `train` outputs among them)
RESULTS = ("steps.parquet", "plan_summary.json", "summary.json")
# a closed-loop run's refits (train.refine): where each took effect and its calibration
REFITS = "refits.json"


def _retract(out: Path) -> None:
    """Remove the folder's results before this run changes its checkpoints and MLflow run:
    they describe an earlier state, and a run stopped before writing its own must not leave
    them looking current (the pipeline would see its outputs up to date and rerun nothing
    while the MLflow run it reopened is RUNNING)."""
    for name in (*RESULTS, REFITS):
        (out / name).unlink(missing_ok=True)


def _open(
    open_sink: OpenSink, run: Resolved, identity: dict[str, str], found: checkpoint.Found
) -> RunSink:
    """The run's sink, described by its params and tags; resuming, the checkpoint's MLflow
    run and its step count (the tracker continues in a new run if the store holds later
    steps, the stopped process's)."""
    cfg, resume = run.cfg, found.state or {}
    return open_sink(
        experiment=cfg.experiment,
        run_name=cfg.run_name,
        params={
            "experiment": run.exp,
            "run": cfg.to_dict(),
            "calibration": run.calibration.label if run.calibration else "none",
            "identity": identity,
        },
        tags={**run_tags(cfg), "steps_per_epoch": str(run.exp["plan"]["steps_per_epoch"])},
        run_description=(
            f"{cfg.policy}, seed {cfg.seed}, kernel {cfg.kernel}: {cfg.model} trained "
            f"on {cfg.world_size} {cfg.launch_mode} ranks ({device_name(cfg.device)}); "
            "per-step and summary metrics measured"
        ),
        spool_path=run.out / RUN_SPOOL,
        resume=(
            {"run_id": resume["tracking"]["run_id"], "step": resume["step"]}
            if resume.get("tracking", {}).get("run_id")
            else None
        ),
        run_dir=run.out,
        supersede=(found.stale or {}).get("tracking", {}).get("run_id"),
        description=run.exp.get("description"),  # a stage view has none: kept as it is
    )
