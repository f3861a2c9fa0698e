"""Collect the per-step tables and run summaries of training runs and simulations into one tidy
pair of tables, so that every later analysis step reads one format whatever produced the data.

Each run is a per-step Parquet table (one row per (step, rank), the schema shared by the
trainer and the simulator) plus a JSON run summary beside it. A run is placed by two labels
the pipeline gives it: `setup` (the comparison group: "train" for measured runs, "sim/<name>"
for a simulated paper-scale configuration) and `variant` ("base", or a sweep point such as
"p=1.4", "m_comp=0.5", "world_size=64", "mixture=video-only").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError
from adaptiveload.io import read_json, read_table
from adaptiveload.pipeline import BASE_VARIANT, parse_variant
from adaptiveload.step_table import (
    REQUIRED_STEP_COLUMNS,
    SP_DEGREE,
    STEP_COLUMNS,
    real_counts,
    timed,
)

# fields every run summary must carry (the trainer's and the simulator's; docs/tracking.md)
SUMMARY_KEYS = (
    "experiment", "policy", "seed", "kernel", "launch_mode", "world_size", "device", "source",
    "warmup_steps",
)
# summary metrics copied when present (NaN otherwise: e.g. no measured VRAM on CPU)
SUMMARY_METRICS = (
    "imbalance_rate", "imbalance_rate_mean", "idle_fraction", "max_over_mean", "samples_per_s",
    "tokens_per_s", "samples_per_s_wall", "tokens_per_s_wall", "vram_utilization_mean",
    "vram_utilization_max", "capacity_bytes", "vs_lower_bound", "vs_epoch_lower_bound",
    "epoch_lower_bound_s", "min_steps_per_epoch",
    "padding_samples", "padding_fraction", "epoch_steps",
    "samples_per_step_mean", "samples_per_step_std", "samples_per_step_min",
    "samples_per_step_max", "tokens_per_step_mean", "tokens_per_step_std",
    "tokens_per_step_min", "tokens_per_step_max",
    "max_micro_batch_tokens", "max_micro_batch_bytes_model", "memory_measured_tokens",
    "micro_batches_beyond_measured_memory", "host_load_mean",
)
RUN_KEYS = ("setup", "variant", "policy", "kernel", "seed")


@dataclass(frozen=True)
class RunRef:
    """Where one run's files are and which comparison group it belongs to."""

    setup: str
    variant: str
    summary: Path
    steps: Path
    # summary fields the producer left empty (a simulation knows no experiment or kernel)
    defaults: dict = field(default_factory=dict)
    # a calibration JSON whose capacity_bytes scales the model's memory estimate when the
    # summary has no capacity of its own
    calibration: Path | None = None


@dataclass(frozen=True)
class Aggregate:
    """`runs`: one row per run (labels, summary metrics); `steps`: one per (run, step, rank)."""

    runs: pd.DataFrame
    steps: pd.DataFrame


def parse_index(index: str | Path | list[dict]) -> list[RunRef]:
    """The runs of a run index: a list of {setup, variant, summary, steps[, calibration, ...]}
    (what `adaptiveload.pipeline.run_index` gives), or a JSON file holding one. Other keys
    fill summary fields that are missing or null."""
    origin = "run index" if isinstance(index, list) else str(index)
    items = index if isinstance(index, list) else read_json(index, "run index")
    if not isinstance(items, list):
        raise UserError(f"{origin}: a run index is a JSON list of runs")
    refs = []
    for i, item in enumerate(items):
        missing = [k for k in ("setup", "summary", "steps") if k not in item]
        if missing:
            raise UserError(f"{origin}: entry {i}: missing {', '.join(missing)}")
        refs.append(
            RunRef(
                setup=str(item["setup"]),
                variant=str(item.get("variant", BASE_VARIANT)),
                summary=Path(item["summary"]),
                steps=Path(item["steps"]),
                defaults={k: v for k, v in item.items()
                          if k not in ("setup", "variant", "summary", "steps", "calibration")},
                calibration=Path(item["calibration"]) if item.get("calibration") else None,
            )
        )
    if not refs:
        raise UserError(f"{origin}: no runs listed")
    return refs


# what a user does about a run file that is missing or unreadable (a full disk, a kill, an edit)
RERUN_FIX = (
    "delete it and run the pipeline again: the job that writes it runs again (a training run "
    "from its last checkpoint)"
)


def _read_summary(path: Path, defaults: dict) -> dict:
    try:
        data = read_json(path, "run summary")
    except UserError as exc:
        raise UserError(f"{exc}; {RERUN_FIX}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: run summary is not a JSON object; {RERUN_FIX}")
    # summary metrics may be nested under "summary" or "metrics", or flat
    for key in ("summary", "metrics"):
        if isinstance(data.get(key), dict):
            data = {**data[key], **{k: v for k, v in data.items() if k != key}}
    data.update({k: v for k, v in defaults.items() if data.get(k) is None})
    missing = [k for k in SUMMARY_KEYS if k not in data]
    if missing:
        raise UserError(f"{path}: run summary lacks field(s) {', '.join(missing)}")
    return data


def _step_mode(summary: dict) -> str:
    """The step mode of a run summary: its own, else its plan's; "free" for summaries written
    before plans had one (every plan was then the policy's own step count)."""
    plan = summary.get("plan") if isinstance(summary.get("plan"), dict) else {}
    mode = summary.get("steps_per_epoch", plan.get("steps_per_epoch"))
    return "free" if mode is None else str(mode)


