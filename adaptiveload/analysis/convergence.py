"""Time to quality: does a policy's throughput gain survive as learning?

Reads the validation losses of the measured runs (the per-step table's `VAL_COLUMNS`, scored
after a step's update at every `train.val_every` steps and at each epoch's end) and compares
every policy with the baseline within each comparison group (setup, variant, kernel: a step
mode run as a variant is its own group) on three axes:

- **samples seen**: real samples trained on so far (`samples_seen`, padding repeats left out);
- **optimizer steps**: the run's steps so far;
- **training time**: the run's clock (the sum of its steps' `step_time_s`, by the run's timer;
  validation is outside it).

Two numbers per policy, each against the baseline with a 95% CI and a two-sided p-value from
resampling seeds (`stats.seed_bootstrap`, paired by seed):

- **time to target**: the training time at which a run's validation loss first reaches the
  target, linearly interpolated between evaluations. The target is the worst final loss of
  the baseline's seeds (each baseline run's loss after its last epoch; the largest of them),
  so every baseline seed reaches it and the baseline's own time is a time, not a censored
  one. A policy run that never reaches it has no time; the row then says how many did not.
- **loss at equal samples seen**: each run's validation loss interpolated at the samples seen
  that every run of the group reached (the smallest final `samples_seen`), as a ratio.

A verdict line per policy says what the intervals show: a gain or a cost only where the CI
excludes "no difference".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from adaptiveload.analysis.aggregate import RUN_KEYS
from adaptiveload.analysis.stats import GROUP, seed_bootstrap
from adaptiveload.step_table import VAL_COLUMNS

ESTIMATE = ("estimate", "ci_low", "ci_high", "p_value")  # what `stats.seed_bootstrap` returns
# the x axes of the curves: column -> label
AXES = {
    "samples_seen": "samples seen (real samples, all ranks)",
    "optimizer_steps": "optimizer steps",
    "time_s": "training time (s, the run's clock)",
}
COLUMNS = (
    "setup",
    "variant",
    "kernel",
    "policy",
    "baseline",
    "source",
    "metric",
    "n_baseline",
    "n_policy",
    "n_reached",
    "target",
    "at",
    *ESTIMATE,
)
TIME_TO_TARGET = "time to target ratio"
LOSS_AT_SAMPLES = "val_loss at equal samples seen ratio"


def curves(steps: pd.DataFrame) -> pd.DataFrame:
    """One row per (run, evaluation): the run keys, `AXES` and the `VAL_COLUMNS`, in step
    order. `steps` is the aggregated per-step table (`aggregate.aggregate(...).steps`)."""
    one = steps[steps["rank"] == steps.groupby(list(RUN_KEYS))["rank"].transform("min")]
    one = one.sort_values([*RUN_KEYS, "step"])
    one = one.assign(
        optimizer_steps=one["step"] + 1,
        time_s=one.groupby(list(RUN_KEYS))["step_time_s"].cumsum(),
    )
    evaluated = one[one["val_loss"].notna()]
    keep = [*RUN_KEYS, "source", "step", *AXES, *VAL_COLUMNS]
    return evaluated[keep].astype({c: float for c in VAL_COLUMNS}).reset_index(drop=True)


def first_reach(x: np.ndarray, loss: np.ndarray, target: float) -> float:
    """The x at which `loss` (evaluated at increasing `x`) first falls to `target`, linearly
    interpolated from the evaluation before; NaN if it never does."""
    below = np.flatnonzero(loss <= target)
    if below.size == 0:
        return float("nan")
    i = int(below[0])
    if i == 0:
        return float(x[0])
    x0, x1, y0, y1 = x[i - 1], x[i], loss[i - 1], loss[i]
    return float(x0 + (x1 - x0) * (y0 - target) / (y0 - y1))


@dataclass(frozen=True)
class Settings:
    baseline: str
    n_boot: int
    seed: int


def _per_run(group: pd.DataFrame, target: float, at: float) -> pd.DataFrame:
    rows = []
    for (policy, seed), run in group.groupby(["policy", "seed"], sort=True):
        rows.append(
            {
                "policy": policy,
                "seed": seed,
                "time_to_target": first_reach(
                    run["time_s"].to_numpy(), run["val_loss"].to_numpy(), target
                ),
                "loss_at": float(np.interp(at, run["samples_seen"], run["val_loss"])),
            }
        )
    return pd.DataFrame(rows)


def compare(curve: pd.DataFrame, settings: Settings) -> pd.DataFrame:
    """The `COLUMNS` table: per group and policy, time to target and loss at equal samples
    seen against the baseline (the baseline's own rows too, as the reference)."""
    out = []
    for key, group in curve.groupby(list(GROUP), sort=True):
        base_runs = group[group["policy"] == settings.baseline]
        if base_runs.empty:
            continue
        finals = base_runs.groupby("seed")["val_loss"].last()
        target = float(finals.max())
        at = float(group.groupby(list(RUN_KEYS))["samples_seen"].max().min())
        runs = _per_run(group, target, at)
        base = runs[runs["policy"] == settings.baseline]
        for policy, pol in runs.groupby("policy", sort=True):
            head = dict(
                zip(GROUP, key, strict=True),
                policy=policy,
                baseline=settings.baseline,
                source=str(group["source"].iloc[0]),
                n_baseline=len(base),
                n_policy=len(pol),
                target=target,
                at=at,
            )
            reached = pol["time_to_target"].notna()
            timing = (np.nan,) * 4
            if reached.all():
                timing = seed_bootstrap(
                    pol, base, "time_to_target", True, settings.n_boot, settings.seed
                )
            loss = seed_bootstrap(pol, base, "loss_at", True, settings.n_boot, settings.seed)
            out.append(
                {
                    **head,
                    "metric": TIME_TO_TARGET,
                    "n_reached": int(reached.sum()),
                    **dict(zip(ESTIMATE, timing, strict=True)),
                }
            )
            out.append(
                {
                    **head,
                    "metric": LOSS_AT_SAMPLES,
                    "n_reached": len(pol),
                    **dict(zip(ESTIMATE, loss, strict=True)),
                }
            )
    return pd.DataFrame(out, columns=list(COLUMNS))


def _reading(row: pd.Series, better: str, worse: str) -> str:
    if row["policy"] == row["baseline"]:
        return "the reference"
    if row["n_reached"] < row["n_policy"]:
        return f"{row['n_policy'] - row['n_reached']} of {row['n_policy']} seeds never reached it"
    ci = (
        f"x{row['estimate']:.3f} (95% CI {row['ci_low']:.3f}-{row['ci_high']:.3f}, "
        f"p={row['p_value']:.3g})"
    )
    if row["ci_high"] < 1:
        return f"{ci}: {better}"
    if row["ci_low"] > 1:
        return f"{ci}: {worse}"
    return f"{ci}: no difference resolved (the CI spans 1)"


def verdicts(table: pd.DataFrame) -> list[str]:
    """One line per (group, policy): what the two numbers show, whatever their sign."""
    lines = []
    for key, rows in table.groupby([*GROUP, "policy"], sort=True):
        time_row = rows[rows["metric"] == TIME_TO_TARGET].iloc[0]
        loss_row = rows[rows["metric"] == LOSS_AT_SAMPLES].iloc[0]
        time = _reading(time_row, "reaches the target sooner", "reaches the target later")
        loss = _reading(loss_row, "lower loss at equal samples", "higher loss at equal samples")
        where = " / ".join(str(k) for k in key[:-1])
        lines.append(
            f"{key[-1]} ({where}): time to val_loss {time_row['target']:.4f}: {time}; "
            f"val_loss at {loss_row['at']:.0f} samples seen: {loss}"
        )
    return lines


def to_markdown(table: pd.DataFrame) -> str:
    """convergence.md: what was measured, the table, and the verdict lines."""
    lines = [
        "# Time to quality: validation loss against the baseline",
        "",
        "Measured: held-out validation loss (flow matching, fixed noise) of each run. "
        "Target = the largest final validation loss of the baseline's seeds; time = the "
        "run's clock (sum of step times, validation outside it); equal samples = the "
        "samples seen that every run reached. Ratios policy / baseline of means over "
        "seeds; 95% CI and two-sided p from resampling seeds (paired).",
        "",
    ]
    if table.empty:
        return "\n".join([*lines, "No comparison possible: no baseline runs with validation.", ""])
    lines += [table.to_markdown(index=False, floatfmt=".4g"), "", "## Verdicts", ""]
    lines += [f"- {line}" for line in verdicts(table)]
    return "\n".join([*lines, ""])
