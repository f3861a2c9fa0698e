"""The simulator against hand-computed cases, and a world-size sweep."""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest
from planning_data import bucketed
from repo_paths import H200_MEASURED, H200_PRIOR

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.planning.plan import build_plan
from adaptiveload.planning.policies import Budgets
from adaptiveload.planning.simulate import allreduce_seconds, grad_bytes_of, simulate
from adaptiveload.step_table import STEP_COLUMNS

COST = CostModel(c0=1.0, a=0.01, b=1e-4, m_static=10.0, m_tok=1.0, m_seq=0.0)


def hand_table() -> pd.DataFrame:
    """2 ranks, 2 steps: (B, S) = (2, 100) | (1, 200), then (1, 300) | (3, 50)."""
    rows = [(0, 0, 100)] * 2 + [(0, 1, 200)] + [(1, 0, 300)] + [(1, 1, 50)] * 3
    t = pd.DataFrame(rows, columns=["step", "rank", "tokens"])
    t["sample_id"] = [f"s{i}" for i in range(len(t))]
    t["frames"], t["height"], t["width"] = 1, 16, 16
    t["is_padding"] = False
    return t


def test_hand_computed_times_and_metrics():
    # t = 1 + B (0.01 S + 1e-4 S^2): 5, 7 | 13, 3.25; all-reduce 2*(1/2)*1e9 B / 1e9 B/s = 1 s
    sim = simulate(hand_table(), COST, allreduce_gbps=8.0, grad_bytes=1e9, capacity_bytes=1000)
    st = sim.steps
    assert list(st.columns) == list(STEP_COLUMNS)
    np.testing.assert_allclose(st["compute_s"], [5, 7, 13, 3.25])
    np.testing.assert_allclose(st["wait_s"], [2, 0, 0, 9.75])
    np.testing.assert_allclose(st["step_time_s"], [8, 8, 14, 14])
    assert st["samples"].tolist() == [2, 1, 1, 3] and st["tokens"].tolist() == [200, 200, 300, 150]
    np.testing.assert_allclose(st["peak_bytes_model"], [210, 210, 310, 160])
    assert st["peak_bytes"].isna().all() and st["loss"].isna().all()
    s = sim.summary
    assert s["source"] == "model" and s["launch_mode"] == "simulated" and s["world_size"] == 2
    assert s["allreduce_s"] == pytest.approx(1.0)
    assert s["imbalance_rate"] == pytest.approx(np.mean([2 / 7, 9.75 / 13]))
    assert s["idle_fraction"] == pytest.approx(11.75 / 40)
    assert s["samples_per_s"] == pytest.approx(7 / 22)
    assert s["tokens_per_s"] == pytest.approx(850 / 22)
    assert s["vram_utilization_mean"] == pytest.approx(890 / 4000)
    assert s["vram_utilization_max"] == pytest.approx(0.31)


def test_row_order_and_whole_epoch():
    """A prediction covers every step (no warm-up, whatever order the rows come in): the
    window is the whole epoch."""
    s = simulate(hand_table().sample(frac=1.0, random_state=1), COST).summary
    assert s == simulate(hand_table(), COST).summary
    assert s["warmup_steps"] == 0 and s["timed_window"] == "epoch" and s["steps"] == 2


def test_allreduce_and_grad_bytes():
    assert allreduce_seconds(1e9, 1, 100.0) == 0.0
    assert allreduce_seconds(1e9, 4, 8.0) == pytest.approx(1.5)
    cal = Calibration("m", "H200", "model", COST, p=1.5, m_mem=1.0, m_comp=1.0,
                      extra={"num_params": 1_000})
    assert grad_bytes_of(cal) == 4_000
    cal.extra["grad_bytes"] = 2_000
    assert grad_bytes_of(cal) == 2_000
    sim = simulate(hand_table(), cal, allreduce_gbps=8e-6)  # 1e3 B/s: 2000 B -> 2 s at N=2
    assert sim.summary["allreduce_s"] == pytest.approx(2.0)
    assert sim.summary["device"] == "H200"


