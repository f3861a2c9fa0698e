"""The closed loop in the model: a planner whose cost model is wrong, on a true device that
is not of its making, with and without refitting from what it measures (docs/closed_loop.md).

A `TrueDevice` is the ground truth: a cost model (a calibration's), per-rank speed factors
(rank r runs a micro-batch in its cost / speed_r) and multiplicative timing noise. The planner
starts from a prior, the truth perturbed (`perturbed`: the effective exponent p shifted and c0
scaled). Three planners run one epoch of the same samples each:

- **open loop**: the prior's plan for the whole epoch, never corrected;
- **closed loop**: the prior's plan for the first window of steps; at each window's end the
  rows measured so far (the true device's times of its micro-batches) refit the prior
  (`costmodel.refit.refine`, the same call as the trainer's), and the samples not yet run are
  planned again from the refit (coefficients, p and budgets, rank speeds);
- **oracle**: planned from the truth itself (its coefficients and speeds).

The epoch's time is Σ over steps of the slowest rank's true time (no all-reduce: the same for
all three). The closed loop's target compares the samples after its first window: its time
for them against the oracle's plan of exactly those samples (`after_first_window`). Every
number is a prediction of the model (`source: "model"`).

The data's size is per rank (`samples_per_rank`, `sample_count`): at paper scale the data
grows with the cluster, so every N runs epochs of comparable steps and its windows hold
comparable rows per rank. A fixed `num_samples` at every N is the other case, kept for what
it shows: at N = 1,024 an epoch of 20,000 samples is a few steps and a window one to three.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload.costmodel import Calibration, CostModel, features
from adaptiveload.costmodel.refit import refine
from adaptiveload.errors import UserError
from adaptiveload.planning.budgets import Budgets
from adaptiveload.planning.plan import build_plan


@dataclass(frozen=True)
class TrueDevice:
    """What the device really does: `cost`, per-rank `speeds`, relative timing `noise`."""

    cost: CostModel
    speeds: np.ndarray
    noise: float

    def times(self, table: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
        """One row per (step, rank) micro-batch of a plan table, timed on this device: the
        step table's columns (step, rank, compute_s, samples, tokens, tokens_sq)."""
        tok = table["tokens"].to_numpy(np.float64)
        cells = (
            table.assign(tokens_sq=tok * tok, samples=1)
            .groupby(["step", "rank"], sort=True)[["samples", "tokens", "tokens_sq"]]
            .sum()
            .reset_index()
        )
        x = features(cells["samples"], cells["tokens"], cells["tokens_sq"])
        seconds = self.cost.pack_time(x[:, 1], x[:, 2], x[:, 3])
        seconds = seconds / self.speeds[cells["rank"].to_numpy()]
        seconds = seconds * np.maximum(0.05, 1 + self.noise * rng.standard_normal(seconds.size))
        return cells.assign(compute_s=seconds)


def perturbed(cost: CostModel, tokens: Any, p_shift: float, c0_scale: float) -> CostModel:
    """`cost` with its effective exponent over the tokens' 5th-95th percentile shifted by
    `p_shift` (a and b rescaled, the per-sample time at their geometric mean kept) and c0
    times `c0_scale`: a prior of the same form that is wrong the way a stale calibration is.
    Where the shift needs a negative a or b, that term is 0 and the shift is what remains."""
    s_lo, s_hi = (float(v) for v in np.percentile(np.asarray(tokens, dtype=np.float64), [5, 95]))
    s_mid = float(np.sqrt(s_lo * s_hi))
    ratio = (s_hi / s_lo) ** (cost.effective_exponent(s_lo, s_hi) + p_shift)
    # unknowns (alpha, beta) scaling a and b: level kept at s_mid, ratio hi/lo as asked
    m = np.array(
        [
            [cost.a * s_mid, cost.b * s_mid**2],
            [cost.a * (s_hi - ratio * s_lo), cost.b * (s_hi**2 - ratio * s_lo**2)],
        ]
    )
    rhs = np.array([float(cost.per_sample_time(s_mid)) - cost.c_seq, (ratio - 1) * cost.c_seq])
    alpha, beta = np.linalg.solve(m, rhs)
    if alpha < 0 or beta < 0:  # one term alone carries the level
        keep_a = beta < 0
        alpha, beta = (rhs[0] / m[0, 0], 0.0) if keep_a else (0.0, rhs[0] / m[0, 1])
    return replace(cost, a=cost.a * float(alpha), b=cost.b * float(beta), c0=cost.c0 * c0_scale)


def _budgets(cal: Calibration) -> Budgets:
    return Budgets(m_tok=cal.m_tok, m_mem=cal.m_mem, m_comp=cal.m_comp, p=cal.p)


def _plan(samples: pd.DataFrame, cal: Calibration, policy: str, n: int, seed: int) -> Any:
    return build_plan(samples, policy, _budgets(cal), n, seed, cost_model=cal).table


def epoch_time(rows: pd.DataFrame) -> float:
    """Σ over steps of the slowest rank's time."""
    return float(rows.groupby("step")["compute_s"].max().sum())


