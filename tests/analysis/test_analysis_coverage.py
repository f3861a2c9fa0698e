"""The suite's own inference (`analysis.stats.compare`) on synthetic replicates whose truth is
known: its 95% intervals cover the truth 95% of the time (within 3 pp, 1,000 comparisons),
its p-values hold their level and never go below what the number of seeds can give, and a
known effect is found at the rate the design states (the t test's power, from the
noncentral t). A return of a bootstrap floor, of step-level resampling or of pooled steps
(intervals too narrow) fails here.

Each synthetic comparison is one `setup` of a runs table: two policies x n seeds, each run's
samples/s = exp(seed effect + policy effect + run noise + load slope x its host load), the
run-to-run noise of the measured default (about 8% per run by thread CPU time, loads 1-8)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import stats as sps

from adaptiveload.analysis.stats import PAIRED, SEED_RANGE, compare

COMPARISONS = 1000
RUN_NOISE = 0.08  # sd of a run's log samples/s around its policy's
LOAD_SLOPE = -0.03  # log samples/s per unit of 1-minute load average


def synthetic_runs(seeds: int, log_effect: float, seed: int, source: str = "measured",
                   noise: float = RUN_NOISE, slope: float = LOAD_SLOPE,
                   comparisons: int = COMPARISONS) -> pd.DataFrame:
    """A runs table of `comparisons` setups, each `seeds` seeds of equal-token and policy."""
    rng = np.random.default_rng(seed)
    shape = (comparisons, seeds)
    seed_effect = rng.normal(0.0, 0.2, shape)  # the data of a seed: shared by both policies
    rows = []
    for policy, shift in (("equal-token", 0.0), ("policy", log_effect)):
        load = rng.uniform(1.0, 8.0, shape)
        log_sps = 3.0 + seed_effect + shift + rng.normal(0.0, noise, shape) + slope * load
        imbalance = 0.5 + 0.5 * shift + rng.normal(0.0, 0.05, shape)
        for c in range(comparisons):
            for s in range(seeds):
                rows.append({"setup": f"rep{c:04d}", "variant": "base", "kernel": "eager",
                             "policy": policy, "seed": s, "source": source, "label": source,
                             "samples_per_s": np.exp(log_sps[c, s]),
                             "tokens_per_s": 100 * np.exp(log_sps[c, s]),
                             "samples_per_s_wall": np.nan, "imbalance_rate": imbalance[c, s],
                             "host_load_mean": load[c, s]})
    return pd.DataFrame(rows)


def _headline(stats: pd.DataFrame, metric: str, comparisons: int = COMPARISONS) -> pd.DataFrame:
    rows = stats[(stats["metric"] == metric) & (stats["test"] == PAIRED)]
    assert len(rows) == comparisons
    return rows


@pytest.mark.parametrize("seeds", [3, 8])
def test_intervals_cover_and_p_holds_its_level_on_aa_data(seeds):
    """Two identical policies: the 95% CIs of the samples/s ratio (truth 1) and of the
    imbalance difference (truth 0) cover within 3 pp; p <= 0.05 in at most 5% + 2 pp of the
    comparisons; no p below the design's floor 2 / 2^seeds."""
    stats = compare(synthetic_runs(seeds, 0.0, seed=seeds))
    for metric, truth in (("samples_per_s ratio", 1.0), ("imbalance_rate difference", 0.0)):
        rows = _headline(stats, metric)
        covered = ((rows["ci_low"] <= truth) & (truth <= rows["ci_high"])).mean()
        assert abs(covered - 0.95) <= 0.03, (metric, covered)
        assert (rows["p_value"] <= 0.05).mean() <= 0.07, metric
        assert (rows["p_value"] >= rows["p_floor"] - 1e-12).all()
        assert np.allclose(rows["p_floor"], 2.0 / 2**seeds)


def test_known_effect_found_at_the_stated_rate_and_covered():
    """A true +20% (log ratio 0.182) with 5 seeds: the CI excludes 1 in the share of
    comparisons the paired t test's power gives (noncentral t, within 3 pp), and covers
    1.2 in 95% (within 3 pp)."""
    seeds, log_effect = 5, np.log(1.2)
    stats = compare(synthetic_runs(seeds, log_effect, seed=11, slope=0.0))
    rows = _headline(stats, "samples_per_s ratio")
    found = (rows["ci_low"] > 1.0).mean()
    sd_d = RUN_NOISE * np.sqrt(2)  # the paired difference of two independent runs
    crit = sps.t.ppf(0.975, seeds - 1)
    ncp = log_effect / (sd_d / np.sqrt(seeds))
    power = sps.nct.sf(crit, seeds - 1, ncp) + sps.nct.cdf(-crit, seeds - 1, ncp)
    assert abs(found - power) <= 0.03, (found, power)
    covered = ((rows["ci_low"] <= 1.2) & (rows["ci_high"] >= 1.2)).mean()
    assert abs(covered - 0.95) <= 0.03, covered


def test_three_seeds_that_agree_give_the_sign_flip_floor_not_less():
    """3 of 3 seeds faster: the exact sign-flip p is 0.25 (the least 3 pairs can give),
    however large the effect; the row says 3 of 3 seeds agree."""
    runs = synthetic_runs(3, np.log(1.5), seed=3, noise=0.01, slope=0.0, comparisons=20)
    rows = _headline(compare(runs), "samples_per_s ratio", comparisons=20)
    assert (rows["agree"] == 3).all() and np.allclose(rows["p_value"], 0.25)
    assert (rows["ci_low"] > 1.0).all()


def test_a_model_carries_no_sampling_statistics():
    """Simulations: the estimate and the range over seeds, no CI and no p-value."""
    stats = compare(synthetic_runs(3, np.log(1.3), seed=5, source="model", comparisons=20))
    assert set(stats["test"]) == {SEED_RANGE}
    assert stats[["ci_low", "ci_high", "p_value"]].isna().all().all()
    ratio = stats[stats["metric"] == "samples_per_s ratio"]
    assert (ratio["seed_min"] <= ratio["estimate"]).all()
    assert (ratio["estimate"] <= ratio["seed_max"]).all()
