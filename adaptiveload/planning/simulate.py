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
counts each real sample once: the padding repeats of the last step cost time (they are in
``compute_s``) but are no data trained on, so they are reported beside it
(``padding_samples``, ``padding_fraction``) and never as samples/s. ``epoch_steps`` and
the per-step spread of real samples and tokens (``samples_per_step_*``, ``tokens_per_step_*``)
say how large a global batch the plan trains with.

Memory inside what was measured: ``max_micro_batch_tokens`` and
``max_micro_batch_bytes_model`` are the plan's largest micro-batch by the tokens one rank
holds (Σ S; ⌈Σ S / d⌉ on a sequence-parallel group of d ranks, whose Σ S is
``max_micro_batch_group_tokens``) and its predicted per-rank peak bytes; with a Calibration
whose memory was measured, ``memory_measured_tokens`` is the largest micro-batch it measured
(``Calibration.measured_memory_tokens``, on one device) and
``micro_batches_beyond_measured_memory`` counts the plan's micro-batches that put more tokens
on a rank than that, whose memory
rests on the fit's extrapolation alone (None: nothing was measured to compare with).

``vs_lower_bound`` is the window's summed ``max_r compute_s`` over the sum of each step's
``CostModel.step_lower_bound`` (its samples' per-sample costs, however they were packed):
1.0 means no plan of the same steps could do better.

Sequence-parallel groups (a plan with column ``sp_degree``, ``groups``): a group's cell, on
its first rank, costs the set at its degree (`SequenceParallel.cost_at`: per-rank compute
and all-to-alls) and every rank of the group is busy that long with that per-rank memory;
its samples count once, on the first rank. The per-step table then has a column
``sp_degree`` too (each rank's group degree). Both lower bounds count what samples may take
at the degrees the plan's policy allows (`GroupBound`: a sample at degree d occupies d ranks
for its time at d), so they stay bounds of any plan of those samples.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.costmodel import (
    Calibration,
    CostModel,
    GroupBound,
    SequenceParallel,
    group_bound,
)
from adaptiveload.experiment import schema_default
from adaptiveload.planning.batches import table_degrees
from adaptiveload.planning.packing import PackLimits, epoch_limits
from adaptiveload.step_table import (
    SP_DEGREE,
    STEP_COLUMNS,
    VAL_COLUMNS,
    WHOLE_EPOCH,
)

DEFAULT_ALLREDUCE_GBPS = schema_default("train.allreduce_gbps")  # an experiment's default
FP32_BYTES = 4
# the steps `_predict` takes at a time (at 4,096 ranks, 1M cells: each array of a block 8 MB)
STEP_BLOCK = 256
# the summary fields of the plan's largest micro-batch against what its calibration measured
MEMORY_FIELDS = (
    "max_micro_batch_tokens",
    "max_micro_batch_group_tokens",
    "max_micro_batch_bytes_model",
    "memory_measured_tokens",
    "micro_batches_beyond_measured_memory",
)


@dataclass
class Simulation:
    """`summary`: the run summary (metrics over every step of the plan, labelled source
    "model"); `steps`: one row per (step, rank) in the shared per-step schema (`step_table`),
    built from the plan table when first read (`build_steps`) and then kept. The summary
    needs a few per-cell arrays only, and the whole frame is large (at 10M samples on 4,096
    ranks, 15M rows of 16 columns: 1.8 GiB) where a plan's steps are often never written.
    A prediction has no warm-up (nothing compiles, no cache is cold): its window is the
    whole epoch, so every policy's window holds the same samples."""

    summary: dict[str, Any]
    capacity_bytes: float | None
    build_steps: Callable[[], pd.DataFrame] = field(repr=False)

    @cached_property
    def steps(self) -> pd.DataFrame:
        return self.build_steps()


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
) -> Simulation:
    """Predicted per-(step, rank) times of `plan_table` and their summary metrics.

    With a Calibration, `grad_bytes` and `capacity_bytes` default to what it carries.
    `world_size` defaults to the plan's (its attrs, else 1 + the largest rank).
    """
    calibration = _split(cost_model)[1]
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
        # the analysis's window fields: no warm-up, one whole epoch (`Simulation`)
        "warmup_steps": 0,
        "timed_window": WHOLE_EPOCH,
        "allreduce_gbps": allreduce_gbps,
        "grad_bytes": grad_bytes,
        "allreduce_s": ar_s,
    }
    bound = _Bound.of(plan_table, cost_model)
    table, key, steps = _by_cell(plan_table, n)
    predicted = _predict(table, key, steps, cost_model, n, bound)
    summary.update(_epoch_bound(plan_table, predicted, cost_model, n, ar_s, bound))
    planned_steps = plan_table.attrs.get("plan", {}).get("steps")
    summary["epoch_steps"] = int(planned_steps or steps)
    summary.update(_memory(predicted, calibration))
    summary.update(_metrics(predicted, ar_s, capacity_bytes))
    return Simulation(
        summary, capacity_bytes, partial(_step_table, plan_table, cost_model, n, ar_s, bound)
    )


