"""Baseline vs policy at the level of the replicate: one interval and one p-value per
comparison and metric, with the coverage the design can honestly give.

The unit of replication is the run: one seed's training run (or simulation) of one policy.
Within a run the timed steps are one fixed epoch of heterogeneous steps, not random draws,
so resampling them (or pooling them over seeds into per-step tests) reports step unevenness
as if it were uncertainty and makes every interval too narrow. Everything here starts from
the runs table (one row per run; `analysis.aggregate`) and pairs a policy's runs with the
baseline's by seed (the seed fixes the data, its order and the initial weights):

- **measured** comparisons (`source` measured): per seed the effect d_i, the log of the
  ratio policy / baseline for throughputs, the difference for the imbalance rate. The
  estimate is the mean of d (a ratio's is exp(mean log ratio), the geometric mean of the
  per-seed ratios), the 95% CI a t interval on d (n - 1 degrees of freedom: right at any
  number of seeds when d is roughly normal, which log ratios of throughputs are), the
  p-value the exact sign-flip permutation p of mean(d) (distribution-free; with n seeds it is
  never below 2 / 2**n, 0.25 at 3 seeds, so it cannot claim more than the design gives).
  `agree` counts the seeds on the estimate's side: "3 of 3 seeds agree" says as much as a p
  at 3 seeds can. Where the runs recorded the host's load, a **load-adjusted** line (the
  paired effect regressed on the load difference, t interval on its intercept) says how much
  of the effect could be load (a sensitivity line beside the headline, never instead of it).
- **model** comparisons (simulations, `source` model): a prediction has no sampling error.
  What varies between seeds is the data and its order, so the row gives the estimate and the
  per-seed range (`seed_min`-`seed_max`) and no CI or p-value.

docs/measurement.md derives the choice; tests/analysis/test_analysis_coverage.py checks the
coverage on synthetic A/A data and the power on a known effect.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import numpy as np
import pandas as pd
from scipy import stats as sps

from adaptiveload.experiment import schema_default

GROUP = ("setup", "variant", "kernel")
# compared run metrics: runs-table column -> the metric's name in stats.csv; a `ratio` is
# compared on the log scale, a `difference` as is
RATIOS = {"samples_per_s": "samples_per_s ratio", "tokens_per_s": "tokens_per_s ratio",
          "samples_per_s_wall": "samples_per_s_wall ratio"}
DIFFERENCES = {"imbalance_rate": "imbalance_rate difference"}
# the host's mean 1-minute load average over a measured run's timed steps (runs table)
LOAD = "host_load_mean"
# the `test` column: the headline of a measured comparison, its load sensitivity, a model's
PAIRED = "paired t interval, sign-flip p"
LOAD_ADJUSTED = "load-adjusted paired t (sensitivity)"
SEED_RANGE = "seed range (model: no sampling error)"
HEADLINE_TESTS = (PAIRED, SEED_RANGE)
LEVELS = {PAIRED: "replicates: runs paired by seed",
          LOAD_ADJUSTED: "replicates: runs paired by seed, adjusted for host load",
          SEED_RANGE: "model: range over seeds"}
CONFIDENCE = 0.95
# exact sign-flip enumeration up to this many seeds (2**16 sign vectors), Monte Carlo above
EXACT_FLIPS_MAX = 16
MONTE_CARLO_FLIPS = 2**16


@dataclass(frozen=True)
class Effect:
    """A policy's effect against the baseline over n paired replicates, on the metric's own
    scale (a ratio for throughputs, a difference for the imbalance rate). Fields without a
    meaning for the design are NaN: a model's CI and p, any interval of one replicate."""

    n: int
    estimate: float
    ci_low: float
    ci_high: float
    p_value: float
    p_floor: float  # the least p-value this number of replicates can give
    statistic: float  # t of the mean effect (log scale for a ratio)
    seed_min: float
    seed_max: float
    agree: int  # replicates whose effect lies on the estimate's side of "no change"


