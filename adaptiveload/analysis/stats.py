"""Baseline vs policy: significance tests, effect sizes and bootstrap confidence intervals.

Within each comparison group (setup, variant, kernel) every policy is compared with the
baseline (equal-token by default) three ways, each with its n stated:

- per-step values (timed steps pooled over seeds): Mann-Whitney U with Cliff's delta and
  Welch's t with Cohen's d, on step time, step imbalance and step throughput;
- per-run throughput paired by seed: paired t (Cohen's d of the differences) and Wilcoxon
  signed-rank — honest about how few seeds there are (n = 3 cannot reach p < 0.05 by Wilcoxon);
- bootstrap 95% CIs and two-sided bootstrap p-values (seeded) of the throughput ratios
  policy / baseline (samples/s and tokens/s by the runs' timer, samples/s by the wall clock)
  and of the imbalance-rate difference policy - baseline, all of means over runs (each seed
  weighs the same, as in the table's per-policy means), resampled two ways:
  `bootstrap 95% CI` resamples steps within each run (the runs are fixed: it answers "how
  sure are we of THESE runs' means"); `hierarchical bootstrap 95% CI` resamples the seeds
  (paired: one draw of seeds for both policies when they ran the same seeds), then the steps
  within each drawn run, so that run-to-run variation counts too. The second is the one that
  matches an experiment whose replicates are seeds; it needs >= 2 seeds per policy.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
from scipy import stats as sps

from adaptiveload.analysis.aggregate import per_step
from adaptiveload.experiment import schema_default
from adaptiveload.metrics import throughput
from adaptiveload.step_table import WHOLE_EPOCH

GROUP = ("setup", "variant", "kernel")
STEP_METRICS = ("step_time_s", "imbalance", "samples_per_s", "tokens_per_s")
RUN_METRICS = ("samples_per_s", "tokens_per_s", "imbalance_rate")
# the two resampling schemes, as named in the `test` column (and in the paper table)
WITHIN_RUNS = "bootstrap 95% CI"
HIERARCHICAL = "hierarchical bootstrap 95% CI"
LEVELS = {WITHIN_RUNS: "bootstrap: steps within runs",
          HIERARCHICAL: "bootstrap: seeds, then steps within runs"}
# throughput ratios (metric name -> per-run statistic) and the imbalance difference
RATIOS = {"samples_per_s ratio": "samples", "tokens_per_s ratio": "tokens",
          "samples_per_s_wall ratio": "samples_wall"}


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


def _run_stats(run: pd.DataFrame, draws: np.ndarray) -> dict[str, np.ndarray]:
    """One run's throughputs (sum of samples or tokens / sum of step times; by the timer, and
    samples by the wall clock) and mean step imbalance, for each row of step indices `draws`
    (the last axis indexes steps).

    A run whose timed window is one whole epoch processed every sample of the data once: its
    samples and tokens are a census, not a draw, so only the step times are resampled (how
    long the epoch took is what is uncertain). Resampling the steps' sample counts too would
    charge the policy for which clips happened to share a step: a balanced step of many
    short clips and one of a single long clip take the same time."""
    v = {c: run[c].to_numpy(float)[draws]
         for c in ("samples", "tokens", "step_time_s", "step_wall_s", "imbalance")}
    timed = v["step_time_s"].sum(axis=-1)
    if (run["timed_window"] == WHOLE_EPOCH).all():
        shape = timed.shape
        samples = np.full(shape, run["samples"].sum(), dtype=float)
        tokens = np.full(shape, run["tokens"].sum(), dtype=float)
    else:
        samples, tokens = v["samples"].sum(axis=-1), v["tokens"].sum(axis=-1)
    samples_per_s, tokens_per_s = throughput(samples, tokens, timed)
    samples_per_s_wall, _ = throughput(samples, tokens, v["step_wall_s"].sum(axis=-1))
    return {"samples": samples_per_s, "tokens": tokens_per_s, "samples_wall": samples_per_s_wall,
            "imbalance": v["imbalance"].mean(axis=-1)}


def _by_seed(frame: pd.DataFrame) -> tuple[list[int], list[pd.DataFrame]]:
    seeds, runs = zip(*frame.groupby("seed", sort=True), strict=True)
    return [int(s) for s in seeds], list(runs)


def _run_means(
    frame: pd.DataFrame, n_boot: int, rng: np.random.Generator
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Per-run statistics averaged over runs (seeds): the point estimate, and [n_boot]
    bootstrap replicates with steps resampled with replacement within each run, so every run
    keeps its weight (a run slowed by a noisy neighbour does not dominate a pooled sum)."""
    _, runs = _by_seed(frame)
    boot: dict[str, np.ndarray] = {}
    point: dict[str, float] = {}
    for run in runs:
        draws = rng.integers(0, len(run), size=(n_boot, len(run)))
        for key, values in _run_stats(run, draws).items():
            boot[key] = boot.get(key, 0.0) + values / len(runs)
        for key, value in _run_stats(run, np.arange(len(run))).items():
            point[key] = point.get(key, 0.0) + float(value) / len(runs)
    return boot, point


