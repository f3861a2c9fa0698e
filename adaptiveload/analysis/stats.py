"""Baseline vs policy: significance tests, effect sizes and bootstrap confidence intervals.

Within each comparison group (setup, variant, kernel) every policy is compared with the
baseline (equal-token by default) three ways, each with its n stated:

- per-step values (timed steps pooled over seeds): Mann-Whitney U with Cliff's delta and
  Welch's t with Cohen's d, on step time, step imbalance and step throughput;
- per-run throughput paired by seed: paired t (Cohen's d of the differences) and Wilcoxon
  signed-rank — honest about how few seeds there are (n = 3 cannot reach p < 0.05 by Wilcoxon);
- bootstrap 95% CIs (seeded; steps resampled within each run) of the throughput ratio
  policy / baseline and of the imbalance-rate difference policy - baseline, both of means
  over runs (each seed weighs the same, as in the table's per-policy means).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats as sps

from adaptiveload.analysis.aggregate import per_step

GROUP = ("setup", "variant", "kernel")
STEP_METRICS = ("step_time_s", "imbalance", "samples_per_s", "tokens_per_s")
RUN_METRICS = ("samples_per_s", "tokens_per_s", "imbalance_rate")


@dataclass(frozen=True)
class Row:
    """One test or interval; `estimate` is the effect in the metric's own terms."""

    setup: str
    variant: str
    kernel: str
    policy: str
    baseline: str
    source: str
    metric: str
    level: str  # "step", "run (paired by seed)" or "bootstrap"
    test: str
    n_baseline: int
    n_policy: int
    estimate: float
    ci_low: float
    ci_high: float
    statistic: float
    p_value: float
    effect_size: float
    effect_name: str


def cliffs_delta(x: np.ndarray, y: np.ndarray) -> float:
    """P(x > y) - P(x < y) over all pairs; via ranks, O((n+m) log(n+m))."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n, m = len(x), len(y)
    if n == 0 or m == 0:
        return float("nan")
    ranks = sps.rankdata(np.concatenate([x, y]))
    u = ranks[:n].sum() - n * (n + 1) / 2  # pairs with x > y, ties counted half
    return float(2 * u / (n * m) - 1)


def cohens_d(x: np.ndarray, y: np.ndarray) -> float:
    """(mean x - mean y) / pooled standard deviation."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n, m = len(x), len(y)
    if n < 2 or m < 2:
        return float("nan")
    pooled = np.sqrt(((n - 1) * x.var(ddof=1) + (m - 1) * y.var(ddof=1)) / (n + m - 2))
    return float((x.mean() - y.mean()) / pooled) if pooled > 0 else float("nan")


def _groups(steps: pd.DataFrame, runs: pd.DataFrame) -> Iterator[tuple[tuple, pd.DataFrame,
                                                                       pd.DataFrame]]:
    for key, run_group in runs.groupby(list(GROUP), sort=True):
        mask = np.ones(len(steps), dtype=bool)
        for col, value in zip(GROUP, key, strict=True):
            mask &= (steps[col] == value).to_numpy()
        yield key, run_group, steps[mask]


def _row(head: tuple, metric: str, level: str, test: str, n_b: int, n_p: int,
         estimate: float, ci: tuple[float, float] = (np.nan, np.nan),
         statistic: float = np.nan, p: float = np.nan, effect: float = np.nan,
         effect_name: str = "") -> Row:
    return Row(*head, metric, level, test, n_b, n_p, float(estimate), float(ci[0]),
               float(ci[1]), float(statistic), float(p), float(effect), effect_name)


