"""Refitting a calibration from the micro-batches a run measured: the closed loop's model side.

`refine(calibration, rows)` takes the prior (a calibration file, fitted before the run) and
the run's per-step rows (`step_table.STEP_COLUMNS`: rank, compute_s, samples, tokens,
tokens_sq, sp_degree, peak_bytes) and returns a new `Calibration` whose coefficients, per-rank
speed factors and (where peak memory was measured) memory model follow the rows. The form is
the cost model's own (`cost.features`); docs/closed_loop.md derives the fit.

- **Model of a row.** Rank r's micro-batch i takes t_i = max(t_floor, x_i . theta) / v_r,
  x_i = features(n_i, ΣS_i, ΣS²_i), theta = (c0, c_seq, a, b), v_r the rank's speed factor
  (1 a typical rank, < 1 a slower one). At a sequence-parallel degree d the token columns are
  over d and the all-to-alls (`comm.SequenceParallel`) are taken off the measured time first.
- **Ridge to the prior.** theta minimises the relative squared error of the rows plus the
  prior counted as `prior_rows` rows of the same design (a g-prior):
  Σ_i w_i (x_i . theta / T_i - 1)² + (prior_rows / Σ_i w_i) Σ_i w_i (x_i . (theta - prior) / T_i)²
  + prior_rows HOLD_ROWS Σ_k c_k² (theta_k - prior_k)², with T_i = v_r t_i the row's time on
  a typical rank and c_k the root mean square of column k / T_i. Unconstrained, the first two give
  theta = prior + n / (n + prior_rows) (theta_rows - prior), n = Σ w_i and theta_rows the
  rows' own fit: a handful of rows move the prior little, thousands move it fully, in every
  direction the rows see. The third (one row's worth, HOLD_ROWS) holds what they barely see
  at the prior: the rows of a few steps dealt by cost hold a narrow range of S, which cannot
  tell the linear term from attention; without it, noise would set p. It is in the rows'
  units, not the coefficients' own: a coefficient the prior has far too small (p off by 0.3
  makes a or b several times smaller) moves as the rows say.
  Each coefficient stays >= n0 / (n0 + n) of the prior's (n0 = prior_rows, n = Σ w_i): the
  ridge's estimate is the prior's n0 rows and the rows' own n, and the rows' own estimate of
  a cost is >= 0, so the prior's part is a floor (non-negative least squares above it). A
  few rows then cannot zero a term: 4 rows of a 2-rank run, all of one shape, once priced
  every sample at 0 s (a = b = c_seq = 0), which no plan can pack by.
- **Robust.** Iteratively reweighted: Huber weights w_i = min(1, k σ / |r_i|) on the relative
  residuals r_i (σ = 1.4826 x their median absolute deviation, k = `huber`), and a row beyond
  `reject` σ is dropped (w_i = 0): a garbage-collection pause or a first step's compile is an
  outlier of one row, not a new cost.
- **Speed factors.** v_r = (Σ_i w_i q_i + speed_rows v0_r) / (Σ_i w_i + speed_rows) over rank
  r's rows, q_i = prediction / measured, v0 the prior's factors (1 where it has none); then
  divided by their median over the ranks with rows, so the median rank has speed 1 and theta
  prices it; ranks without rows keep the prior's factor (else they would pin the median, and
  the ranks of a few rows would absorb the prior's error). Each round takes the speeds
  before the outlier weights, and the weights from the residuals at the new speeds: on quiet
  rows (1% noise) a rank at 0.8x is 25 spreads out, and weighed at the old speeds its rows
  were all dropped as outliers and it kept speed 1.
- **Form.** A term the prior has at 0 stays 0 (c_seq of a floored fit, the floor of a
  three-term one): the refit moves the calibration's coefficients, it does not add terms its
  fit left out. On the rows of a few steps, each of one shape, c_seq n and a ΣS are nearly the
  same column, and a c_seq made up from them prices the short samples the window did not hold
  many times over.
- **Floor.** Rows the current fit puts below the prior's floor are floor rows: they leave the
  linear fit and move the floor as the coefficients move (ridge to the prior's floor). A
  prior with no floor (0) keeps none: a floor the prior lacks is not of its form.
- **Deterministic.** Rows are sorted canonically first, so the same rows in any order give
  bit-identical coefficients, on every rank.
- **Memory** (rows with `peak_bytes`, measured on CUDA): the same ridge fit of
  (m_static, m_tok, m_seq) on `memory_features`; budgets derived from the refit (`tokens`
  given) price memory with a margin, the p90 of the under-predictions, and M_mem never rises
  beyond the largest micro-batch whose peak was measured (nor below what the refit allows).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload.costmodel.budgets import capacity_for
from adaptiveload.costmodel.calibration import Calibration
from adaptiveload.costmodel.comm import SequenceParallel
from adaptiveload.costmodel.cost import (
    MEMORY_TERMS,
    TIME_TERMS,
    CostModel,
    combine,
    features,
    memory_features,
)
from adaptiveload.errors import UserError
from adaptiveload.step_table import SP_DEGREE

# how many rows the prior counts as, in every direction of the coefficients (module docstring)
PRIOR_ROWS = 8.0
# how many rows each rank's prior speed counts as: (sigma / tau)^2, a row's timing noise
# (sigma ~5%) over the spread of speeds a prior allows (tau ~10%): a rank has only a window's
# rows over N of them, and every step waits for the slowest, so its factor must move fast
SPEED_PRIOR_ROWS = 0.25
# the share of `prior_rows` each coefficient's own pull to the prior counts as (the third term)
HOLD_ROWS = 0.125
# Huber's constant in units of the residuals' robust spread (95% efficiency under normal noise)
HUBER_K = 1.345
# a row whose relative residual is this many spreads out is dropped
REJECT_SIGMAS = 6.0
# the fewest rows whose spread can call one of them an outlier
MIN_ROBUST_ROWS = 8
# reweighting rounds (fixed: the same rows give the same arithmetic)
IRLS_ROUNDS = 12
# the least relative spread the weights assume: noiseless rows do not make every last bit of
# rounding an outlier
MIN_SPREAD = 1e-3
# the columns a refit reads (the step table's names)
ROW_COLUMNS = ("rank", "compute_s", "samples", "tokens", "tokens_sq")
# the order rows are put in before anything is summed
CANONICAL_ORDER = (
    "step",
    "rank",
    "samples",
    "tokens",
    "tokens_sq",
    "compute_s",
    SP_DEGREE,
    "peak_bytes",
)


def refine(
    calibration: Calibration,
    rows: pd.DataFrame,
    *,
    world_size: int | None = None,
    tokens: Any | None = None,
    prior_rows: float = PRIOR_ROWS,
    speed_rows: float = SPEED_PRIOR_ROWS,
    huber: float = HUBER_K,
    reject: float = REJECT_SIGMAS,
) -> Calibration:
    """`calibration` refitted from measured micro-batch `rows` (module docstring).

    `rows`: one row per (step, rank) with the step table's columns ROW_COLUMNS (`step` and
    `sp_degree` and `peak_bytes` where present); rows of no time (<= 0 or missing) are left
    out. `world_size`: how many ranks the speed factors cover (default: the highest rank in
    the rows + 1; ranks without rows keep the prior's factor). `tokens`: the epoch's sample
    token counts; given (and the calibration has a capacity), p and the budgets are derived
    again from the refit (`Calibration.for_tokens`, memory with the residuals' margin).

    Call it with the same prior and all rows measured so far: the result does not depend on
    how the rows were windowed, and a resumed run that holds the rows refits identically.
    """
    table = _rows(rows, calibration)
    ranks = table["rank"].to_numpy(np.int64)
    size = int(ranks.max()) + 1 if world_size is None else int(world_size)
    if ranks.max() >= size:
        raise UserError(
            f"refit rows: field 'rank' has rank {int(ranks.max())} >= world_size {size}; "
            "pass the run's world size"
        )
    prior_speed = np.asarray(calibration.rank_speeds or (), dtype=np.float64)
    v0 = np.ones(size)
    v0[: min(size, prior_speed.size)] = prior_speed[:size]

    x, offset = _design(table, calibration)
    t = table["compute_s"].to_numpy(np.float64)
    prior = calibration.cost
    before = _relative_errors(_predict(prior, x, offset) / v0[ranks], t)

    theta, floor, speed, weights = _fit_time(
        x, offset, t, ranks, prior, v0, prior_rows, speed_rows, huber, reject
    )
    cost = replace(
        prior, **dict(zip(TIME_TERMS, (float(v) for v in theta), strict=True)), t_floor=floor
    )
    after = _relative_errors(_predict(cost, x, offset) / speed[ranks], t)
    refit: dict[str, Any] = {
        "prior": {k: getattr(prior, k) for k in (*TIME_TERMS, "t_floor")},
        "rows": int(t.size),
        "rows_down_weighted": int((weights < 1).sum()),
        "rows_rejected": int((weights == 0).sum()),
        "prior_rows": prior_rows,
        "speed_prior_rows": speed_rows,
        "rel_err_before": _quantiles(before),
        "rel_err_after": _quantiles(after),
        "speed_normalisation": "median rank = 1",
    }
    cost, memory = _fit_memory(table, cost, prior_rows, huber, reject)
    if memory:
        refit["memory"] = memory
    extra = {**calibration.extra, "rank_speeds": [float(v) for v in speed], "refit": refit}
    out = replace(calibration, cost=cost, extra=extra)
    return out if tokens is None else _budgets(out, calibration, tokens, memory)


# --- the rows ---------------------------------------------------------------------------------


def _rows(rows: pd.DataFrame, calibration: Calibration) -> pd.DataFrame:
    """The rows a refit uses, in canonical order: followers of a sequence-parallel group
    (no samples of their own) carry their group's samples; rows without time are dropped."""
    missing = [c for c in ROW_COLUMNS if c not in rows.columns]
    if missing:
        raise UserError(
            f"refit rows: field(s) {', '.join(missing)} missing; pass the step table's rows "
            f"({', '.join(ROW_COLUMNS)})"
        )
    table = rows.copy()
    if SP_DEGREE not in table.columns:
        table[SP_DEGREE] = 1
    if "step" not in table.columns:
        table["step"] = 0
    table[SP_DEGREE] = table[SP_DEGREE].fillna(1).astype(np.int64)
    table = _fill_followers(table)
    t = pd.to_numeric(table["compute_s"], errors="coerce")
    keep = np.isfinite(t.to_numpy(np.float64)) & (t.to_numpy(np.float64) > 0)
    table = table[keep & (table["samples"].to_numpy() > 0)]
    if table.empty:
        raise UserError(
            f"refit of {calibration.model}: no rows with samples and a positive compute_s; "
            "refit after at least one measured step"
        )
    order = [c for c in CANONICAL_ORDER if c in table.columns]
    return table.sort_values(order, kind="mergesort").reset_index(drop=True)


def _fill_followers(table: pd.DataFrame) -> pd.DataFrame:
    """A group of d > 1 ranks reports its samples on its first rank's row (`step_table`); its
    other ranks ran the same set, so their rows take its samples and tokens."""
    follower = (table[SP_DEGREE] > 1) & (table["samples"] == 0)
    if not follower.any():
        return table
    lead_rank = table["rank"] - table["rank"] % table[SP_DEGREE]
    key = ["step", "rank"]
    leads = table.loc[~follower, [*key, "samples", "tokens", "tokens_sq"]]
    want = pd.DataFrame({"step": table["step"], "rank": lead_rank})[follower]
    got = want.merge(leads, on=key, how="left").set_index(want.index)
    table = table.copy()
    for column in ("samples", "tokens", "tokens_sq"):
        table.loc[follower, column] = got[column].fillna(0).to_numpy()
    return table


def _design(table: pd.DataFrame, calibration: Calibration) -> tuple[np.ndarray, np.ndarray]:
    """(x, offset): each row's `features` at its degree (token columns over d) and the
    seconds of its all-to-alls (0 at d = 1), which are not refitted."""
    d = table[SP_DEGREE].to_numpy(np.float64)
    n, s, q = (table[c].to_numpy(np.float64) for c in ("samples", "tokens", "tokens_sq"))
    x = features(n, s / d, q / d)
    offset = np.zeros(d.size)
    if (d > 1).any():
        sp = SequenceParallel.of(calibration)
        zero = CostModel(c0=0.0, a=0.0, b=0.0)
        for degree in np.unique(d[d > 1]):
            at = sp.cost_at(zero, int(degree))
            rows = d == degree
            offset[rows] = at.c0 + at.a * s[rows]
    return x, offset


def _predict(cost: CostModel, x: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """A typical rank's seconds for the rows: the floor over work and communication."""
    return np.maximum(cost.t_floor, combine(x.T, cost.time_coefficients) + offset)


# --- the fits ---------------------------------------------------------------------------------


def _fit_time(
    x: np.ndarray,
    offset: np.ndarray,
    t: np.ndarray,
    ranks: np.ndarray,
    prior: CostModel,
    v0: np.ndarray,
    prior_rows: float,
    speed_rows: float,
    huber: float,
    reject: float,
) -> tuple[np.ndarray, float, np.ndarray, np.ndarray]:
    """(theta, floor, speed per rank, row weights): alternating reweighted ridge fits of the
    coefficients and the speed factors (module docstring)."""
    theta0 = prior.time_coefficients
    theta, floor, speed = theta0.copy(), prior.t_floor, v0.copy()
    form = theta0 > 0
    weights = np.ones(t.size)
    for _ in range(IRLS_ROUNDS):
        typical = t * speed[ranks]  # each row's time on a typical rank
        work = combine(x.T, theta) + offset
        on_floor = (work < floor) if floor > 0 else np.zeros(t.size, dtype=bool)
        fit = ~on_floor & (weights > 0)
        if fit.any():  # the prior's form: a term it has at 0 stays 0
            theta = np.zeros_like(theta0)
            theta[form] = _ridge(
                x[fit][:, form],
                typical[fit] - offset[fit],
                typical[fit],
                weights[fit],
                theta0[form],
                prior_rows,
            )
        if floor > 0:
            w = weights * on_floor
            floor = float((w @ typical + prior_rows * prior.t_floor) / (w.sum() + prior_rows))
        predicted = np.maximum(floor, combine(x.T, theta) + offset)
        ratio = predicted / t  # the rank's speed this row shows
        # speeds before weights: a slow rank's rows are its speed, not outliers
        speed = _speeds(ratio, ranks, weights, v0, speed_rows)
        weights = _robust_weights(predicted / (t * speed[ranks]) - 1.0, huber, reject)
    return theta, floor, speed, weights


def _speeds(
    ratio: np.ndarray,
    ranks: np.ndarray,
    weights: np.ndarray,
    v0: np.ndarray,
    speed_rows: float,
) -> np.ndarray:
    """Each rank's speed factor from what its rows show (`ratio`, prediction / measured),
    pulled to the prior's `v0` by `speed_rows` rows, over the median rank's (module docstring,
    Speed factors); ranks without rows keep v0."""
    sums = np.bincount(ranks, weights * ratio, minlength=v0.size)
    counts = np.bincount(ranks, weights, minlength=v0.size)
    speed = (sums + speed_rows * v0) / (counts + speed_rows)
    seen = counts > 0
    if not seen.any():
        return v0.copy()
    return np.where(seen, speed / np.median(speed[seen]), v0)


def _ridge(
    x: np.ndarray,
    target: np.ndarray,
    scale: np.ndarray,
    weights: np.ndarray,
    prior: np.ndarray,
    prior_rows: float,
) -> np.ndarray:
    """Non-negative coefficients minimising Σ w_i ((x_i . c - target_i) / scale_i)² plus the
    prior's pseudo-rows (module docstring): `prior_rows` / Σ w_i times the same rows'
    squared change of prediction from the prior's, and `prior_rows` x HOLD_ROWS rows for each
    coefficient (columns scaled to unit root mean square), each coefficient at least
    prior_rows / (prior_rows + Σ w_i) of the prior's (module docstring, Form).
    Non-negative least squares on the rows stacked over the prior's."""
    from scipy.optimize import nnls

    relative = x / scale[:, None]
    c = np.sqrt(np.mean(relative * relative, axis=0))
    c[c == 0] = 1.0
    rows = relative / c * np.sqrt(weights)[:, None]
    z0 = prior * c
    again = np.sqrt(prior_rows / weights.sum())
    hold = np.sqrt(prior_rows * HOLD_ROWS) * np.eye(c.size)
    a = np.vstack([rows, again * rows, hold])
    b = np.concatenate([target / scale * np.sqrt(weights), again * (rows @ z0), hold @ z0])
    # no lower than the prior's share of the estimate (its rows over all): z = low + u, u >= 0
    low = z0 * prior_rows / (prior_rows + weights.sum())
    u, _ = nnls(a, b - a @ low, maxiter=50 * c.size)
    return (low + u) / c


def _robust_weights(residual: np.ndarray, huber: float, reject: float) -> np.ndarray:
    """Huber weights of relative residuals, 0 beyond `reject` spreads (module docstring); all
    1 under MIN_ROBUST_ROWS rows, whose spread says nothing."""
    if residual.size < MIN_ROBUST_ROWS:
        return np.ones(residual.size)
    spread = max(MIN_SPREAD, 1.4826 * float(np.median(np.abs(residual - np.median(residual)))))
    size = np.abs(residual - np.median(residual)) / spread  # a shared bias is no outlier
    weights = np.minimum(1.0, huber / np.maximum(size, 1e-300))
    return np.where(size > reject, 0.0, weights)


def _fit_memory(
    table: pd.DataFrame,
    cost: CostModel,
    prior_rows: float,
    huber: float,
    reject: float,
) -> tuple[CostModel, dict[str, Any]]:
    """`cost` with its memory coefficients refitted from the rows' measured `peak_bytes`
    (none: unchanged, and an empty record)."""
    if "peak_bytes" not in table.columns:
        return cost, {}
    peak = pd.to_numeric(table["peak_bytes"], errors="coerce").to_numpy(np.float64)
    rows = np.isfinite(peak) & (peak > 0)
    if not rows.any():
        return cost, {}
    d = table[SP_DEGREE].to_numpy(np.float64)[rows]
    x = memory_features(
        table["samples"].to_numpy(np.float64)[rows], table["tokens"].to_numpy(np.float64)[rows] / d
    )
    m = peak[rows]
    prior = cost.memory_coefficients
    before = combine(x.T, prior) / m - 1.0
    weights = np.ones(m.size)
    coef = prior
    for _ in range(IRLS_ROUNDS):
        coef = _ridge(x, m, m, weights, prior, prior_rows)
        weights = _robust_weights(combine(x.T, coef) / m - 1.0, huber, reject)
    residual = combine(x.T, coef) / m - 1.0
    under = -residual[weights > 0]  # measured above predicted
    margin = float(max(0.0, np.quantile(under, 0.9))) if under.size else 0.0
    fitted = replace(cost, **dict(zip(MEMORY_TERMS, (float(v) for v in coef), strict=True)))
    tokens = table["tokens"].to_numpy(np.float64)[rows] / d
    return fitted, {
        "rows": int(m.size),
        "rows_rejected": int((weights == 0).sum()),
        "rel_err_before": _quantiles(np.abs(before)),
        "rel_err_after": _quantiles(np.abs(residual)),
        "margin": margin,
        "max_measured_tokens": float(tokens.max()),
    }


def _budgets(
    refitted: Calibration, prior: Calibration, tokens: Any, memory: dict[str, Any]
) -> Calibration:
    """p and the budgets derived again from the refit for the epoch's `tokens`; with a memory
    refit, memory priced with its margin (x (1 + margin)) and M_mem no higher than the
    prior's or the largest measured micro-batch's tokens, whichever is more (as if the device
    had only the capacity that gives that M_mem: `capacity_for`)."""
    if not refitted.capacity_bytes:
        return refitted
    if not memory:
        return refitted.for_tokens(tokens)
    grow = 1.0 + memory["margin"]
    cautious = replace(refitted.cost, **{k: getattr(refitted.cost, k) * grow for k in MEMORY_TERMS})
    s_min = float(np.min(np.asarray(tokens, dtype=np.float64)))
    ceiling = max(prior.m_mem, memory["max_measured_tokens"])
    capacity = min(
        float(refitted.capacity_bytes), capacity_for(cautious, ceiling, refitted.headroom, s_min)
    )
    out = replace(refitted, cost=cautious).for_tokens(tokens, capacity_bytes=capacity)
    return replace(out, cost=refitted.cost, capacity_bytes=refitted.capacity_bytes)


def _relative_errors(predicted: np.ndarray, measured: np.ndarray) -> np.ndarray:
    return np.abs(predicted - measured) / measured


def _quantiles(errors: np.ndarray) -> dict[str, float]:
    """The median and p90 of |predicted - measured| / measured."""
    return {"median": float(np.median(errors)), "p90": float(np.quantile(errors, 0.9))}