def run(
    samples: pd.DataFrame,
    truth: Calibration,
    prior: Calibration,
    device: TrueDevice,
    policy: str,
    world_size: int,
    seed: int,
    windows: int,
) -> dict[str, Any]:
    """Open loop, closed loop (refit every window of the epoch's steps, `windows` of them)
    and oracle on `samples` (module docstring); their true times and the refit's record."""
    tokens = samples["tokens"].to_numpy(np.float64)
    # which samples a window ran, by position: a hash table of the ids built once (a million
    # string ids looked up anew every window cost more than planning them)
    ids = pd.Index(samples["sample_id"])
    left = np.ones(len(samples), dtype=bool)
    rng = np.random.default_rng(seed)
    speeds = list(map(float, device.speeds))
    oracle_cal = replace(truth, extra={**truth.extra, "rank_speeds": speeds})
    open_table = _plan(samples, prior, policy, world_size, seed)
    open_rows = device.times(open_table, rng)
    oracle_rows = device.times(_plan(samples, oracle_cal, policy, world_size, seed), rng)
    steps = int(open_table["step"].max()) + 1
    window = max(1, -(-steps // windows))

    # the closed loop: run a window of the current plan, refit, replan the rest
    table, offset, after = open_table, 0, None
    measured: list[pd.DataFrame] = []
    refits: list[dict[str, Any]] = []
    while True:
        last = int(table["step"].max()) < window
        ran = table if last else table[table["step"] < window]
        rows = device.times(ran, rng)
        measured.append(rows.assign(step=rows["step"] + offset))
        left[ids.get_indexer(ran.loc[~ran["is_padding"], "sample_id"])] = False
        remaining = samples[left]
        if last or remaining.empty:
            break
        offset += window
        cal = refine(prior, pd.concat(measured), world_size=world_size, tokens=tokens)
        record = cal.extra["refit"]
        refits.append(
            {
                "step": offset,
                "rel_err_before": record["rel_err_before"]["median"],
                "rel_err_after": record["rel_err_after"]["median"],
                "slowest_rank_speed": min(cal.rank_speeds),
                "p": cal.p,
            }
        )
        after = remaining if after is None else after
        table = _plan(remaining, cal, policy, world_size, seed)
    closed_rows = pd.concat(measured)
    if after is None:
        raise UserError(
            f"closed_loop: the epoch at N = {world_size} fits one window; lower `windows`"
        )
    oracle_after = device.times(_plan(after, oracle_cal, policy, world_size, seed), rng)
    open_after = device.times(_plan(after, prior, policy, world_size, seed), rng)
    closed_after = closed_rows[closed_rows["step"] >= window]
    return {
        "open_s": epoch_time(open_rows),
        "closed_s": epoch_time(closed_rows),
        "oracle_s": epoch_time(oracle_rows),
        "after_first_window": {
            "samples": len(after),
            "closed_s": epoch_time(closed_after),
            "oracle_s": epoch_time(oracle_after),
            "open_s": epoch_time(open_after),
        },
        "windows": len(measured),
        "window_steps": int(-(-steps // windows)),
        "refits": refits,
    }


def true_device(cal: Calibration, spec: dict[str, Any], world_size: int) -> TrueDevice:
    """The truth of an experiment entry: `cal`'s cost, one rank in `slow_every` at
    `slow_speed`, `noise` relative timing noise."""
    speeds = np.ones(world_size)
    every = int(spec.get("slow_every", 0))
    if every:
        speeds[::every] = float(spec["slow_speed"])
    speeds = speeds / np.median(speeds)
    return TrueDevice(cal.cost, speeds, float(spec.get("noise", 0.0)))


def sample_count(spec: dict[str, Any], world_size: int) -> int:
    """How many samples an experiment entry plans at N = `world_size`: `samples_per_rank` x N
    (paper scale: the data grows with the cluster, the epoch's steps stay comparable), or a
    fixed `num_samples` at every N (the epoch shortens as N grows). Exactly one is given."""
    given = [key for key in ("samples_per_rank", "num_samples") if key in spec]
    if len(given) != 1:
        raise UserError(
            "closed_loop: give one of `samples_per_rank` (the data grows with N) and "
            f"`num_samples` (the same data at every N); got {given or 'neither'}"
        )
    if given == ["samples_per_rank"]:
        return int(spec["samples_per_rank"]) * world_size
    return int(spec["num_samples"])


def experiment(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of an experiment file's ``closed_loop`` section (experiments/closed_loop/):
    mixtures x world sizes (the data, `sample_count` samples) x calibrations x prior errors x
    policies x seeds."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.mixtures import synthesize

    try:
        out = []
        for mixture in spec["mixtures"]:
            for n in spec["world_sizes"]:
                count = sample_count(spec, n)
                samples = bucketize(synthesize(mixture, count, int(spec["manifest_seed"]))).samples
                tokens = samples["tokens"].to_numpy(np.float64)
                for cal_name in spec["calibrations"]:
                    truth = Calibration.load(cal_name).for_tokens(tokens)
                    device = true_device(truth, spec["device"], n)
                    for error in spec["prior_errors"]:
                        cost = perturbed(truth.cost, tokens, error["p_shift"], error["c0_scale"])
                        prior = replace(truth, cost=cost, source="model").for_tokens(tokens)
                        for policy in spec["policies"]:
                            for seed in spec["seeds"]:
                                got = run(
                                    samples,
                                    truth,
                                    prior,
                                    device,
                                    policy,
                                    n,
                                    seed,
                                    int(spec["windows"]),
                                )
                                out.append(
                                    {
                                        "mixture": mixture,
                                        "calibration": cal_name,
                                        **error,
                                        "prior_p": prior.p,
                                        "true_p": truth.p,
                                        "world_size": n,
                                        "num_samples": count,
                                        "policy": policy,
                                        "seed": seed,
                                        **got,
                                    }
                                )
    except KeyError as exc:
        raise UserError(
            f"closed_loop: field {exc.args[0]!r} missing; see experiments/closed_loop/model.yaml"
        ) from None
    return out