def test_world_size_sweep_is_fast():
    df = bucketed(20_000, seed=2)
    cost = CostModel(c0=0.02, a=1.5e-5, b=1e-9)
    bud = Budgets(m_mem=65_520, m_comp=32_760**1.4, p=1.4)
    start = time.perf_counter()
    imbalance = {}
    for n in (8, 16, 64, 256, 1024):
        plan = build_plan(df, "adaptiveload", bud, n, seed=0)
        imbalance[n] = simulate(plan.table, cost, world_size=n).summary["imbalance_rate"]
    assert time.perf_counter() - start < 15  # generous for a shared 2-core machine
    assert imbalance[1024] > imbalance[8]  # more ranks, larger spread per step


def test_a_pack_costs_what_its_samples_cost():
    """A cell of several shapes (a pack): n, sum S, sum S^2 price it (CostModel.pack_time);
    its row reports the largest sample's shape; the step's lower bound is the costliest
    sample or the average, plus c0."""
    t = pd.DataFrame(
        {"step": 0, "rank": [0, 0, 1], "tokens": [100, 300, 200],
         "frames": [1, 5, 1], "height": [16, 32, 16], "width": [16, 48, 32]}
    )
    t["sample_id"], t["is_padding"] = ["a", "b", "c"], False
    sim = simulate(t, COST, capacity_bytes=1000)
    st = sim.steps
    # t = 1 + 0.01 * 400 + 1e-4 * (100^2 + 300^2) = 15 | 1 + 0.01 * 200 + 1e-4 * 200^2 = 7
    np.testing.assert_allclose(st["compute_s"], [15, 7])
    assert st["samples"].tolist() == [2, 1] and st["tokens"].tolist() == [400, 200]
    assert st["tokens_sq"].tolist() == [100_000, 40_000]
    assert st[["frames", "height", "width"]].values.tolist() == [[5, 32, 48], [1, 16, 32]]
    np.testing.assert_allclose(st["peak_bytes_model"], [410, 210])
    # per-sample work 2, 12, 6: max(20 / 2, 12) + c0 = 13
    assert sim.summary["lower_bound_s"] == pytest.approx(13.0)
    assert sim.summary["vs_lower_bound"] == pytest.approx(15 / 13)


def test_homogeneous_cells_price_as_before():
    """One shape per cell: the cost of the set is t(B, S), so plans of the homogeneous
    policies (and their plan files) simulate as they did."""
    df = bucketed(2_000, seed=3)
    bud = Budgets(m_tok=60_000, m_mem=60_000, m_comp=60_000**1.4, p=1.4)
    table = build_plan(df, "adaptiveload", bud, 8, seed=0).table
    table.attrs = {}  # a plan file from elsewhere: no summary attached
    st = simulate(table, COST, world_size=8).steps
    cells = table.groupby(["step", "rank"])["tokens"].agg(["size", "first"])
    expect = COST.step_time(cells["size"].to_numpy(), cells["first"].to_numpy())
    np.testing.assert_allclose(st["compute_s"], expect, rtol=1e-12)
    np.testing.assert_array_equal(st["tokens_sq"], cells["size"] * cells["first"] ** 2)




