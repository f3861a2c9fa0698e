import numpy as np
import pandas as pd
import pytest

from adaptiveload import metrics

T = np.array([[1.0, 2.0, 4.0], [3.0, 3.0, 3.0]])


def test_imbalance_rate_hand_computed():
    # step 0: (4-1)/4 = 0.75 ; step 1: 0 -> mean 0.375
    assert metrics.imbalance_rate(T) == pytest.approx(0.375)


def test_imbalance_rate_mean_variant():
    # step 0: (4 - 7/3)/4 = 5/12 ; step 1: 0
    assert metrics.imbalance_rate_mean(T) == pytest.approx(5 / 24)


def test_idle_fraction_hand_computed():
    # idle: step0 (3+2+0)=5, step1 0 ; N*sum T = 3*(4+3) = 21
    assert metrics.idle_fraction(T) == pytest.approx(5 / 21)


def test_max_over_mean():
    assert metrics.max_over_mean(T) == pytest.approx((4 / (7 / 3) + 1) / 2)


def test_balanced_is_zero():
    flat = np.full((5, 8), 2.5)
    assert metrics.imbalance_rate(flat) == 0.0
    assert metrics.idle_fraction(flat) == 0.0
    assert metrics.max_over_mean(flat) == 1.0


def test_vram_utilization():
    peak = np.array([[10.0, 20.0], [30.0, 40.0]])
    mean, worst = metrics.vram_utilization(peak, 100.0)
    assert mean == pytest.approx(0.25)
    assert worst == pytest.approx(0.4)


def test_summarize_throughput():
    s = metrics.summarize(T, samples=14, tokens=1400, wall_s=7.0)
    assert s.samples_per_s == pytest.approx(2.0)
    assert s.tokens_per_s == pytest.approx(200.0)
    assert s.steps == 2
    assert set(s.as_dict()) >= {"imbalance_rate", "idle_fraction", "tokens_per_s"}


@pytest.mark.parametrize("bad", [np.zeros((0, 3)), np.ones(4), np.ones((2, 0))])
def test_rejects_bad_shapes(bad):
    with pytest.raises(ValueError):
        metrics.imbalance_rate(bad)


def test_imbalance_cv_hand_computed():
    # step 0: mean 7/3, population var ((4/3)^2 + (1/3)^2 + (5/3)^2)/3 = 42/27; step 1: 0
    cv0 = np.sqrt(42 / 27) / (7 / 3)
    assert metrics.imbalance_cv(T) == pytest.approx(cv0 / 2)


def test_imbalance_definitions_read_the_same_times():
    # one straggler at 2x: range 1/2, max-mean (2 - 5/4)/2 = 3/8, cv sqrt(3)/5, idle 3/8
    t = np.array([[1.0, 1.0, 1.0, 2.0]])
    got = {name: fn(t) for name, (_, fn) in metrics.IMBALANCE_DEFINITIONS.items()}
    assert got == pytest.approx(
        {"range": 0.5, "max-mean": 0.375, "cv": np.sqrt(3) / 5, "idle": 0.375}
    )
    # idle fraction weights steps by their length, the per-step forms do not
    two = np.array([[1.0, 2.0], [10.0, 10.0]])
    assert metrics.idle_fraction(two) == pytest.approx(1 / (2 * 12))
    assert metrics.imbalance_rate_mean(two) == pytest.approx(0.25 / 2)


def test_per_step_formulas_work_on_table_columns():
    # the analysis applies them to a per-step table's columns; the run-level metrics are means
    steps = pd.DataFrame({"max": [4.0, 3.0], "min": [1.0, 3.0], "mean": [7 / 3, 3.0]})
    imbalance = metrics.step_imbalance(steps["max"], steps["min"])
    idle = metrics.step_idle(steps["max"], steps["mean"])
    assert imbalance.tolist() == [0.75, 0.0]
    assert imbalance.mean() == metrics.imbalance_rate(T)
    assert idle.mean() == pytest.approx(metrics.imbalance_rate_mean(T))
    samples_per_s, tokens_per_s = metrics.throughput(
        pd.Series([6, 8]), pd.Series([600, 800]), pd.Series([3.0, 4.0])
    )
    assert samples_per_s.tolist() == [2.0, 2.0] and tokens_per_s.tolist() == [200.0, 200.0]


def test_window_metrics_add_vram_only_where_known():
    peak = np.array([[10.0, 20.0, 30.0], [40.0, 50.0, 60.0]])
    counts = metrics.StepCounts(np.array([6.0, 8.0]), np.array([600.0, 800.0]), np.zeros(2))
    full = metrics.window_metrics(T, counts, 7.0, peak_bytes=peak, capacity_bytes=100.0)
    assert full == {
        **metrics.summarize(T, samples=14, tokens=1400, wall_s=7.0).as_dict(),
        **metrics.batch_spread(counts.samples, counts.tokens),
        "vram_utilization_mean": pytest.approx(0.35),
        "vram_utilization_max": pytest.approx(0.6),
    }
    for peak_bytes, capacity in ((None, 100.0), (peak, None)):
        out = metrics.window_metrics(T, counts, 7.0, peak_bytes, capacity)
        assert "vram_utilization_mean" not in out and out["samples_per_s"] == 2.0


def test_padding_is_reported_beside_throughput_never_in_it():
    # 14 real samples and 6 padding repeats in 7 s: 2 samples/s, 30% of the processed ones padding
    counts = metrics.StepCounts(np.array([6.0, 8.0]), np.array([600.0, 800.0]), np.array([0, 6]))
    out = metrics.window_metrics(T, counts, 7.0)
    assert out["samples_per_s"] == 2.0 and out["tokens_per_s"] == 200.0
    assert out["padding_samples"] == 6 and out["padding_fraction"] == pytest.approx(0.3)


def test_batch_spread_is_population_std_and_range_over_steps():
    out = metrics.batch_spread(np.array([2.0, 4.0, 6.0]), np.array([10.0, 10.0, 40.0]))
    assert out["samples_per_step_mean"] == 4.0
    assert out["samples_per_step_std"] == pytest.approx(np.sqrt(8 / 3))
    assert (out["samples_per_step_min"], out["samples_per_step_max"]) == (2.0, 6.0)
    assert out["tokens_per_step_mean"] == 20.0 and out["tokens_per_step_max"] == 40.0
