"""A plan through the cost model: predicted per-step, per-rank times and the metrics of
docs/definitions.md.

Per (step, rank) the rank's micro-batch costs what its samples cost together,
``compute_s = cost.pack_time(n, Σ S, Σ S²)`` (forward + backward, no communication; for B
samples of one shape that is ``cost.step_time(B, S)``), so a cell of the plan table may hold
samples of several shapes (a pack). The step then waits for its slowest rank and for the
gradient all-reduce:

    step_time_s = max_r compute_s + allreduce_s,
    allreduce_s = 2 (N - 1) / N * grad_bytes / (allreduce_gbps * 1e9 / 8)

i.e. a bandwidth-bound ring all-reduce (latency terms ignored), ``allreduce_gbps`` in
gigabits per second, not overlapped with backward (an upper bound on its cost; it shifts
throughput, never the imbalance). ``grad_bytes`` is the size of the gradients: a
calibration's ``grad_bytes`` field, else ``num_params * 4`` (fp32 gradients), else 0.

Every number here is a prediction: the output is labelled ``source: "model"``. Throughput
counts the samples the ranks process, the padding repeats of the last step included.
``vs_lower_bound`` is the window's summed ``max_r compute_s`` over the sum of each step's
``CostModel.step_lower_bound`` (its samples' per-sample costs, however they were packed):
1.0 means no plan of the same steps could do better.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.experiment import schema_default
from adaptiveload.step_table import STEP_COLUMNS, VAL_COLUMNS, timed

DEFAULT_ALLREDUCE_GBPS = schema_default("train.allreduce_gbps")  # an experiment's default
FP32_BYTES = 4


@dataclass
class Simulation:
    """`steps`: one row per (step, rank) in the shared per-step schema (`step_table`);
    `summary`: the run summary (metrics over steps >= warmup_steps, labelled source "model")."""

    steps: pd.DataFrame
    summary: dict[str, Any]
    capacity_bytes: float | None = None

    def timed(self, warmup_steps: int) -> Simulation:
        """The same simulation summarized over another timed window (nothing is simulated
        again: a plan's per-step predictions do not depend on the window)."""
        summary = {k: v for k, v in self.summary.items() if k in _HEADER}
        summary["warmup_steps"] = warmup_steps
        summary.update(_metrics(self.steps, summary["world_size"], self.capacity_bytes,
                                warmup_steps))  # fmt: skip
        return Simulation(self.steps, summary, self.capacity_bytes)


# the summary fields that describe the simulation itself (the rest are its window's metrics)
_HEADER = ("launch_mode", "source", "device", "calibration", "world_size", "warmup_steps",
           "allreduce_gbps", "grad_bytes", "allreduce_s")  # fmt: skip


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
    n = world_size or int(plan_table.attrs.get("plan", {}).get("world_size") or 0)
    n = n or int(plan_table["rank"].max()) + 1
    ar_s = allreduce_seconds(grad_bytes, n, allreduce_gbps)
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
    frame = _step_table(plan_table, cost, n, ar_s)
    summary.update(_metrics(frame, n, capacity_bytes, warmup_steps))
    return Simulation(steps=frame, summary=summary, capacity_bytes=capacity_bytes)


def _step_table(table: pd.DataFrame, cost: CostModel, n: int, allreduce_s: float) -> pd.DataFrame:
    """The per-(step, rank) predictions: each rank's micro-batch (n, Σ S, Σ S² of its rows)
    through the cost model, every step waiting for its slowest rank, beside the step's lower
    bound."""
    step = table["step"].to_numpy(np.int64)
    rank = table["rank"].to_numpy(np.int64)
    if rank.size and rank.max() >= n:
        raise ValueError(f"plan has rank {rank.max()} but world_size is {n}")
    steps = int(step.max()) + 1 if step.size else 0
    key = step * n + rank
    if key.size and np.any(np.diff(key) < 0):
        order = np.argsort(key, kind="stable")
        key, table = key[order], table.iloc[order]
    cell = _cells(table, key, steps * n)
    compute = cost.pack_time(cell.samples, cell.tokens, cell.tokens_sq).reshape(steps, n)
    t_step = compute.max(axis=1)
    empty = pd.array([pd.NA] * (steps * n), dtype="Float64")  # what only a measurement has
    return pd.DataFrame(
        {
            "step": np.repeat(np.arange(steps), n),
            "rank": np.tile(np.arange(n), steps),
            "compute_s": compute.ravel(),
            "compute_wall_s": empty,
            "wait_s": (t_step[:, None] - compute).ravel(),
            "samples": cell.samples,
            "tokens": cell.tokens,
            "tokens_sq": cell.tokens_sq,
            "frames": cell.shape[:, 0],
            "height": cell.shape[:, 1],
            "width": cell.shape[:, 2],
            "peak_bytes": empty.copy(),
            "peak_bytes_model": np.where(
                cell.samples > 0, cost.pack_memory(cell.samples, cell.tokens), np.nan
            ),
            "loss": empty.copy(),
            "step_time_s": np.repeat(t_step + allreduce_s, n),
            "step_wall_s": empty.copy(),
            "lower_bound_s": np.repeat(_step_bounds(table, cost, steps, n), n),
            # learning: a measured run's columns, empty in a simulation
            **{col: empty.copy() for col in ("samples_seen", *VAL_COLUMNS)},
        },
        columns=list(STEP_COLUMNS),
    )


@dataclass(frozen=True)
class _Cells:
    """Per (step, rank) cell, step-major: its samples n, Σ S, Σ S² and its largest sample's
    bucket shape [cells, 3] (zeros for an empty cell)."""

    samples: np.ndarray
    tokens: np.ndarray
    tokens_sq: np.ndarray
    shape: np.ndarray


def _cells(table: pd.DataFrame, key: np.ndarray, cells: int) -> _Cells:
    """The cells of a plan table sorted by `key` (step * N + rank)."""
    tok = table["tokens"].to_numpy(np.int64)
    samples = np.bincount(key, minlength=cells)
    sum_s = np.bincount(key, weights=tok, minlength=cells).astype(np.int64)
    sum_sq = np.bincount(key, weights=tok.astype(np.float64) ** 2, minlength=cells)
    shape = np.zeros((cells, 3), dtype=np.int64)
    if tok.size:
        starts = np.flatnonzero(np.diff(key, prepend=-1))  # each non-empty cell's first row
        largest = np.repeat(np.maximum.reduceat(tok, starts), samples[key[starts]])
        at = np.flatnonzero(tok == largest)
        first = at[np.diff(key[at], prepend=-1) != 0]  # the first row of each cell's largest
        for i, col in enumerate(("frames", "height", "width")):
            shape[key[first], i] = table[col].to_numpy(np.int64)[first]
    return _Cells(samples, sum_s, sum_sq.round().astype(np.int64), shape)


def _step_bounds(table: pd.DataFrame, cost: CostModel, steps: int, n: int) -> np.ndarray:
    """Each step's ``CostModel.step_lower_bound`` over its samples (rows sorted by cell, so
    step-major); 0 for a step without samples."""
    step = table["step"].to_numpy(np.int64)
    work = cost.per_sample_time(table["tokens"].to_numpy(np.int64))
    work_sum = np.bincount(step, weights=work, minlength=steps)
    work_max = np.zeros(steps)
    if step.size:
        starts = np.flatnonzero(np.diff(step, prepend=-1))
        work_max[step[starts]] = np.maximum.reduceat(work, starts)
    return np.where(work_sum > 0, cost.step_lower_bound(work_sum, work_max, n), 0.0)


def _split(cost_model: CostModel | Calibration) -> tuple[CostModel, Calibration | None]:
    if isinstance(cost_model, Calibration):
        return cost_model.cost, cost_model
    return cost_model, None


def _metrics(
    frame: pd.DataFrame, n: int, capacity_bytes: float | None, warmup_steps: int
) -> dict[str, Any]:
    """The run-summary metrics of the predicted per-step table over its timed window, with
    the window's lower bound and the plan's distance from it."""
    compute = frame["compute_s"].to_numpy(np.float64).reshape(-1, n)
    steps = compute.shape[0]
    keep = timed(np.arange(steps), warmup_steps)
    window = compute[keep]
    if window.shape[0] == 0:
        return {"steps": 0}
    cells = np.repeat(keep, n)
    wall_s = float(frame["step_time_s"].to_numpy(np.float64)[::n][keep].sum())
    peak = frame["peak_bytes_model"].to_numpy(np.float64).reshape(steps, n)[keep]
    out: dict[str, Any] = metrics.window_metrics(
        window,
        samples=float(frame["samples"].to_numpy()[cells].sum()),
        tokens=float(frame["tokens"].to_numpy()[cells].sum()),
        seconds=wall_s,
        peak_bytes=np.where(np.isnan(peak), 0.0, peak),  # a rank without a batch: no memory
        capacity_bytes=capacity_bytes,
    )
    out["wall_s"] = wall_s
    lower = float(frame["lower_bound_s"].to_numpy(np.float64)[::n][keep].sum())
    out["lower_bound_s"] = lower
    out["vs_lower_bound"] = float(window.max(axis=1).sum()) / lower if lower > 0 else None
    return out