def _read_steps(path: Path) -> pd.DataFrame:
    frame = read_table(path, "per-step table", RERUN_FIX)
    missing = [c for c in REQUIRED_STEP_COLUMNS if c not in frame.columns]
    if missing:
        raise UserError(f"{path}: per-step table lacks column(s) {', '.join(missing)}")
    if frame.empty:
        raise UserError(f"{path}: per-step table has no rows")
    for col in STEP_COLUMNS:
        if col not in frame.columns:
            frame[col] = np.nan
    return frame[[*STEP_COLUMNS, *([SP_DEGREE] if SP_DEGREE in frame.columns else [])]]


def aggregate(refs: Sequence[RunRef]) -> Aggregate:
    """Read every run; the tables are sorted so that output is byte-stable across re-runs."""
    run_rows, step_frames = [], []
    for ref in refs:
        summary = _read_summary(ref.summary, ref.defaults)
        if summary.get("capacity_bytes") is None and ref.calibration is not None:
            summary["capacity_bytes"] = Calibration.load(ref.calibration).capacity_bytes
        steps = _read_steps(ref.steps)
        axis, value = parse_variant(ref.variant)
        labels = {
            "setup": ref.setup,
            "variant": ref.variant,
            "sweep_axis": axis,
            "sweep_value": value,
            "experiment": str(summary["experiment"]),
            "policy": str(summary["policy"]),
            "kernel": str(summary["kernel"] or "none"),
            "seed": int(summary["seed"]),
            "launch_mode": str(summary["launch_mode"]),
            "world_size": int(summary["world_size"]),
            "device": str(summary["device"]),
            "source": str(summary["source"]),
            # the clock of compute_s and step_time_s (measured runs; a simulation has none)
            "timer": str(summary.get("timer") or ""),
            "warmup_steps": int(summary["warmup_steps"]),
            # "epoch": the timed steps are one whole epoch; "steps": a fixed count (simulations
            # and older summaries)
            "timed_window": str(summary.get("timed_window") or "steps"),
            # free, match or K: the optimizer steps per epoch its plan was made at (a
            # simulation's plan summary, a training run's own field)
            "steps_per_epoch": _step_mode(summary),
        }
        how = f"{labels['timer']}, " if labels["timer"] else ""  # the clock of a measurement
        cal = str(summary.get("calibration") or "")
        if labels["source"] == "model" and cal.startswith("measured"):
            how = "measured calibration, "  # a prediction through a device's measured costs
        labels["label"] = f"{labels['source']} ({how}{labels['device']})"
        run_rows.append(
            {**labels, **{m: _float(summary.get(m)) for m in SUMMARY_METRICS}}
        )
        run_labels = (*RUN_KEYS, "source", "label", "timed_window", "steps_per_epoch")
        steps = steps.assign(**{k: labels[k] for k in run_labels})
        steps["timed"] = timed(steps["step"], labels["warmup_steps"])
        steps["capacity_bytes"] = _float(summary.get("capacity_bytes"))
        step_frames.append(steps)
    runs = pd.DataFrame(run_rows)
    dupes = runs.duplicated(list(RUN_KEYS))
    if dupes.any():
        first = runs[dupes].iloc[0]
        raise UserError(
            f"run index: two runs share setup/variant/policy/kernel/seed "
            f"{tuple(first[k] for k in RUN_KEYS)}; give each run its own labels"
        )
    runs = runs.sort_values(list(RUN_KEYS)).reset_index(drop=True)
    steps = pd.concat(step_frames, ignore_index=True)
    steps = steps.sort_values([*RUN_KEYS, "step", "rank"]).reset_index(drop=True)
    return Aggregate(runs=runs, steps=steps)


def _float(value: object) -> float:
    return float(value) if value is not None else float("nan")


def per_step(steps: pd.DataFrame, timed_only: bool = True) -> pd.DataFrame:
    """One row per (run, step): the step's balance and throughput, docs/definitions.md's definitions
    applied to one step (the run-level numbers are their means / ratios of sums). Times are by
    the run's timer; `samples_per_s_wall` by the wall clock (NaN where there is none).
    `samples` and `tokens` are the step's real ones (`step_table.real_counts`), what
    throughput counts; `padding_samples` the repeats beside them."""
    frame = steps[steps["timed"]] if timed_only else steps
    util_measured = frame["peak_bytes"] / frame["capacity_bytes"]
    util_model = frame["peak_bytes_model"] / frame["capacity_bytes"]
    real_samples, real_tokens = real_counts(frame)
    frame = frame.assign(
        util_measured=util_measured,
        util_model=util_model,
        samples=real_samples,
        tokens=real_tokens,
    )
    keys = [*RUN_KEYS, "source", "label", "timed_window", "step"]
    grouped = frame.groupby(keys, sort=True)
    out = grouped.agg(
        compute_max=("compute_s", "max"),
        compute_min=("compute_s", "min"),
        compute_mean=("compute_s", "mean"),
        ranks=("rank", "nunique"),
        samples=("samples", "sum"),
        tokens=("tokens", "sum"),
        padding_samples=("padding_samples", "sum"),
        step_time_s=("step_time_s", "max"),
        step_wall_s=("step_wall_s", "max"),
        vram_util_measured=("util_measured", "mean"),
        vram_util_model=("util_model", "mean"),
    ).reset_index()
    cmax = out["compute_max"].replace(0.0, np.nan)  # a step without compute: NaN, not inf
    out["imbalance"] = metrics.step_imbalance(cmax, out["compute_min"])
    out["idle"] = metrics.step_idle(cmax, out["compute_mean"])
    out["samples_per_s"], out["tokens_per_s"] = metrics.throughput(
        out["samples"], out["tokens"], out["step_time_s"].replace(0.0, np.nan)
    )
    out["samples_per_s_wall"], _ = metrics.throughput(
        out["samples"], out["tokens"], out["step_wall_s"].replace(0.0, np.nan)
    )
    return out
