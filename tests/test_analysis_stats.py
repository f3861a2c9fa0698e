"""Stats on synthetic runs with a planted effect (must be found) and without (must not be)."""

from pathlib import Path

import numpy as np
import pytest
from analysis_synth import write_experiment

from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.analysis.stats import cliffs_delta, cohens_d, compare, to_markdown
from adaptiveload.errors import UserError


def _stats(tmp_path, planted):
    import json

    index = write_experiment(tmp_path, planted=planted)
    agg = aggregate(parse_index(json.dumps(index)))
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


def test_no_difference_is_not_detected(tmp_path):
    table = _stats(tmp_path, planted=False)
    for test in ("Mann-Whitney U", "Welch's t"):
        assert _get(table, "imbalance", test).p_value > 0.01
    ratio = _get(table, "samples_per_s ratio", "bootstrap 95% CI")
    assert ratio.ci_low < 1.0 < ratio.ci_high
    diff = _get(table, "imbalance_rate difference", "bootstrap 95% CI")
    assert diff.ci_low < 0 < diff.ci_high


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

    index = write_experiment(tmp_path, planted=False, seeds=(0,))
    path = index[0]["summary"]
    data = json.loads(Path(path).read_text())
    del data["policy"]
    Path(path).write_text(json.dumps(data))
    with pytest.raises(UserError, match="policy"):
        aggregate(parse_index(json.dumps(index)))
