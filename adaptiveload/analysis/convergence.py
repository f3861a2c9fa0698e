"""Time to quality: does a policy's throughput gain survive as learning?

Reads the validation losses of the measured runs (the per-step table's `VAL_COLUMNS`, scored
after a step's update at every `train.val_every` steps and at each epoch's end) and compares
every policy with the baseline within each comparison group (setup, variant, kernel: a step
mode run as a variant is its own group) on three axes:

- **samples seen**: real samples trained on so far (`samples_seen`, padding repeats left out);
- **optimizer steps**: the run's steps so far;
- **training time**: the run's clock (the sum of its steps' `step_time_s`, by the run's timer;
  validation is outside it).

Three numbers per policy, each against the baseline at the level of the replicate (runs paired
by seed, `stats.paired_effect`: the geometric mean of the per-seed ratios, a 95% t interval on
their logs and the exact sign-flip p, docs/measurement.md):

- **time to target**: the training time at which a run's validation loss first reaches the
  target, linearly interpolated between evaluations. The target is the worst final loss of
  the baseline's seeds (each baseline run's loss after its last epoch; the largest of them),
  so every baseline seed reaches it and the baseline's own time is a time, not a censored
  one. A policy run that never reaches it has no time; the row then says how many did not.
- **time to common loss**: the same, to the loss that every run of the group reaches (the
  largest final loss of all its runs): defined even where a policy never reaches the
  baseline's final loss.
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
from adaptiveload.analysis.stats import GROUP, paired_effect
from adaptiveload.errors import UserError
from adaptiveload.step_table import VAL_COLUMNS

ESTIMATE = ("estimate", "ci_low", "ci_high", "p_value")  # of `stats.paired_effect`
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
    "label",
    "steps_per_epoch",
    "optimizer_steps",
    "final_val_loss",
    "metric",
    "n_baseline",
    "n_policy",
    "n_reached",
    "target",
    "at",
    "policy_mean",
    "baseline_mean",
    *ESTIMATE,
)
TIME_TO_TARGET = "time to target ratio"  # target: the baseline's final loss (worst seed)
TIME_TO_COMMON = "time to common loss ratio"  # target: the worst final loss of all runs
LOSS_AT_SAMPLES = "val_loss at equal samples seen ratio"


def curves(steps: pd.DataFrame, origin: str = "steps table") -> pd.DataFrame:
    """One row per (run, evaluation): the run keys, `AXES` and the `VAL_COLUMNS`, in step
    order. `steps` is the aggregated per-step table (`aggregate.aggregate(...).steps`); one
    run's own table (no run keys) is a UserError naming `origin`."""
    missing = [c for c in (*RUN_KEYS, "rank", "step", "step_time_s", *VAL_COLUMNS)
               if c not in steps.columns]
    if missing:
        raise UserError(f"{origin}: no column {', '.join(missing)}; pass the per-step table of "
                        "all runs that `adaptiveload analyze aggregate --steps-out` writes, not "
                        "one run's steps.parquet")
    one = steps[steps["rank"] == steps.groupby(list(RUN_KEYS))["rank"].transform("min")]
    one = one.sort_values([*RUN_KEYS, "step"])
    one = one.assign(
        optimizer_steps=one["step"] + 1,
        time_s=one.groupby(list(RUN_KEYS))["step_time_s"].cumsum(),
    )
    evaluated = one[one["val_loss"].notna()]
    keep = [*RUN_KEYS, "source", "label", "steps_per_epoch", "step", *AXES, *VAL_COLUMNS]
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
    seed: int


def _per_run(group: pd.DataFrame, targets: dict[str, float], at: float) -> pd.DataFrame:
    """Per run: the time to each of `targets` (metric -> loss) and the loss at `at` samples."""
    rows = []
    for (policy, seed), run in group.groupby(["policy", "seed"], sort=True):
        time, loss = run["time_s"].to_numpy(), run["val_loss"].to_numpy()
        row = {"policy": policy, "seed": seed, "optimizer_steps": run["optimizer_steps"].max()}
        row["final_val_loss"] = float(loss[-1])
        row.update({metric: first_reach(time, loss, t) for metric, t in targets.items()})
        row[LOSS_AT_SAMPLES] = float(np.interp(at, run["samples_seen"], run["val_loss"]))
        rows.append(row)
    return pd.DataFrame(rows)