def _seed_draws(
    pol: pd.DataFrame, base: pd.DataFrame, n_boot: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """[n_boot, seeds] indices of resampled runs: one draw for both policies when they ran
    the same seeds (paired, as the seed fixes the data and the initial weights), else two."""
    seeds_p, seeds_b = _by_seed(pol)[0], _by_seed(base)[0]
    idx_p = rng.integers(0, len(seeds_p), size=(n_boot, len(seeds_p)))
    if seeds_p == seeds_b:
        return idx_p, idx_p
    return idx_p, rng.integers(0, len(seeds_b), size=(n_boot, len(seeds_b)))


def _hierarchical_means(
    frame: pd.DataFrame, idx: np.ndarray, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """[n_boot] replicates of the mean over runs: run j of replicate b is run idx[b, j], with
    its steps resampled afresh for every (b, j) (a run drawn twice gets two step resamples)."""
    _, runs = _by_seed(frame)
    n_boot, k = idx.shape
    out: dict[str, np.ndarray] = {}
    for r, run in enumerate(runs):
        draws = rng.integers(0, len(run), size=(n_boot, k, len(run)))
        chosen = idx == r
        for key, values in _run_stats(run, draws).items():
            out[key] = out.get(key, 0.0) + np.where(chosen, values, 0.0).sum(axis=1) / k
    return out


def compare(
    runs: pd.DataFrame,
    steps: pd.DataFrame,
    baseline: str = schema_default("analysis.baseline"),
    n_boot: int = schema_default("analysis.bootstrap"),
    seed: int = schema_default("analysis.seed"),
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


def _p_two_sided(replicates: np.ndarray, null: float) -> float:
    """Two-sided bootstrap p-value for "statistic = null": twice the smaller tail share,
    counted as (1 + k) / (1 + n) so that it is never 0 (its floor is 2 / (1 + n_boot))."""
    tail = min(np.sum(replicates <= null), np.sum(replicates >= null))
    return min(1.0, 2 * (1 + tail) / (1 + len(replicates)))


def _bootstrap(
    pol: pd.DataFrame, base: pd.DataFrame, n_boot: int, seed: int, head: tuple
) -> list[Row]:
    """Throughput ratios policy / baseline and the imbalance-rate difference, of run means,
    each with its CI and p-value from the same replicates; both resampling schemes."""
    if len(pol) < 2 or len(base) < 2:
        return []
    rng = np.random.default_rng(seed)
    pb, pp = _run_means(pol, n_boot, rng)
    bb, bp = _run_means(base, n_boot, rng)
    schemes = {WITHIN_RUNS: (pb, bb)}
    n_p, n_b = pol["seed"].nunique(), base["seed"].nunique()
    if n_p >= 2 and n_b >= 2:
        idx_p, idx_b = _seed_draws(pol, base, n_boot, rng)
        schemes[HIERARCHICAL] = (_hierarchical_means(pol, idx_p, rng),
                                 _hierarchical_means(base, idx_b, rng))
    out = []
    for test, (p_boot, b_boot) in schemes.items():
        # n = timed steps for the within-run scheme, seeds for the hierarchical one
        ns = (len(base), len(pol)) if test == WITHIN_RUNS else (n_b, n_p)
        for metric, key in RATIOS.items():
            estimate = pp[key] / bp[key]
            if not np.isfinite(estimate):  # e.g. no wall clock in a simulation
                continue
            ratio = p_boot[key] / b_boot[key]
            lo, hi = np.percentile(ratio, [2.5, 97.5])
            out.append(_row(head, metric, LEVELS[test], test, *ns, estimate, ci=(lo, hi),
                            p=_p_two_sided(ratio, 1.0)))
        diff = p_boot["imbalance"] - b_boot["imbalance"]
        lo, hi = np.percentile(diff, [2.5, 97.5])
        out.append(_row(head, "imbalance_rate difference", LEVELS[test], test, *ns,
                        pp["imbalance"] - bp["imbalance"], ci=(lo, hi),
                        p=_p_two_sided(diff, 0.0)))
    return out


def headline(stats: pd.DataFrame) -> pd.DataFrame:
    """The bootstrap rows the paper table and figures show: per comparison and metric, the
    hierarchical one (seeds, then steps) where there is one, else steps within runs."""
    boot = stats[stats["test"].isin([HIERARCHICAL, WITHIN_RUNS])]
    keys = [*GROUP, "policy", "metric"]
    has = boot[boot["test"] == HIERARCHICAL][keys].drop_duplicates().assign(_h=True)
    boot = boot.merge(has, on=keys, how="left")
    keep = (boot["test"] == HIERARCHICAL) | boot["_h"].isna()
    return boot[keep].drop(columns="_h").reset_index(drop=True)


def to_markdown(table: pd.DataFrame) -> str:
    """A readable stats.md: one section per comparison group, n and test named on every row."""
    lines = ["# Baseline vs policy: statistical tests", "",
             "Per-step tests pool the timed steps of all seeds; paired tests pair runs by "
             "seed. Bootstrap rows (seeded) give a 95% CI and a two-sided p-value from the "
             "same replicates: `bootstrap 95% CI` resamples steps within each run (n = timed "
             "steps), `hierarchical bootstrap 95% CI` resamples seeds, then steps within each "
             "drawn run (n = seeds). `estimate` is policy - baseline (a ratio for "
             "`... ratio`). Times are by each run's timer (see the source label); "
             "`samples_per_s_wall` by the wall clock.", ""]
    if table.empty:
        return "\n".join([*lines, "No comparison possible: the baseline policy has no runs.", ""])
    for (setup, variant, kernel), group in table.groupby(list(GROUP), sort=True):
        lines += [f"## {setup} / {variant} / kernel {kernel} ({group['source'].iloc[0]})", ""]
        shown = group[["policy", "metric", "level", "test", "n_baseline", "n_policy",
                       "estimate", "ci_low", "ci_high", "p_value", "effect_size",
                       "effect_name"]]
        lines += [shown.to_markdown(index=False, floatfmt=".4g"), ""]
    return "\n".join(lines)


def seed_bootstrap(
    pol: pd.DataFrame, base: pd.DataFrame, column: str, ratio: bool, n_boot: int, seed: int
) -> tuple[float, float, float, float]:
    """(estimate, ci_low, ci_high, p_value) of the policy's mean of `column` over its runs
    (one row per seed) against the baseline's: their ratio (`ratio`, null 1) or difference
    (null 0), the 95% CI and two-sided p from resampling seeds, paired where both ran the
    same seeds (`_seed_draws`, the hierarchical scheme's seed level)."""
    pol, base = pol.sort_values("seed"), base.sort_values("seed")
    p_vals, b_vals = pol[column].to_numpy(float), base[column].to_numpy(float)
    idx_p, idx_b = _seed_draws(pol, base, n_boot, np.random.default_rng(seed))
    p_boot, b_boot = p_vals[idx_p].mean(axis=1), b_vals[idx_b].mean(axis=1)
    if ratio:
        estimate, reps, null = p_vals.mean() / b_vals.mean(), p_boot / b_boot, 1.0
    else:
        estimate, reps, null = p_vals.mean() - b_vals.mean(), p_boot - b_boot, 0.0
    lo, hi = np.percentile(reps, [2.5, 97.5])
    return float(estimate), float(lo), float(hi), _p_two_sided(reps, null)
