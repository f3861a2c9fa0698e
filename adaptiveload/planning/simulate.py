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

DEFAULT_ALLREDUCE_GBPS = 100.0
FP32_BYTES = 4

# The per-step table, one row per (step, rank), that the simulator and the trainer write and
# the analysis reads (`analysis.aggregate`). compute_s / step_time_s: by the run's timer (a
# prediction here); compute_wall_s / step_wall_s: by the wall clock beside it (measured runs
# only, empty in a simulation). samples, tokens, tokens_sq: n, Σ S and Σ S² of the rank's
# micro-batch (what its cost depends on); frames, height, width: the bucket shape of its
# largest sample (the shape of all of them unless it is a pack)
STEP_COLUMNS = (
    "step", "rank", "compute_s", "compute_wall_s", "wait_s", "samples", "tokens", "tokens_sq",
    "frames", "height", "width", "peak_bytes", "peak_bytes_model", "loss", "step_time_s",
    "step_wall_s",
)  # fmt: skip


@dataclass
class Simulation:
    """`steps`: one row per (step, rank) in the shared per-step schema; `summary`: the run
    summary (metrics over steps >= warmup_steps, labelled source "model")."""

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
    cell = _cells(table, key, steps * n)
    compute = cost.pack_time(cell.samples, cell.tokens, cell.tokens_sq).reshape(steps, n)
    peak_model = np.where(cell.samples > 0, cost.pack_memory(cell.samples, cell.tokens), np.nan)
    t_step = compute.max(axis=1)
    ar_s = allreduce_seconds(grad_bytes, n, allreduce_gbps)
    step_time = t_step + ar_s
    empty = pd.array([pd.NA] * (steps * n), dtype="Float64")
    frame = pd.DataFrame(
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
            "peak_bytes": empty,
            "peak_bytes_model": peak_model,
            "loss": empty,
            "step_time_s": np.repeat(step_time, n),
            "step_wall_s": empty,
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
    summary.update(_metrics(compute, cell, step_time, peak_model, capacity_bytes, warmup_steps))
    summary.update(_lower_bound(table, cost, compute, steps, n, warmup_steps))
    return Simulation(steps=frame, summary=summary)


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
        cols = np.stack([table[c].to_numpy(np.int64) for c in ("frames", "height", "width")], 1)
        shape[key[first]] = cols[first]
    return _Cells(samples, sum_s, sum_sq.round().astype(np.int64), shape)


def _lower_bound(
    table: pd.DataFrame, cost: CostModel, compute: np.ndarray, steps: int, n: int,
    warmup_steps: int,
) -> dict[str, float]:  # fmt: skip
    """The window's summed step lower bound (``CostModel.step_lower_bound`` of each step's
    samples) and the plan's compute critical path over it."""
    step = table["step"].to_numpy(np.int64)
    work = cost.per_sample_time(table["tokens"].to_numpy(np.int64))
    work_sum = np.bincount(step, weights=work, minlength=steps)
    work_max = np.zeros(steps)
    if step.size:  # rows come step-major (sorted by cell)
        starts = np.flatnonzero(np.diff(step, prepend=-1))
        work_max[step[starts]] = np.maximum.reduceat(work, starts)
    bound = np.where(work_sum > 0, cost.step_lower_bound(work_sum, work_max, n), 0.0)
    keep = slice(min(warmup_steps, steps), steps)
    lower, path = float(bound[keep].sum()), float(compute[keep].max(axis=1, initial=0.0).sum())
    return {"lower_bound_s": lower, "vs_lower_bound": path / lower if lower > 0 else np.nan}


def _split(cost_model: CostModel | Calibration) -> tuple[CostModel, Calibration | None]:
    if isinstance(cost_model, Calibration):
        return cost_model.cost, cost_model
    return cost_model, None


def _metrics(
    compute: np.ndarray,
    cell: _Cells,
    step_time: np.ndarray,
    peak_model: np.ndarray,
    capacity_bytes: float | None,
    warmup_steps: int,
) -> dict[str, Any]:
    steps, n = compute.shape
    keep = slice(min(warmup_steps, steps), steps)
    window = compute[keep]
    if window.shape[0] == 0:
        return {"steps": 0}
    cells = slice(keep.start * n, steps * n)
    wall_s = float(step_time[keep].sum())
    peak = peak_model.reshape(steps, n)[keep]
    out: dict[str, Any] = metrics.window_metrics(
        window,
        samples=float(cell.samples[cells].sum()),
        tokens=float(cell.tokens[cells].sum()),
        seconds=wall_s,
        peak_bytes=np.where(np.isnan(peak), 0.0, peak),  # a rank without a batch: no memory
        capacity_bytes=capacity_bytes,
    )
    out["wall_s"] = wall_s
    return out
