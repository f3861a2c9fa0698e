"""Stats on synthetic runs with a planted effect (must be found) and without (must not be)."""

from pathlib import Path

import numpy as np
import pytest
from analysis_synth import planted_runs, write_run

from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.analysis.stats import (
    HIERARCHICAL,
    WITHIN_RUNS,
    cliffs_delta,
    cohens_d,
    compare,
    headline,
    to_markdown,
)
from adaptiveload.errors import UserError


def _stats(tmp_path, planted):

    index = planted_runs(tmp_path, planted=planted)
    agg = aggregate(parse_index(index))
    return compare(agg.runs, agg.steps, n_boot=500, seed=0)


def _get(table, metric, test):
    sel = table[(table.metric == metric) & (table.test == test)]
    assert len(sel) == 1, (metric, test, table[["metric", "test"]])
    return sel.iloc[0]


def test_planted_difference_is_detected(tmp_path):
    table = _stats(tmp_path, planted=True)
    for test in ("Mann-Whitney U", "Welch's t"):
        assert _get(table, "imbalance", test).p_value < 1e-6
        assert _get(table, "step_time_s", test).p_value < 1e-3
    ratio = _get(table, "samples_per_s ratio", "bootstrap 95% CI")
    assert 1.05 < ratio.ci_low < ratio.estimate < ratio.ci_high
    diff = _get(table, "imbalance_rate difference", "bootstrap 95% CI")
    assert diff.ci_high < 0
    assert _get(table, "imbalance", "Mann-Whitney U").effect_size < -0.8  # Cliff's delta
    paired = _get(table, "samples_per_s", "paired t")
    assert paired.n_policy == 3 and paired.estimate > 0
    # resampling seeds too: n counts seeds, and the consistent effect still excludes no change
    ratio_h = _get(table, "samples_per_s ratio", HIERARCHICAL)
    assert ratio_h.n_policy == ratio_h.n_baseline == 3
    assert ratio_h.estimate == ratio.estimate and ratio_h.ci_low > 1.05
    assert _get(table, "imbalance_rate difference", HIERARCHICAL).ci_high < 0
    wall = _get(table, "samples_per_s_wall ratio", HIERARCHICAL)
    assert wall.ci_low > 1.05 and wall.p_value < 0.01


def test_no_difference_is_not_detected(tmp_path):
    table = _stats(tmp_path, planted=False)
    for test in ("Mann-Whitney U", "Welch's t"):
        assert _get(table, "imbalance", test).p_value > 0.01
    ratio = _get(table, "samples_per_s ratio", "bootstrap 95% CI")
    assert ratio.ci_low < 1.0 < ratio.ci_high
    diff = _get(table, "imbalance_rate difference", "bootstrap 95% CI")
    assert diff.ci_low < 0 < diff.ci_high


def test_hierarchical_ci_counts_the_seeds_that_disagree(tmp_path):
    """Faster by 1.3x in two seeds, slower by 1.3x in the third: each run's steps pin its own
    mean (the within-run CI excludes 1), but a third of the seeds say the opposite, so the
    CI over seeds, then steps, spans 1. Every bootstrap row's CI and p-value agree."""

    index = []
    for seed, speedup in ((0, 1.3), (1, 1.3), (2, 1 / 1.3)):
        index.append(write_run(tmp_path, "equal-token", seed))
        index.append(write_run(tmp_path, "adaptiveload", seed, speedup=speedup))
    agg = aggregate(parse_index(index))
    table = compare(agg.runs, agg.steps, n_boot=1000, seed=0)
    within = _get(table, "samples_per_s ratio", WITHIN_RUNS)
    hier = _get(table, "samples_per_s ratio", HIERARCHICAL)
    assert within.estimate == pytest.approx(hier.estimate)
    assert within.n_policy == 3 * (40 - 2) and hier.n_policy == 3
    assert within.ci_low > 1.0 and within.p_value < 0.01
    assert hier.ci_low < 1.0 < hier.ci_high and hier.p_value > 0.2
    assert hier.ci_high - hier.ci_low > 2 * (within.ci_high - within.ci_low)
    boot = table[table.test.isin([WITHIN_RUNS, HIERARCHICAL])]
    for row in boot.itertuples():
        null = 0.0 if row.metric == "imbalance_rate difference" else 1.0
        excludes = row.ci_low > null or row.ci_high < null
        if not 0.04 < row.p_value < 0.06:  # percentile ends and tail shares meet at 0.05
            assert excludes == (row.p_value < 0.05), row
    # the table and figures show the hierarchical rows, one per metric
    shown = headline(table)
    assert set(shown.test) == {HIERARCHICAL}
    assert not shown.duplicated(["policy", "metric"]).any()


def test_whole_epoch_runs_resample_only_the_clock(tmp_path):
    """Steps whose sample counts swing (many short clips in one step, one long clip in the
    next) at the same step time, as balanced dealing makes them. A timed window of a fixed
    number of steps draws which steps it holds, so the samples are resampled with the times;
    a whole epoch holds every sample once, so only the times are. Same files otherwise: the
    estimate is the same, the epoch's CI narrower and clear of 1 (a 1.3x planted speedup)."""

    tables = {}
    for window in ("steps", "epoch"):
        index = []
        for seed in (0, 1, 2):
            for policy, speedup in (("equal-token", 1.0), ("adaptiveload", 1.3)):
                index.append(write_run(tmp_path / window, policy, seed, speedup=speedup,
                                       samples_range=(1, 40), timed_window=window))
        agg = aggregate(parse_index(index))
        assert set(agg.runs["timed_window"]) == {window}
        tables[window] = _get(compare(agg.runs, agg.steps, n_boot=1000, seed=0),
                              "samples_per_s ratio", HIERARCHICAL)
    steps, epoch = tables["steps"], tables["epoch"]
    assert epoch.estimate == pytest.approx(steps.estimate)
    assert epoch.ci_low > 1.0 and epoch.p_value < 0.01
    # here 0.14 wide against 0.24: what is left is the step times' own spread
    assert epoch.ci_high - epoch.ci_low < 0.7 * (steps.ci_high - steps.ci_low)


def test_bootstrap_is_seeded(tmp_path):
    a = _stats(tmp_path, planted=True)
    b = _stats(tmp_path, planted=True)
    assert a.equals(b)
    assert "## train / base / kernel eager" in to_markdown(a)


def test_effect_sizes_on_hand_cases():
    assert cliffs_delta(np.array([3, 4]), np.array([1, 2])) == 1.0
    assert cliffs_delta(np.array([1, 2]), np.array([1, 2])) == 0.0
    x, y = np.array([2.0, 4.0]), np.array([0.0, 2.0])
    assert cohens_d(x, y) == pytest.approx(2 / np.sqrt(2))


def test_bad_summary_names_the_field(tmp_path):
    import json

    index = planted_runs(tmp_path, planted=False, seeds=(0,))
    path = index[0]["summary"]
    data = json.loads(Path(path).read_text())
    del data["policy"]
    Path(path).write_text(json.dumps(data))
    with pytest.raises(UserError, match="policy"):
        aggregate(parse_index(index))