def _targets(group: pd.DataFrame, baseline: str) -> dict[str, float]:
    """metric -> target loss: the baseline's final loss (its worst seed's) and the worst final
    loss of all runs of the group (every run reaches it)."""
    finals = group.groupby(["policy", "seed"])["val_loss"].last()
    return {
        TIME_TO_TARGET: float(finals.loc[baseline].max()),
        TIME_TO_COMMON: float(finals.max()),
    }


def _estimate(pol: pd.DataFrame, base: pd.DataFrame, metric: str, s: Settings) -> dict:
    """The row fields of one metric: seeds that have a value, the means over seeds, and the
    paired effect of their ratio (NaN unless every run of both has one: a censored time is not a
    time, so neither its mean nor a ratio exists)."""
    have = int(pol[metric].notna().sum())
    values = (np.nan,) * len(ESTIMATE)
    means = {"policy_mean": np.nan, "baseline_mean": np.nan}
    if base[metric].notna().all():
        means["baseline_mean"] = float(base[metric].mean())
    if have == len(pol):
        means["policy_mean"] = float(pol[metric].mean())
        if base[metric].notna().all():
            pairs = pol.merge(base, on="seed", suffixes=("", "_base"))
            eff = paired_effect(pairs[metric], pairs[f"{metric}_base"], True, seed=s.seed)
            values = (eff.estimate, eff.ci_low, eff.ci_high, eff.p_value)
    fields = {"metric": metric, "n_reached": have, **means}
    return {**fields, **dict(zip(ESTIMATE, values, strict=True))}


def compare(curve: pd.DataFrame, settings: Settings) -> pd.DataFrame:
    """The `COLUMNS` table: per group and policy, the times to the two targets and the loss
    at equal samples seen against the baseline (the baseline's own rows too, as reference)."""
    out = []
    for key, group in curve.groupby(list(GROUP), sort=True):
        if not (group["policy"] == settings.baseline).any():
            continue
        targets = _targets(group, settings.baseline)
        at = float(group.groupby(list(RUN_KEYS))["samples_seen"].max().min())
        runs = _per_run(group, targets, at)
        base = runs[runs["policy"] == settings.baseline]
        for policy, pol in runs.groupby("policy", sort=True):
            head = dict(
                zip(GROUP, key, strict=True),
                policy=policy,
                baseline=settings.baseline,
                source=str(group["source"].iloc[0]),
                label=str(group["label"].iloc[0]),
                steps_per_epoch=str(group["steps_per_epoch"].iloc[0]),
                optimizer_steps=float(pol["optimizer_steps"].mean()),
                final_val_loss=float(pol["final_val_loss"].mean()),
                n_baseline=len(base),
                n_policy=len(pol),
                at=at,
            )
            for metric in (*targets, LOSS_AT_SAMPLES):
                target = targets.get(metric, np.nan)
                out.append({**head, "target": target, **_estimate(pol, base, metric, settings)})
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
    """One line per (group, policy): what its numbers show, whatever their sign."""
    lines = []
    for key, rows in table.groupby([*GROUP, "policy"], sort=True):
        parts = []
        for metric in (TIME_TO_TARGET, TIME_TO_COMMON):
            row = rows[rows["metric"] == metric].iloc[0]
            reading = _reading(row, "reaches it sooner", "reaches it later")
            parts.append(f"time to val_loss {row['target']:.4f} ({metric[:-6]}): {reading}")
        row = rows[rows["metric"] == LOSS_AT_SAMPLES].iloc[0]
        loss = _reading(row, "lower loss at equal samples", "higher loss at equal samples")
        parts.append(f"val_loss at {row['at']:.0f} samples seen: {loss}")
        where = " / ".join(str(k) for k in key[:-1])
        lines.append(f"{key[-1]} ({where}): " + "; ".join(parts))
    return lines


def _cell(row: pd.Series, fmt: str) -> str:
    """One number of the summary: the policy's mean over seeds, its ratio to the baseline's
    with the 95% CI and p, or how many seeds never reached the target."""
    if row["n_reached"] < row["n_policy"]:
        return f"{row['n_policy'] - row['n_reached']} of {row['n_policy']} seeds never reached it"
    mean = fmt.format(row["policy_mean"])
    if row["policy"] == row["baseline"]:
        return f"{mean} (reference)"
    if np.isnan(row["estimate"]):  # the baseline's own time is censored
        return mean
    return (
        f"{mean}: x{row['estimate']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}] "
        f"p={row['p_value']:.2g}"
    )