def _run_means(
    frame: pd.DataFrame, n_boot: int, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Per-run throughput (sum samples or tokens / sum step time) and mean step imbalance,
    averaged over runs (seeds): the point estimate, and [n_boot] bootstrap replicates with
    steps resampled with replacement within each run, so every run keeps its weight (a run
    slowed by a noisy neighbour does not dominate a pooled sum)."""
    runs = [g for _, g in frame.groupby("seed", sort=True)]
    boot = {k: np.zeros(n_boot) for k in ("samples", "tokens", "imbalance")}
    point = dict.fromkeys(boot, 0.0)
    for run in runs:
        v = {c: run[c].to_numpy(float) for c in ("samples", "tokens", "step_time_s", "imbalance")}
        draws = rng.integers(0, len(run), size=(n_boot, len(run)))
        time_b = v["step_time_s"][draws].sum(axis=1)
        for unit in ("samples", "tokens"):
            boot[unit] += v[unit][draws].sum(axis=1) / time_b / len(runs)
            point[unit] += v[unit].sum() / v["step_time_s"].sum() / len(runs)
        boot["imbalance"] += v["imbalance"][draws].mean(axis=1) / len(runs)
        point["imbalance"] += v["imbalance"].mean() / len(runs)
    return boot, point


def compare(
    runs: pd.DataFrame,
    steps: pd.DataFrame,
    baseline: str = "equal-token",
    n_boot: int = 2000,
    seed: int = 0,
) -> pd.DataFrame:
    """All tests of every policy against `baseline` within each group; one row per test."""
    step_table = per_step(steps)
    rows: list[Row] = []
    for (setup, variant, kernel), run_group, group_steps in _groups(step_table, runs):
        if baseline not in set(run_group["policy"]):
            continue
        source = ", ".join(sorted(set(run_group["label"])))
        base_steps = group_steps[group_steps["policy"] == baseline]
        base_runs = run_group[run_group["policy"] == baseline]
        for policy in sorted(set(run_group["policy"]) - {baseline}):
            pol_steps = group_steps[group_steps["policy"] == policy]
            pol_runs = run_group[run_group["policy"] == policy]

            head = (setup, variant, kernel, policy, baseline, source)

            for metric in STEP_METRICS:
                x = pol_steps[metric].dropna().to_numpy()
                y = base_steps[metric].dropna().to_numpy()
                if len(x) < 2 or len(y) < 2:
                    continue
                diff = x.mean() - y.mean()
                mwu = sps.mannwhitneyu(x, y, alternative="two-sided")
                rows.append(_row(head, metric, "step", "Mann-Whitney U", len(y), len(x), diff,
                                statistic=mwu.statistic, p=mwu.pvalue,
                                effect=cliffs_delta(x, y), effect_name="Cliff's delta"))
                welch = sps.ttest_ind(x, y, equal_var=False)
                ci = welch.confidence_interval(0.95)
                rows.append(_row(head, metric, "step", "Welch's t", len(y), len(x), diff,
                                ci=(ci.low, ci.high), statistic=welch.statistic,
                                p=welch.pvalue, effect=cohens_d(x, y),
                                effect_name="Cohen's d"))

            paired = pol_runs.merge(base_runs, on="seed", suffixes=("", "_base"))
            for metric in RUN_METRICS:
                pair = paired[[metric, f"{metric}_base"]].dropna()
                n = len(pair)
                if n < 2:
                    continue
                d = (pair[metric] - pair[f"{metric}_base"]).to_numpy()
                sd = d.std(ddof=1)
                effect = d.mean() / sd if sd > 0 else np.nan
                if sd > 0:
                    tt = sps.ttest_rel(pair[metric], pair[f"{metric}_base"])
                    ci = tt.confidence_interval(0.95)
                    rows.append(_row(head, metric, "run (paired by seed)", "paired t", n, n,
                                    d.mean(), ci=(ci.low, ci.high), statistic=tt.statistic,
                                    p=tt.pvalue, effect=effect, effect_name="Cohen's d (dz)"))
                if np.any(d != 0):
                    wil = sps.wilcoxon(d)
                    rows.append(_row(head, metric, "run (paired by seed)", "Wilcoxon signed-rank",
                                    n, n, float(np.median(d)), statistic=wil.statistic,
                                    p=wil.pvalue, effect=effect, effect_name="Cohen's d (dz)"))

            rows.extend(_bootstrap(pol_steps, base_steps, n_boot, seed, head))
    frame = pd.DataFrame([asdict(r) for r in rows], columns=list(Row.__dataclass_fields__))
    return frame


def _bootstrap(
    pol: pd.DataFrame, base: pd.DataFrame, n_boot: int, seed: int, head: tuple
) -> list[Row]:
    """Throughput ratios policy / baseline and the imbalance-rate difference, of run means."""
    if len(pol) < 2 or len(base) < 2:
        return []
    rng = np.random.default_rng(seed)
    pb, pp = _run_means(pol, n_boot, rng)
    bb, bp = _run_means(base, n_boot, rng)
    n_p, n_b = len(pol), len(base)
    out = []
    for unit in ("samples", "tokens"):
        ratio = pb[unit] / bb[unit]
        lo, hi = np.percentile(ratio, [2.5, 97.5])
        # two-sided bootstrap p-value for "ratio = 1"
        p = min(1.0, 2 * min(np.mean(ratio <= 1.0), np.mean(ratio >= 1.0)))
        out.append(_row(head, f"{unit}_per_s ratio", "bootstrap", "bootstrap 95% CI", n_b, n_p,
                        pp[unit] / bp[unit], ci=(lo, hi), p=p))
    diff = pb["imbalance"] - bb["imbalance"]
    lo, hi = np.percentile(diff, [2.5, 97.5])
    p = min(1.0, 2 * min(np.mean(diff <= 0.0), np.mean(diff >= 0.0)))
    out.append(_row(head, "imbalance_rate difference", "bootstrap", "bootstrap 95% CI", n_b, n_p,
                    pp["imbalance"] - bp["imbalance"], ci=(lo, hi), p=p))
    return out


def to_markdown(table: pd.DataFrame) -> str:
    """A readable stats.md: one section per comparison group, n and test named on every row."""
    lines = ["# Baseline vs policy: statistical tests", "",
             "Per-step tests pool the timed steps of all seeds; paired tests pair runs by "
             "seed; bootstrap CIs resample steps within each run (seeded). `estimate` is "
             "policy - baseline (a ratio for `... ratio`).", ""]
    if table.empty:
        return "\n".join([*lines, "No comparison possible: the baseline policy has no runs.", ""])
    for (setup, variant, kernel), group in table.groupby(list(GROUP), sort=True):
        lines += [f"## {setup} / {variant} / kernel {kernel} ({group['source'].iloc[0]})", ""]
        shown = group[["policy", "metric", "level", "test", "n_baseline", "n_policy",
                       "estimate", "ci_low", "ci_high", "p_value", "effect_size",
                       "effect_name"]]
        lines += [shown.to_markdown(index=False, floatfmt=".4g"), ""]
    return "\n".join(lines)
