"""A plan through the cost model: predicted per-step, per-rank times and the metrics of
docs/definitions.md.

Per (step, rank) the rank's micro-batch of B samples of S tokens costs
``compute_s = cost.step_time(B, S)`` (forward + backward, no communication). The step then
waits for its slowest rank and for the gradient all-reduce:

    step_time_s = max_r compute_s + allreduce_s,
    allreduce_s = 2 (N - 1) / N * grad_bytes / (allreduce_gbps * 1e9 / 8)

i.e. a bandwidth-bound ring all-reduce (latency terms ignored), ``allreduce_gbps`` in
gigabits per second, not overlapped with backward (an upper bound on its cost; it shifts
throughput, never the imbalance). ``grad_bytes`` is the size of the gradients: a
calibration's ``grad_bytes`` field, else ``num_params * 4`` (fp32 gradients), else 0.

Every number here is a prediction: the output is labelled ``source: "model"``. Throughput
counts the samples the ranks process, the padding repeats of the last step included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.step_table import STEP_COLUMNS, timed

DEFAULT_ALLREDUCE_GBPS = 100.0
FP32_BYTES = 4

@dataclass
class Simulation:
    """`steps`: one row per (step, rank) in the shared per-step schema (`step_table`);
    `summary`: the run summary (metrics over steps >= warmup_steps, labelled source "model")."""

    steps: pd.DataFrame
    summary: dict[str, Any]


def allreduce_seconds(grad_bytes: float, world_size: int, gbps: float) -> float:
    """Bandwidth term of a ring all-reduce of `grad_bytes` over `world_size` ranks."""
    if world_size <= 1 or grad_bytes <= 0:
        return 0.0
    if gbps <= 0:
        raise ValueError("allreduce bandwidth must be positive")
    return 2.0 * (world_size - 1) / world_size * grad_bytes / (gbps * 1e9 / 8)


def grad_bytes_of(calibration: Calibration) -> float:
    """Gradient bytes a calibration implies: `grad_bytes`, else `num_params` * 4, else 0."""
    extra = calibration.extra
    if extra.get("grad_bytes") is not None:
        return float(extra["grad_bytes"])
    if extra.get("num_params") is not None:
        return float(extra["num_params"]) * FP32_BYTES
    return 0.0


def simulate(
    plan_table: pd.DataFrame,
    cost_model: CostModel | Calibration,
    allreduce_gbps: float = DEFAULT_ALLREDUCE_GBPS,
    world_size: int | None = None,
    grad_bytes: float | None = None,
    capacity_bytes: float | None = None,
    warmup_steps: int = 0,
) -> Simulation:
    """Predicted per-(step, rank) times of `plan_table` and their summary metrics.

    With a Calibration, `grad_bytes` and `capacity_bytes` default to what it carries.
    `world_size` defaults to the plan's (its attrs, else 1 + the largest rank).
    """
    cost, calibration = _split(cost_model)
    if calibration is not None:
        grad_bytes = grad_bytes_of(calibration) if grad_bytes is None else grad_bytes
        capacity_bytes = capacity_bytes or calibration.capacity_bytes
    grad_bytes = grad_bytes or 0.0
    table = plan_table
    n = world_size or int(table.attrs.get("plan", {}).get("world_size") or 0)
    n = n or int(table["rank"].max()) + 1
    step = table["step"].to_numpy(np.int64)
    rank = table["rank"].to_numpy(np.int64)
    if rank.size and rank.max() >= n:
        raise ValueError(f"plan has rank {rank.max()} but world_size is {n}")
    steps = int(step.max()) + 1 if step.size else 0
    key = step * n + rank
    if key.size and np.any(np.diff(key) < 0):
        order = np.argsort(key, kind="stable")
        key, table = key[order], table.iloc[order]
    cells = steps * n
    batch = np.bincount(key, minlength=cells)
    first = np.minimum(np.concatenate(([0], np.cumsum(batch)[:-1])), max(key.size - 1, 0))
    has = batch > 0

    def first_of(col: str) -> np.ndarray:
        return np.where(has, table[col].to_numpy(np.int64)[first], 0)

    s_tok, frames, height, width = (first_of(c) for c in ("tokens", "frames", "height", "width"))
    compute = np.where(has, cost.step_time(batch, s_tok), 0.0).reshape(steps, n)
    peak_model = np.where(has, cost.memory(batch, s_tok), np.nan)
    t_step = compute.max(axis=1)
    ar_s = allreduce_seconds(grad_bytes, n, allreduce_gbps)
    step_time = t_step + ar_s
    frame = pd.DataFrame(
        {
            "step": np.repeat(np.arange(steps), n),
            "rank": np.tile(np.arange(n), steps),
            "compute_s": compute.ravel(),
            "compute_wall_s": pd.array([pd.NA] * cells, dtype="Float64"),
            "wait_s": (t_step[:, None] - compute).ravel(),
            "samples": batch,
            "tokens": batch * s_tok,
            "frames": frames,
            "height": height,
            "width": width,
            "peak_bytes": pd.array([pd.NA] * cells, dtype="Float64"),
            "peak_bytes_model": peak_model,
            "loss": pd.array([pd.NA] * cells, dtype="Float64"),
            "step_time_s": np.repeat(step_time, n),
            "step_wall_s": pd.array([pd.NA] * cells, dtype="Float64"),
        },
        columns=list(STEP_COLUMNS),
    )
    summary: dict[str, Any] = {
        "launch_mode": "simulated",
        "source": "model",
        "device": calibration.device if calibration else None,
        "calibration": calibration.label if calibration else None,
        "world_size": n,
        "warmup_steps": warmup_steps,
        "allreduce_gbps": allreduce_gbps,
        "grad_bytes": grad_bytes,
        "allreduce_s": ar_s,
    }
    summary.update(
        _metrics(compute, batch, s_tok, step_time, peak_model, capacity_bytes, warmup_steps)
    )
    return Simulation(steps=frame, summary=summary)


def _split(cost_model: CostModel | Calibration) -> tuple[CostModel, Calibration | None]:
    if isinstance(cost_model, Calibration):
        return cost_model.cost, cost_model
    return cost_model, None


def _metrics(
    compute: np.ndarray,
    batch: np.ndarray,
    s_tok: np.ndarray,
    step_time: np.ndarray,
    peak_model: np.ndarray,
    capacity_bytes: float | None,
    warmup_steps: int,
) -> dict[str, Any]:
    steps, n = compute.shape
    keep = timed(np.arange(steps), warmup_steps)
    window = compute[keep]
    if window.shape[0] == 0:
        return {"steps": 0}
    cells = np.repeat(keep, n)
    wall_s = float(step_time[keep].sum())
    peak = peak_model.reshape(steps, n)[keep]
    out: dict[str, Any] = metrics.window_metrics(
        window,
        samples=float(batch[cells].sum()),
        tokens=float((batch * s_tok)[cells].sum()),
        seconds=wall_s,
        peak_bytes=np.where(np.isnan(peak), 0.0, peak),  # a rank without a batch: no memory
        capacity_bytes=capacity_bytes,
    )
    out["wall_s"] = wall_s
    return out