@dataclass(frozen=True)
class _Bound:
    """What the lower bounds of a plan are taken under: the limits of its budgets (None
    without them) and, where its policy allows sequence-parallel groups (its summary's
    ``sp_max_degree``), their terms (`GroupBound`; None: one rank per micro-batch)."""

    limits: PackLimits | None
    groups: GroupBound | None

    @classmethod
    def of(cls, table: pd.DataFrame, cost_model: CostModel | Calibration) -> _Bound:
        plan = table.attrs.get("plan", {})
        limits = epoch_limits(plan, cost_model)
        groups = group_bound(cost_model, int(plan.get("sp_max_degree") or 1))
        return cls(limits, groups if limits is not None else None)

    def work(self, cost: CostModel, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per sample of `tokens`: (the rank-seconds it takes at least, its least time)."""
        if self.groups is None:
            w = cost.per_sample_time(tokens)
            return w, w
        inverse, values = pd.factorize(tokens, sort=True)  # np.unique's, by hashing: O(n)
        work, least, _, _ = self.groups.sample_terms(cost, values, self.limits)
        return work[inverse], least[inverse]


def epoch_seconds(
    step: np.ndarray, steps: int, size: np.ndarray, sum_s: np.ndarray, sum_sq: np.ndarray,
    degree: np.ndarray, cost_model: CostModel | Calibration, n: int,
    allreduce_gbps: float = DEFAULT_ALLREDUCE_GBPS,
) -> float:
    """The predicted epoch seconds `simulate` gives a plan of `steps` steps whose micro-batches
    (one per single rank or group, on its first rank, in step order: `step` each) hold `size`
    samples of Σ S `sum_s` and Σ S² `sum_sq` on groups of `degree`, without building its
    tables: a figure of a plan that is not kept (a policy's baseline, ``plan._baseline``). A
    step waits for its slowest micro-batch, as `simulate`'s per-(step, rank) frame has it (a
    group's other ranks copy its time, an empty rank takes none), from the same costs."""
    calibration = _split(cost_model)[1]
    grad_bytes = grad_bytes_of(calibration) if calibration is not None else 0.0
    ar_s = allreduce_seconds(grad_bytes, n, allreduce_gbps)
    compute = np.zeros(size.size)
    for at, cells in _at_degrees(cost_model, degree, size):
        compute[cells] = at.pack_time(size[cells], sum_s[cells], sum_sq[cells])
    t_step = np.zeros(steps)
    if step.size:
        first = np.flatnonzero(np.diff(step, prepend=-1))  # each step's first micro-batch
        t_step[step[first]] = np.maximum.reduceat(compute, first)
    return float((t_step + ar_s).sum())


def _at_degrees(
    cost_model: CostModel | Calibration, degree: np.ndarray, samples: np.ndarray
) -> list[tuple[CostModel, np.ndarray]]:
    """Each degree's cost of a set (`SequenceParallel.cost_at`) and which cells run at it
    (`degree`, 1 but on a group's first rank; cells of no `samples` left out)."""
    cost, calibration = _split(cost_model)
    out = []
    for d in np.unique(degree):
        if d > 1 and calibration is None:
            raise ValueError("a plan of sequence-parallel groups needs a Calibration to cost")
        at = cost if d == 1 else SequenceParallel.of(calibration).cost_at(cost, int(d))
        out.append((at, (degree == d) & (samples > 0)))
    return out


def _cell_costs(
    cost_model: CostModel | Calibration, cell: _Cells, degree: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Each cell's predicted compute and per-rank bytes: at its group's degree (`degree`, of
    the cell on the group's first rank; 1 elsewhere), copied to the group's other ranks."""
    compute = np.zeros(degree.size)
    memory = np.full(degree.size, np.nan)
    for at, cells in _at_degrees(cost_model, degree, cell.samples):
        compute[cells] = at.pack_time(cell.samples[cells], cell.tokens[cells],
                                      cell.tokens_sq[cells])
        memory[cells] = at.pack_memory(cell.samples[cells], cell.tokens[cells])
    first = np.flatnonzero(degree > 1)
    for j in range(1, int(degree.max(initial=1))):
        lead = first[degree[first] > j]
        compute[lead + j], memory[lead + j] = compute[lead], memory[lead]
    return compute, memory


def _by_cell(table: pd.DataFrame, n: int) -> tuple[pd.DataFrame, np.ndarray, int]:
    """`table`'s rows ordered by cell (as a plan writes them: a copy only where they are
    not), each row's cell ``step * N + rank`` and the step count."""
    step = table["step"].to_numpy(np.int64)
    rank = table["rank"].to_numpy(np.int64)
    if rank.size and rank.max() >= n:
        raise ValueError(f"plan has rank {rank.max()} but world_size is {n}")
    steps = int(step.max()) + 1 if step.size else 0
    key = step * n + rank
    if key.size and np.any(np.diff(key) < 0):
        order = np.argsort(key, kind="stable")
        key, table = key[order], table.iloc[order]
    return table, key, steps


@dataclass(frozen=True)
class _Predicted:
    """A plan's predictions per (step, rank) cell, step-major: the tokens of its micro-batch
    (Σ S), the degree of the group it leads (1 on a single rank and on a group's other
    ranks), its compute seconds [steps, N] and per-rank bytes (a group's on each of its
    ranks); per step, its slowest rank `t_step`, its lower bound and what it trained
    (`metrics.StepCounts`: real samples and tokens, padding repeats)."""

    tokens: np.ndarray
    degree: np.ndarray
    compute: np.ndarray
    memory: np.ndarray
    t_step: np.ndarray
    lower_bound: np.ndarray
    counts: metrics.StepCounts


def _predict(
    table: pd.DataFrame, key: np.ndarray, steps: int, cost_model: CostModel | Calibration,
    n: int, bound: _Bound,
) -> _Predicted:
    """Each rank's micro-batch (n, Σ S, Σ S² of its rows; `table` ordered by cell, `key`
    each row's) through the cost model (a group's at its degree, on each of its ranks), every
    step waiting for its slowest rank, beside the step's lower bound. Made STEP_BLOCK steps
    at a time (a group never spans two steps), of each block's cells kept only what the
    summary reads: at 10M samples on 4,096 ranks every per-cell array holds 121 MB."""
    lower_bound = _step_bounds(table, _split(cost_model)[0], steps, n, bound)
    tokens = np.zeros(steps * n, dtype=np.int64)
    degree = np.ones(steps * n, dtype=np.int64)
    compute = np.zeros(steps * n)
    memory = np.full(steps * n, np.nan)
    real_samples, real_tokens, padding = np.zeros(steps), np.zeros(steps), np.zeros(steps)

    def per_step(values: np.ndarray) -> np.ndarray:
        return values.astype(np.float64).reshape(-1, n).sum(axis=1)

    for first in range(0, steps, STEP_BLOCK):
        last = min(first + STEP_BLOCK, steps)
        at = slice(first * n, last * n)
        rows = slice(*np.searchsorted(key, [first * n, last * n]))
        block = table.iloc[rows]
        cell = _cells(block, key[rows] - first * n, (last - first) * n)
        degree[key[rows]] = table_degrees(block)
        compute[at], memory[at] = _cell_costs(cost_model, cell, degree[at], n)
        tokens[at] = cell.tokens
        real_samples[first:last] = per_step(cell.samples - cell.padding_samples)
        real_tokens[first:last] = per_step(cell.tokens - cell.padding_tokens)
        padding[first:last] = per_step(cell.padding_samples)
    compute = compute.reshape(steps, n)
    counts = metrics.StepCounts(real_samples, real_tokens, padding)
    return _Predicted(tokens, degree, compute, memory, compute.max(axis=1), lower_bound, counts)


def _step_table(
    table: pd.DataFrame, cost_model: CostModel | Calibration, n: int, allreduce_s: float,
    bound: _Bound,
) -> pd.DataFrame:
    """The per-(step, rank) frame (`step_table.STEP_COLUMNS`): the predictions (`_predict`),
    each cell's largest bucket shape, and a group's degree on each of its ranks."""
    table, key, steps = _by_cell(table, n)
    predicted = _predict(table, key, steps, cost_model, n, bound)
    compute, t_step = predicted.compute, predicted.t_step
    cell = _cells(table, key, steps * n)
    shape = _shapes(table, key, cell.samples)

    # what only a measurement has: missing, each such column an all-NA view of one value
    # (read-only: writing into a prediction raises; a frame of 15M cells would otherwise hold
    # 1.6 GB of NA)
    def empty() -> pd.arrays.FloatingArray:
        cells = steps * n
        return pd.arrays.FloatingArray(np.broadcast_to(np.nan, cells), np.broadcast_to(True, cells))

    frame = pd.DataFrame(
        {
            "step": np.repeat(np.arange(steps), n),
            "rank": np.tile(np.arange(n), steps),
            "compute_s": compute.ravel(),
            "compute_wall_s": empty(),
            "wait_s": (t_step[:, None] - compute).ravel(),
            "samples": cell.samples,
            "tokens": cell.tokens,
            "tokens_sq": cell.tokens_sq,
            "frames": shape[:, 0],
            "height": shape[:, 1],
            "width": shape[:, 2],
            "peak_bytes": empty(),
            "peak_bytes_model": predicted.memory,
            "loss": empty(),
            "step_time_s": np.repeat(t_step + allreduce_s, n),
            "step_wall_s": empty(),
            "lower_bound_s": np.repeat(predicted.lower_bound, n),
            "padding_samples": cell.padding_samples,
            "padding_tokens": cell.padding_tokens,
            # learning: a measured run's columns, empty in a simulation
            **{col: empty() for col in ("samples_seen", "host_load_1m", *VAL_COLUMNS)},
        },
        columns=list(STEP_COLUMNS),
        copy=False,  # every column is a fresh array: copying and stacking them cost seconds
    )
    if SP_DEGREE in table.columns:  # each rank's group degree (a rank of a group: the group's)
        degree = predicted.degree
        lead = np.flatnonzero(degree > 1)
        spread = degree.copy()
        for j in range(1, int(degree.max(initial=1))):
            at = lead[degree[lead] > j]
            spread[at + j] = degree[at]
        frame[SP_DEGREE] = spread
    return frame


@dataclass(frozen=True)
class _Cells:
    """Per (step, rank) cell, step-major: its samples n, Σ S, Σ S², and how many of its
    samples (tokens) are padding repeats."""

    samples: np.ndarray
    tokens: np.ndarray
    tokens_sq: np.ndarray
    padding_samples: np.ndarray
    padding_tokens: np.ndarray


def _cells(table: pd.DataFrame, key: np.ndarray, cells: int) -> _Cells:
    """The cells of a plan table sorted by `key` (step * N + rank)."""
    tok = table["tokens"].to_numpy(np.int64)
    samples = np.bincount(key, minlength=cells)
    sum_s = np.bincount(key, weights=tok, minlength=cells).astype(np.int64)
    pad = table["is_padding"].to_numpy(bool)
    pad_samples = np.bincount(key[pad], minlength=cells)
    pad_tokens = np.bincount(key[pad], weights=tok[pad], minlength=cells).astype(np.int64)
    sum_sq = np.bincount(key, weights=tok.astype(np.float64) ** 2, minlength=cells)
    return _Cells(samples, sum_s, sum_sq.round().astype(np.int64), pad_samples, pad_tokens)


def _shapes(table: pd.DataFrame, key: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Each cell's largest sample's bucket shape [cells, 3] (zeros for an empty cell), of a
    plan table sorted by `key` (step * N + rank); `samples`: each cell's row count."""
    tok = table["tokens"].to_numpy(np.int64)
    shape = np.zeros((samples.size, 3), dtype=np.int64)
    if tok.size:
        starts = np.flatnonzero(np.diff(key, prepend=-1))  # each non-empty cell's first row
        largest = np.repeat(np.maximum.reduceat(tok, starts), samples[key[starts]])
        at = np.flatnonzero(tok == largest)
        first = at[np.diff(key[at], prepend=-1) != 0]  # the first row of each cell's largest
        for i, col in enumerate(("frames", "height", "width")):
            shape[key[first], i] = table[col].to_numpy(np.int64)[first]
    return shape


def _step_bounds(
    table: pd.DataFrame, cost: CostModel, steps: int, n: int, bound: _Bound
) -> np.ndarray:
    """Each step's ``CostModel.step_lower_bound`` over its samples (rows sorted by cell, so
    step-major); 0 for a step without samples. With groups allowed, a sample's work is the
    rank-seconds it takes at least and its share of the slowest rank its least time
    (`_Bound.work`)."""
    step = table["step"].to_numpy(np.int64)
    work, least = bound.work(cost, table["tokens"].to_numpy(np.int64))
    work_sum = np.bincount(step, weights=work, minlength=steps)
    work_max = np.zeros(steps)
    if step.size:
        starts = np.flatnonzero(np.diff(step, prepend=-1))
        work_max[step[starts]] = np.maximum.reduceat(least, starts)
    return np.where(work_sum > 0, cost.step_lower_bound(work_sum, work_max, n), 0.0)


def _epoch_bound(
    table: pd.DataFrame,
    predicted: _Predicted,
    cost_model: CostModel | Calibration,
    n: int,
    allreduce_s: float,
    bound: _Bound,
) -> dict[str, Any]:
    """The whole epoch against `CostModel.epoch_lower_bound` of its real samples under the
    limits of the plan's budgets (its summary in ``table.attrs["plan"]``; with the groups
    its policy allows, `_Bound`); nothing for a table without them. The epoch is every
    step, whatever the timed window."""
    limits = bound.limits
    if limits is None or table.empty:
        return {}
    real = ~table["is_padding"].to_numpy(bool) if "is_padding" in table else slice(None)
    tokens, count = np.unique(table["tokens"].to_numpy(np.int64)[real], return_counts=True)
    least = _split(cost_model)[0].epoch_lower_bound(
        tokens, count, limits, n, allreduce_s, bound.groups
    )
    epoch_s = float((predicted.t_step + allreduce_s).sum())
    return {
        "min_steps_per_epoch": least.steps,
        "epoch_lower_bound_s": least.seconds,
        "epoch_s": epoch_s,
        "vs_epoch_lower_bound": epoch_s / least.seconds if least.seconds > 0 else None,
    }


def _memory(predicted: _Predicted, calibration: Calibration | None) -> dict[str, Any]:
    """The MEMORY_FIELDS of a plan's predictions: its largest micro-batch by the tokens one
    rank holds (Σ S, over d on a sequence-parallel group of d ranks, each of which holds a
    d-th of every sample: ⌈Σ S / d⌉), that one's Σ S over its group and predicted per-rank
    bytes, and, where `calibration` measured memory (on one device), how many of the
    micro-batches put more tokens on a rank than the largest one measured."""
    group_tokens = predicted.tokens
    tokens = -(-group_tokens // predicted.degree)  # a group's other ranks hold 0: it counts once
    largest = int(np.argmax(tokens))
    measured = calibration.measured_memory_tokens if calibration is not None else None
    bytes_model = float(predicted.memory[largest])
    return {
        "max_micro_batch_tokens": int(tokens[largest]),
        "max_micro_batch_group_tokens": int(group_tokens[largest]),
        "max_micro_batch_bytes_model": bytes_model if np.isfinite(bytes_model) else None,
        "memory_measured_tokens": measured,
        "micro_batches_beyond_measured_memory": (
            int((tokens > measured).sum()) if measured is not None else None
        ),
    }


def _split(cost_model: CostModel | Calibration) -> tuple[CostModel, Calibration | None]:
    if isinstance(cost_model, Calibration):
        return cost_model.cost, cost_model
    return cost_model, None


def _metrics(
    predicted: _Predicted, allreduce_s: float, capacity_bytes: float | None
) -> dict[str, Any]:
    """The run-summary metrics of the predictions over all the plan's steps, with the steps'
    lower bound and the plan's distance from it."""
    compute = predicted.compute
    steps, n = compute.shape
    if steps == 0:
        return {"steps": 0}
    wall_s = float((predicted.t_step + allreduce_s).sum())
    peak = predicted.memory.reshape(steps, n)
    out: dict[str, Any] = metrics.window_metrics(
        compute,
        predicted.counts,
        seconds=wall_s,
        peak_bytes=np.where(np.isnan(peak), 0.0, peak),  # a rank without a batch: no memory
        capacity_bytes=capacity_bytes,
    )
    out["wall_s"] = wall_s
    lower = float(predicted.lower_bound.sum())
    out["lower_bound_s"] = lower
    out["vs_lower_bound"] = float(predicted.t_step.sum()) / lower if lower > 0 else None
    return out
