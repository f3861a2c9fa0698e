"""The run summary beside the per-step table, and the simulator-versus-measurement check.

Metrics come from `adaptiveload.metrics.summarize` over steps >= warmup_steps (the one
metrics module); throughput divides by the sum of the window's step times. Balance and
throughput use the run's timer (`timer`: on CPU, thread CPU time, which other processes on
the machine do not disturb); `samples_per_s_wall` and `tokens_per_s_wall` divide by the
wall-clock step times beside them. Throughput counts real samples (`step_table.real_counts`):
padding repeats are reported beside it (`padding_samples`, `padding_fraction`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pandas as pd
import torch

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration
from adaptiveload.ops import ln_modulate as lm
from adaptiveload.planning.sampler import PlanBuilder
from adaptiveload.planning.simulate import simulate
from adaptiveload.provenance import device_name
from adaptiveload.step_table import WHOLE_EPOCH, real_counts, timed
from adaptiveload.training.distributed import timer_of
from adaptiveload.training.settings import TrainConfig


def ln_modulate_impl(cfg: TrainConfig) -> str:
    """What the run's LayerNorm-Modulate sites execute: Wan's eager ops, the fused CUDA
    kernel, or the fused op's reference math (CPU tensors; a CUDA run without the kernel is
    refused by `session.resolve`, so a "fused" row always means what it says)."""
    if cfg.kernel != "fused":
        return "eager"
    on_cuda = torch.device(cfg.device).type == "cuda"
    return "cuda kernel" if on_cuda and lm.fused_available() else "reference math"


def timed_window(table: pd.DataFrame, warmup_steps: int) -> pd.DataFrame:
    return table[timed(table["step"], warmup_steps)]


def measured_metrics(
    table: pd.DataFrame, warmup_steps: int, capacity_bytes: float | None
) -> dict[str, float]:
    """metrics.window_metrics over the timed window (the run's timer), throughput by the wall
    clock beside it; VRAM utilization when every rank-step's peak was measured."""
    win = timed_window(table, warmup_steps)

    def by_step_and_rank(column: str) -> np.ndarray:
        return win.pivot(index="step", columns="rank", values=column).to_numpy(np.float64)

    per_step = win.groupby("step")[["step_time_s", "step_wall_s"]].first()
    timed, wall = float(per_step["step_time_s"].sum()), float(per_step["step_wall_s"].sum())
    real_samples, real_tokens = real_counts(win)
    counts = win.assign(samples=real_samples, tokens=real_tokens).groupby("step")[
        ["samples", "tokens", "padding_samples"]
    ].sum()
    out = metrics.window_metrics(
        by_step_and_rank("compute_s"),
        metrics.StepCounts(*(counts[c].to_numpy(np.float64) for c in counts.columns)),
        seconds=timed,
        peak_bytes=by_step_and_rank("peak_bytes") if win["peak_bytes"].notna().all() else None,
        capacity_bytes=capacity_bytes,
    )
    out["timed_s"], out["wall_s"] = timed, wall
    out["samples_per_s_wall"], out["tokens_per_s_wall"] = metrics.throughput(
        float(counts["samples"].sum()), float(counts["tokens"].sum()), wall
    )
    # the load the window ran under: the analysis's sensitivity line (analysis.stats.LOAD)
    out["host_load_mean"] = float(win.groupby("step")["host_load_1m"].first().mean())
    return out


def simulator_error(
    table: pd.DataFrame,
    builder: PlanBuilder,
    calibration: Calibration,
    warmup_steps: int,
    whole_epoch: bool = False,
) -> dict[str, float]:
    """Relative error |predicted - measured| / measured of per-(step, rank) compute times.

    The prediction is `planning.simulate` on exactly the plan steps this run executed
    (epochs stitched together in order; with `whole_epoch`, the timed steps are epoch 0
    from its first step), through the calibration's cost model.
    """
    world = builder.world_size
    # run step = plan step + shift (the warm-up steps come before a replayed epoch 0)
    shift = warmup_steps if whole_epoch else 0
    parts, offset, epoch = [], 0, 0
    n_steps = int(table["step"].max()) + 1 - shift
    while offset < n_steps:
        plan = builder(epoch).table
        part = plan.assign(step=plan["step"] + offset)
        parts.append(part[part["step"] < n_steps])
        offset += int(plan["step"].max()) + 1
        epoch += 1
    plan_rows = pd.concat(parts, ignore_index=True)
    plan_rows.attrs["plan"] = {"world_size": world}
    predicted = simulate(plan_rows, calibration, world_size=world).steps
    predicted["step"] += shift
    both = timed_window(table, warmup_steps).merge(
        predicted[["step", "rank", "compute_s", "samples"]], on=["step", "rank"],
        suffixes=("", "_model"),
    )
    if not (both["samples"] == both["samples_model"]).all():
        raise RuntimeError("measured steps do not match the plan's batches")
    rel = (both["compute_s_model"] - both["compute_s"]).abs() / both["compute_s"]
    return {
        "sim_rel_err_median": float(rel.median()),
        "sim_rel_err_p90": float(rel.quantile(0.9)),
    }


def plan_terms(builder: PlanBuilder) -> dict[str, Any]:
    """What the run's plan was made at and how far from the epoch's least step count: the
    step mode (``free``, ``match`` or K, as a string), K_min and
    the plan's predicted epoch time over the epoch lower bound (model: the calibration's
    cost model, not this run's clock; absent without a calibration)."""
    plan = builder(0).summary
    terms = {"steps_per_epoch": str(builder.steps_per_epoch),
             "min_steps_per_epoch": plan.get("min_steps_per_epoch")}
    if plan.get("predicted_vs_epoch_lower_bound") is not None:
        terms["predicted_vs_epoch_lower_bound"] = plan["predicted_vs_epoch_lower_bound"]
    return terms


def run_summary(
    cfg: TrainConfig,
    table: pd.DataFrame,
    builder: PlanBuilder,
    calibration: Calibration | None,
    capacity_bytes: float | None,
) -> dict[str, Any]:
    """The JSON summary of one measured run (its metrics: docs/tracking.md)."""
    summary: dict[str, Any] = {
        "experiment": cfg.experiment,
        "policy": cfg.policy,
        "seed": cfg.seed,
        "kernel": cfg.kernel,
        "batch_layout": cfg.execution.layout,
        "attention_backend": cfg.execution.attention,
        "precision": cfg.precision,
        "ln_modulate_impl": ln_modulate_impl(cfg),
        "launch_mode": cfg.launch_mode,
        "world_size": cfg.world_size,
        "device": device_name(cfg.device),
        "source": "measured",
        "timer": timer_of(cfg.launch_mode, cfg.device),
        "warmup_steps": cfg.warmup_steps,
        "steps_total": int(table["step"].max()) + 1,
        # the optimizer steps of one epoch of the plan (the global batch it trains with)
        "epoch_steps": int(builder(0).summary["steps"]),
        "timed_window": cfg.timed_window,
        "calibration": calibration.label if calibration else None,
        "peak_bytes_model_source": calibration.label if calibration else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        # wall-clock timings are only as good as the machine was quiet: oversubscribed OpenMP
        # threads slow a 2-core run 10x or more and scramble per-rank times; say how busy it was
        "host_load_average_1m_5m": list(os.getloadavg()[:2]),
    }
    summary.update(measured_metrics(table, cfg.warmup_steps, capacity_bytes))
    summary.update(plan_terms(builder))
    if calibration is not None:
        summary.update(
            simulator_error(
                table, builder, calibration, cfg.warmup_steps, cfg.steps == WHOLE_EPOCH
            )
        )
        summary["sim_source"] = calibration.label
    return summary
