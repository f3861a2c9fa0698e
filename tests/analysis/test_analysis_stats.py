"""Stats on synthetic runs written as the trainer writes them (aggregated from their files):
a planted effect is found, none is not, a seed that disagrees widens the interval, and the
inference rests on runs, never on steps."""

from pathlib import Path

import numpy as np
import pytest
from analysis_synth import planted_runs, write_run

from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.analysis.stats import (
    LOAD_ADJUSTED,
    PAIRED,
    compare,
    describe,
    headline,
    load_adjusted,
    paired_effect,
    sign_flip_p,
    to_markdown,
)
from adaptiveload.errors import UserError


def _stats(tmp_path, planted, seeds=(0, 1, 2)):
    index = planted_runs(tmp_path, planted=planted, seeds=seeds)
    return compare(aggregate(parse_index(index)).runs)


def _get(table, metric, test=PAIRED):
    sel = table[(table.metric == metric) & (table.test == test)]
    assert len(sel) == 1, (metric, test, table[["metric", "test"]])
    return sel.iloc[0]


def test_planted_difference_is_detected_at_what_the_seeds_allow(tmp_path):
    """A planted speedup and imbalance cut in all 5 seeds: both intervals exclude no change,
    every seed agrees, and the p-value is the sign-flip floor of 5 pairs (2/32), not less."""
    table = _stats(tmp_path, planted=True, seeds=range(5))
    ratio = _get(table, "samples_per_s ratio")
    assert ratio.n_policy == ratio.n_baseline == 5
    assert 1.05 < ratio.ci_low < ratio.estimate < ratio.ci_high
    assert ratio.agree == 5 and ratio.p_value == pytest.approx(2 / 32)
    assert ratio.p_floor == pytest.approx(2 / 32)
    assert _get(table, "imbalance_rate difference").ci_high < 0
    assert _get(table, "samples_per_s_wall ratio").ci_low > 1.05


def test_no_difference_is_not_detected(tmp_path):
    table = _stats(tmp_path, planted=False)
    ratio = _get(table, "samples_per_s ratio")
    assert ratio.ci_low < 1.0 < ratio.ci_high and ratio.p_value > 0.2
    diff = _get(table, "imbalance_rate difference")
    assert diff.ci_low < 0 < diff.ci_high


def test_a_seed_that_disagrees_is_counted(tmp_path):
    """Faster by 1.3x in two seeds, slower by 1.3x in the third: each run's own steps pin its
    mean, but the replicate is the run, so the interval spans 1, 2 of 3 seeds agree and the
    sign-flip p is 0.75."""
    index = []
    for seed, speedup in ((0, 1.3), (1, 1.3), (2, 1 / 1.3)):
        index.append(write_run(tmp_path, "equal-token", seed))
        index.append(write_run(tmp_path, "adaptiveload", seed, speedup=speedup))
    ratio = _get(compare(aggregate(parse_index(index)).runs), "samples_per_s ratio")
    assert ratio.ci_low < 1.0 < ratio.ci_high
    assert ratio.agree == 2 and ratio.p_value == pytest.approx(0.75)
    assert ratio.estimate == pytest.approx(1.3 ** (1 / 3), rel=0.05)  # geometric mean


def test_the_estimate_is_the_geometric_mean_of_paired_ratios():
    eff = paired_effect(np.array([2.0, 8.0]), np.array([1.0, 2.0]), ratio=True)
    assert eff.estimate == pytest.approx(np.sqrt(2 * 4))
    assert (eff.seed_min, eff.seed_max, eff.agree, eff.n) == (2.0, 4.0, 2, 2)
    d = np.log([2.0, 4.0])
    half = 12.706204736 * d.std(ddof=1) / np.sqrt(2)  # t(0.975, 1)
    assert eff.ci_low == pytest.approx(np.exp(d.mean() - half))
    diff = paired_effect(np.array([0.2, 0.3]), np.array([0.5, 0.5]), ratio=False)
    assert diff.estimate == pytest.approx(-0.25)


def test_sign_flip_p_enumerates_every_sign_vector():
    """[1, 2, 3]: of the 8 sign vectors, |mean| >= 2 only for all + and all -: p = 2/8. A
    zero effect has p = 1; 20 pairs go to the seeded Monte Carlo, still >= its floor."""
    assert sign_flip_p(np.array([1.0, 2.0, 3.0])) == (0.25, 0.25)
    assert sign_flip_p(np.array([1.0, -1.0]))[0] == 1.0
    # [3, -1, 1]: |mean| >= 1 for (+,+,+) (-,-,-) (+,+,-) (-,-,+) (+,-,+) (-,+,-): 6/8
    assert sign_flip_p(np.array([3.0, -1.0, 1.0]))[0] == pytest.approx(0.75)
    p, floor = sign_flip_p(np.full(20, 0.5), seed=1)
    assert floor == pytest.approx(1 / (2**16 + 1)) and floor <= p < 1e-3
    assert sign_flip_p(np.full(20, 0.5), seed=1) == (p, floor)


def test_load_adjustment_removes_a_planted_load_effect():
    """Paired effects that are all load (0.05 per unit of load difference) plus a true 0.1:
    the adjusted effect is 0.1, the slope 0.05; equal loads adjust nothing."""
    x = np.array([-3.0, -1.0, 0.0, 2.0, 4.0])
    est, lo, hi, slope = load_adjusted(0.1 + 0.05 * x, x)
    assert est == pytest.approx(0.1) and slope == pytest.approx(0.05)
    assert lo == pytest.approx(0.1) and hi == pytest.approx(0.1)
    assert load_adjusted(np.ones(5), np.zeros(5)) is None
    assert load_adjusted(np.ones(3), x[:3]) is None  # 1 degree of freedom: not enough


def test_load_sensitivity_rows_follow_the_runs_loads(tmp_path):
    """Runs written with their host load: a load-adjusted row per metric beside the
    headline; the tables show only the headline."""
    index = []
    for seed in range(5):
        index.append(write_run(tmp_path, "equal-token", seed, load=1.0 + seed))
        index.append(write_run(tmp_path, "adaptiveload", seed, speedup=1.3, load=5.0 - seed))
    table = compare(aggregate(parse_index(index)).runs)
    assert _get(table, "samples_per_s ratio", LOAD_ADJUSTED).n_policy == 5
    assert set(headline(table)["test"]) == {PAIRED}
    assert "Sensitivity" in to_markdown(table)


def test_the_same_runs_give_the_same_table(tmp_path):
    a = _stats(tmp_path, planted=True)
    b = _stats(tmp_path, planted=True)
    assert a.equals(b)
    md = to_markdown(a)
    assert "## train / base / kernel eager" in md
    row = _get(a, "samples_per_s ratio")
    assert describe(row).endswith(f"p={row.p_value:.2g}, 3/3 seeds")


def test_bad_summary_names_the_field(tmp_path):
    import json

    index = planted_runs(tmp_path, planted=False, seeds=(0,))
    path = index[0]["summary"]
    data = json.loads(Path(path).read_text())
    del data["policy"]
    Path(path).write_text(json.dumps(data))
    with pytest.raises(UserError, match="policy"):
        aggregate(parse_index(index))