def _summary(group: pd.DataFrame) -> pd.DataFrame:
    """One row per policy of one comparison group: its steps, final loss and the three
    numbers against the baseline (`_cell`)."""
    first = group.iloc[0]
    target, common = (
        group.loc[group["metric"] == m, "target"].iloc[0] for m in (TIME_TO_TARGET, TIME_TO_COMMON)
    )
    heads = {
        TIME_TO_TARGET: (f"time to {target:.3f} (the baseline's final)", "{:.1f} s"),
        TIME_TO_COMMON: (f"time to {common:.3f} (every run's)", "{:.1f} s"),
        LOSS_AT_SAMPLES: (f"val_loss at {first['at']:.0f} samples seen", "{:.3f}"),
    }
    rows = []
    baseline = first["baseline"]
    for policy in sorted(set(group["policy"]), key=lambda p: (p != baseline, p)):
        own = group[group["policy"] == policy]
        row = {
            "policy": policy,
            "optimizer steps": f"{own['optimizer_steps'].iloc[0]:.0f}",
            "final val_loss": f"{own['final_val_loss'].iloc[0]:.3f}",
        }
        for metric, (head, fmt) in heads.items():
            row[head] = _cell(own[own["metric"] == metric].iloc[0], fmt)
        rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(table: pd.DataFrame) -> str:
    """convergence.md: what was measured, per comparison group (a step mode) a summary per
    policy and its verdict lines, then every row of the table."""
    lines = [
        "# Time to quality: validation loss against the baseline",
        "",
        "Held-out validation loss (flow matching, fixed noise) of each run. Time = the run's "
        "clock (sum of step times, validation outside it); targets: the largest final "
        "validation loss of the baseline's seeds, and the largest final loss of all runs "
        "(every run reaches it); equal samples = the samples seen that every run reached. "
        "Cells: the policy's mean over seeds; x = ratio of means policy / baseline, "
        "[95% CI] and two-sided p from resampling seeds (paired).",
        "",
    ]
    if table.empty:
        return "\n".join([*lines, "No comparison possible: no baseline runs with validation.", ""])
    for key, group in table.groupby(list(GROUP), sort=True):
        first = group.iloc[0]
        where = " / ".join(str(k) for k in key)
        lines += [f"## Steps per epoch: {first['steps_per_epoch']} ({where})", ""]
        lines += [f"{first['label']}; baseline {first['baseline']}.", ""]
        lines += [_summary(group).to_markdown(index=False), ""]
        lines += [f"- {line}" for line in verdicts(group)]
        lines.append("")
    lines += ["## Every number", "", table.to_markdown(index=False, floatfmt=".4g"), ""]
    return "\n".join(lines)


# the two numbers of a convergence comparison the README shows, by their names in the table
README_METRICS = {TIME_TO_COMMON: "time to the loss every run reaches",
                  LOSS_AT_SAMPLES: "val loss at equal samples"}


def readme_table(comparisons: list[dict]) -> str:
    """The README's convergence table from a convergence benchmark's `comparisons` (the
    rows of `compare`): per step mode and policy the optimizer steps and the two ratios vs
    the baseline, point estimates only. That benchmark's intervals came from a bootstrap over
    3 seeds, which is too narrow at 3 seeds (docs/measurement.md), so none is shown; a run
    of experiments/convergence.yaml gives replicate-level ones in its tables."""
    frame = pd.DataFrame(comparisons)
    frame = frame[frame["policy"] != frame["baseline"]]
    rows = []
    for (mode, policy), group in frame.groupby(["steps_per_epoch", "policy"], sort=True):
        by = group.set_index("metric")["estimate"]
        rows.append({"step mode": mode, "policy": policy,
                     "steps": f"{group['optimizer_steps'].iloc[0]:.0f}",
                     **{label: f"×{by[m]:.2f}" if np.isfinite(by.get(m, np.nan)) else ""
                        for m, label in README_METRICS.items()}})
    return pd.DataFrame(rows).to_markdown(index=False) + "\n"