@dataclass(frozen=True)
class Row:
    """One line of stats.csv: a comparison, a metric and the test that gives its numbers."""

    setup: str
    variant: str
    kernel: str
    policy: str
    baseline: str
    source: str
    metric: str
    level: str
    test: str
    n_baseline: int
    n_policy: int
    estimate: float
    ci_low: float
    ci_high: float
    statistic: float
    p_value: float
    p_floor: float
    seed_min: float
    seed_max: float
    agree: int
    effect_size: float
    effect_name: str


def sign_flip_p(d: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """(p, floor): the two-sided sign-flip permutation p-value of mean(d) = 0 and the least p
    the design can give. Under "no effect" each paired difference is as likely negative as
    positive, so every sign vector is equally likely: p is the share of the 2**n sign vectors
    whose |mean| reaches the observed one (exact up to `EXACT_FLIPS_MAX` replicates, seeded
    Monte Carlo with the identity counted above). Flipping every sign gives the same |mean|,
    so p >= 2 / 2**n."""
    d = np.asarray(d, float)
    n = len(d)
    observed = abs(d.mean())
    if n <= EXACT_FLIPS_MAX:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
        floor = 2.0 / 2**n
    else:
        rng = np.random.default_rng(seed)
        signs = np.vstack([np.ones(n), rng.choice([-1.0, 1.0], size=(MONTE_CARLO_FLIPS, n))])
        floor = 1.0 / len(signs)
    # ties within rounding count as reaching the observed mean
    reach = np.abs(signs @ d) / n >= observed - 1e-12 * max(observed, 1e-300)
    return float(reach.mean()), floor


@lru_cache(maxsize=256)
def _t_critical(df: int, confidence: float) -> float:
    """The two-sided t quantile (cached: the same few degrees of freedom come back often)."""
    return float(sps.t.ppf(0.5 + confidence / 2, df))


def t_interval(d: np.ndarray, confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(low, high, t): the t interval of mean(d) and its t statistic; NaN below 2 values. With
    no spread at all the interval is the point (and t is infinite)."""
    d = np.asarray(d, float)
    n = len(d)
    if n < 2:
        return np.nan, np.nan, np.nan
    mean, se = d.mean(), d.std(ddof=1) / np.sqrt(n)
    if se == 0:
        return mean, mean, (np.inf if mean else np.nan)
    half = _t_critical(n - 1, confidence) * se
    return mean - half, mean + half, mean / se


def _agree(d: np.ndarray, mean: float) -> int:
    return int(np.sum(np.sign(d) == np.sign(mean))) if mean != 0 else 0


def paired_effect(
    policy: np.ndarray, baseline: np.ndarray, ratio: bool, measured: bool = True,
    seed: int = 0,
) -> Effect:
    """The effect of replicates `policy[i]` against `baseline[i]` (paired by index). A ratio
    is analysed on the log scale and reported back on the ratio scale; `measured` False (a
    model's output) gives the estimate and the range over replicates, no CI and no p."""
    policy, baseline = np.asarray(policy, float), np.asarray(baseline, float)
    keep = np.isfinite(policy) & np.isfinite(baseline)
    if ratio:
        keep &= (policy > 0) & (baseline > 0)
    policy, baseline = policy[keep], baseline[keep]
    n = len(policy)
    if n == 0:
        return Effect(0, *(np.nan,) * 8, 0)
    d = np.log(policy / baseline) if ratio else policy - baseline
    back = np.exp if ratio else (lambda x: x)
    mean = float(d.mean())
    low = high = t = p = floor = np.nan
    if measured:
        low, high, t = t_interval(d)
        if n >= 2:
            p, floor = sign_flip_p(d, seed)
    return Effect(n, float(back(mean)), float(back(low)), float(back(high)), p, floor, t,
                  float(back(d.min())), float(back(d.max())), _agree(d, mean))


def load_adjusted(
    d: np.ndarray, load_difference: np.ndarray, confidence: float = CONFIDENCE
) -> tuple[float, float, float, float] | None:
    """(effect, low, high, slope) of the paired effects `d` at equal host load: the intercept
    of d = b + g * (load_policy - load_baseline) by least squares, its t interval (n - 2
    degrees of freedom) and g per unit of load. None where the loads did not differ or fewer
    than 4 pairs: nothing to adjust, or too few degrees of freedom to do it with."""
    d, x = np.asarray(d, float), np.asarray(load_difference, float)
    keep = np.isfinite(d) & np.isfinite(x)
    d, x = d[keep], x[keep]
    n = len(d)
    if n < 4 or np.ptp(x) == 0:
        return None
    design = np.column_stack([np.ones(n), x])
    coef, *_ = np.linalg.lstsq(design, d, rcond=None)
    resid = d - design @ coef
    sigma2 = resid @ resid / (n - 2)
    se = np.sqrt(sigma2 * np.linalg.inv(design.T @ design)[0, 0])
    half = _t_critical(n - 2, confidence) * se
    return float(coef[0]), float(coef[0] - half), float(coef[0] + half), float(coef[1])


def _effects(
    head: tuple, wide: dict[tuple[str, str], np.ndarray], policy: str, baseline: str,
    measured: bool, seed: int,
) -> list[Row]:
    """The rows of one policy against the baseline; `wide`: (runs-table column, policy) ->
    its values over the group's seeds. Seeds where either policy has no value drop out."""

    def values(column: str, who: str) -> np.ndarray:
        return wide[(column, who)]

    out = []
    metrics = [(c, m, True) for c, m in RATIOS.items()] + [
        (c, m, False) for c, m in DIFFERENCES.items()]
    for column, metric, ratio in metrics:
        if (column, policy) not in wide or (column, baseline) not in wide:
            continue
        pol, base = values(column, policy), values(column, baseline)
        eff = paired_effect(pol, base, ratio, measured, seed)
        if eff.n == 0:
            continue  # e.g. no wall clock in a simulation
        test = PAIRED if measured else SEED_RANGE
        out.append(Row(*head, metric, LEVELS[test], test, eff.n, eff.n, eff.estimate,
                       eff.ci_low, eff.ci_high, eff.statistic, eff.p_value, eff.p_floor,
                       eff.seed_min, eff.seed_max, eff.agree, np.nan, ""))
        if not measured or (LOAD, policy) not in wide:
            continue
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.log(pol / base) if ratio else pol - base
        adj = load_adjusted(d, values(LOAD, policy) - values(LOAD, baseline))
        if adj is None:
            continue
        back = np.exp if ratio else (lambda x: x)
        est, lo, hi, slope = adj
        out.append(Row(*head, metric, LEVELS[LOAD_ADJUSTED], LOAD_ADJUSTED, eff.n, eff.n,
                       float(back(est)), float(back(lo)), float(back(hi)), np.nan, np.nan,
                       np.nan, np.nan, np.nan, 0, slope,
                       "slope per unit of load (log ratio)" if ratio else
                       "slope per unit of load"))
    return out


def compare(
    runs: pd.DataFrame,
    baseline: str = schema_default("analysis.baseline"),
    seed: int = schema_default("analysis.seed"),
) -> pd.DataFrame:
    """Every policy against `baseline` within each (setup, variant, kernel): one headline row
    per metric (and a load-sensitivity row where measured runs recorded different loads).
    Runs pair by seed; `runs` has one row per (setup, variant, kernel, policy, seed)."""
    keys = list(GROUP)
    columns = [c for c in (*RATIOS, *DIFFERENCES, LOAD) if c in runs.columns]
    wide = runs.set_index([*keys, "seed", "policy"])[columns].unstack("policy")
    about = runs.groupby(keys, sort=True).agg(
        measured=("source", lambda s: bool((s == "measured").all())),
        label=("label", lambda s: ", ".join(sorted(set(s)))),
        policies=("policy", lambda s: sorted(set(s))),
    )
    rows: list[Row] = []
    for key, block in wide.groupby(level=keys, sort=True):
        info = about.loc[key]
        if baseline not in info["policies"]:
            continue
        arrays = dict(zip(block.columns, block.to_numpy(float).T, strict=True))
        for policy in info["policies"]:
            if policy != baseline:
                rows.extend(_effects((*key, policy, baseline, info["label"]), arrays, policy,
                                     baseline, info["measured"], seed))
    return pd.DataFrame([asdict(r) for r in rows], columns=list(Row.__dataclass_fields__))


def headline(stats: pd.DataFrame) -> pd.DataFrame:
    """The rows the tables and figures show: per comparison and metric, the headline test
    (replicate-level for measured runs, the seed range for a model)."""
    return stats[stats["test"].isin(HEADLINE_TESTS)].reset_index(drop=True)


def describe(row: pd.Series, scale: float = 100.0, unit: str = "%", evidence: bool = True) -> str:
    """'+52.1% [+4.2, +122.0], p=0.25, 3/3 seeds' for a measured row (without the p and the
    seeds unless `evidence`), '+52.1% (seeds +50.2 to +53.9)' for a model row: a ratio as a
    relative change, a difference as is (`scale` and `unit`: percent or percentage points)."""
    offset = 1.0 if row["metric"].endswith("ratio") else 0.0

    def num(x: float) -> str:
        return f"{scale * (x - offset):+.1f}"

    text = f"{num(row['estimate'])}{unit}"
    if row["test"] == SEED_RANGE:
        return text if row["n_policy"] < 2 else (
            f"{text} (seeds {num(row['seed_min'])} to {num(row['seed_max'])})")
    if np.isfinite(row["ci_low"]):
        text += f" [{num(row['ci_low'])}, {num(row['ci_high'])}]"
    if evidence and np.isfinite(row["p_value"]):
        text += f", p={row['p_value']:.2g}"
    if evidence and row["test"] == PAIRED:
        text += f", {int(row['agree'])}/{int(row['n_policy'])} seeds"
    return text


def to_markdown(table: pd.DataFrame) -> str:
    """A readable stats.md: per comparison group its headline rows, then the load-sensitivity
    lines; every row names its test and n."""
    lines = ["# Baseline vs policy", "",
             "One row per comparison and metric at the level of the replicate (a seed's run), "
             "runs paired by seed. Measured: estimate = geometric mean of the per-seed ratios "
             "(throughputs) or mean difference (imbalance), 95% t interval over seeds, exact "
             "two-sided sign-flip p (never below `p_floor` = 2 / 2^seeds), `agree` = seeds on "
             "the estimate's side. Model (simulations): the estimate and the range over "
             "seeds, no CI or p (a prediction has no sampling error). `load-adjusted` rows "
             "are a sensitivity line: the paired effect at equal host load (t interval over "
             "seeds, n - 2 degrees of freedom) and its slope per unit of 1-minute load "
             "average. docs/measurement.md derives the choice.", ""]
    if table.empty:
        return "\n".join([*lines, "No comparison possible: the baseline policy has no runs.", ""])
    columns = ["policy", "metric", "test", "n_policy", "estimate", "ci_low", "ci_high",
               "p_value", "p_floor", "agree", "seed_min", "seed_max"]
    for (setup, variant, kernel), group in table.groupby(list(GROUP), sort=True):
        lines += [f"## {setup} / {variant} / kernel {kernel} ({group['source'].iloc[0]})", ""]
        head = group[group["test"].isin(HEADLINE_TESTS)]
        lines += [head[columns].rename(columns={"n_policy": "seeds"})
                  .to_markdown(index=False, floatfmt=".4g"), ""]
        sens = group[group["test"] == LOAD_ADJUSTED]
        if len(sens):
            shown = sens[["policy", "metric", "n_policy", "estimate", "ci_low", "ci_high",
                          "effect_size"]].rename(columns={"n_policy": "seeds",
                                                          "effect_size": "slope per load"})
            lines += ["Sensitivity: the same effects at equal host load.", "",
                      shown.to_markdown(index=False, floatfmt=".4g"), ""]
    return "\n".join(lines)