def test_padding_repeats_cost_time_but_are_not_throughput():
    """A heavily padded plan: the repeats are priced (the ranks run them) but samples/s and
    tokens/s count each real sample once; the repeats are reported beside them."""
    t = hand_table()
    t.loc[t["step"] == 1, "is_padding"] = True  # step 1 repeats 4 samples of 450 tokens
    sim = simulate(t, COST, allreduce_gbps=8.0, grad_bytes=1e9)
    st, s = sim.steps, sim.summary
    np.testing.assert_allclose(st["compute_s"], [5, 7, 13, 3.25])  # priced as before
    assert st["padding_samples"].tolist() == [0, 0, 1, 3]
    assert st["padding_tokens"].tolist() == [0, 0, 300, 150]
    assert s["samples_per_s"] == pytest.approx(3 / 22)
    assert s["tokens_per_s"] == pytest.approx(400 / 22)
    assert s["padding_samples"] == 4 and s["padding_fraction"] == pytest.approx(4 / 7)
    assert s["epoch_steps"] == 2
    assert (s["samples_per_step_mean"], s["samples_per_step_std"]) == (1.5, 1.5)
    assert (s["tokens_per_step_min"], s["tokens_per_step_max"]) == (0, 400)


def test_554_samples_on_1000_ranks_count_554_real_samples_per_policy():
    """Few samples on many ranks: every policy trains on the same 554 samples, however many
    repeats fill its one step, so samples/s compares the step times alone. Counting the
    repeats (equal-token's thousands against packed's hundreds) once made the packed plan,
    whose step is the shortest, look ~65% slower."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.mixtures import synthesize
    from adaptiveload.planning.compare import CompareConfig, compare_policies

    cal = Calibration.load(H200_PRIOR)
    samples = bucketize(synthesize("paper-mixed", 554, seed=0))
    rows = compare_policies(samples, CompareConfig(cal, 1000))
    by = {r["policy"]: r for r in rows}
    for r in rows:
        wall = 554 / r["predicted_samples_per_s"]
        assert r["num_planned"] == 554 and r["steps"] == 1
        # 1,000 ranks pad 554 samples; 250 groups of 4 (sp-fixed, 12 heads) need no padding
        groups = r.get("sp_max_degree", 1) > 1 and r["policy"] == "adaptiveload-sp-fixed"
        assert r["predicted_padding_samples"] == r["num_padding"]
        assert (r["num_padding"] > 0) != groups
        assert r["predicted_padding_fraction"] == pytest.approx(
            r["num_padding"] / (554 + r["num_padding"])
        )
        assert r["samples_per_step_mean"] == 554 and r["samples_per_step_std"] == 0
        assert wall > 0
    packed, equal = by["adaptiveload-packed"], by["equal-token"]
    assert equal["num_padding"] > 5 * packed["num_padding"]  # what the old count rewarded
    assert packed["samples_per_s_vs_first"] > 0  # its step is shorter for the same samples


def test_memory_beyond_the_measured_points_is_counted_and_warned():
    """A plan through the measured H200 calibration (memory measured up to 65,520 tokens per
    micro-batch): the summary names its largest micro-batch and counts those beyond."""
    from adaptiveload.planning.plan import plan_warnings

    cal = Calibration.load(H200_MEASURED)
    assert cal.measured_memory_tokens == 65_520
    bud = Budgets.resolve(calibration=cal)
    plan = build_plan(bucketed(600, seed=5), "adaptiveload", bud, 8, 0, cost_model=cal)
    s, cells = plan.summary, plan.simulation.steps
    assert s["max_micro_batch_tokens"] == cells["tokens"].max() > 65_520
    assert s["max_micro_batch_bytes_model"] == pytest.approx(cells["peak_bytes_model"].max())
    assert s["memory_measured_tokens"] == 65_520
    assert s["micro_batches_beyond_measured_memory"] == int((cells["tokens"] > 65_520).sum()) > 0
    warned = [w for w in plan_warnings(s) if "measured memory" in w]
    assert len(warned) == 1 and str(s["micro_batches_beyond_measured_memory"]) in warned[0]
    prior = Calibration.load(H200_PRIOR)
    unmeasured = build_plan(bucketed(600, seed=5), "adaptiveload", bud, 8, 0, cost_model=prior)
    assert unmeasured.summary["micro_batches_beyond_measured_memory"] is None
    assert not [w for w in plan_warnings(unmeasured.summary) if "measured memory" in w]
