"""The closed loop in the model (`planning.closed_loop`): with a wrong prior and a slow rank,
refitting every window brings the plan of the rest of the epoch within a few percent of the
oracle's, where the open loop stays off; the prior's perturbation is what it says; the data
grows with N where the spec gives it per rank."""

from __future__ import annotations

import numpy as np
import pytest

from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError
from adaptiveload.planning.closed_loop import experiment, perturbed, sample_count

SPEC = {
    "num_samples": 10000,
    "manifest_seed": 0,
    "mixtures": ["paper-mixed"],
    "calibrations": ["h200-wan2.1-t2v-1.3b-measured"],
    "prior_errors": [{"p_shift": -0.3, "c0_scale": 0.5}],
    "world_sizes": [16],
    "policies": ["adaptiveload-balanced"],
    "seeds": [0],
    "windows": 4,
    "device": {"slow_every": 16, "slow_speed": 0.8, "noise": 0.05},
}


def test_perturbed_prior_shifts_p_and_scales_c0():
    cal = Calibration.load("h200-wan2.1-t2v-14b")
    tokens = np.array([1560.0, 4680, 9360, 32760, 75600])
    lo, hi = np.percentile(tokens, [5, 95])
    for shift in (0.3, -0.3):
        cost = perturbed(cal.cost, tokens, shift, 2.0)
        got = cost.effective_exponent(lo, hi) - cal.cost.effective_exponent(lo, hi)
        assert got == pytest.approx(shift, abs=1e-9)
        assert cost.c0 == pytest.approx(2 * cal.cost.c0)
        mid = np.sqrt(lo * hi)
        assert cost.per_sample_time(mid) == pytest.approx(cal.cost.per_sample_time(mid))


def test_the_closed_loop_reaches_the_oracle_after_its_first_window():
    (row,) = experiment(SPEC)
    after = row["after_first_window"]
    assert after["closed_s"] <= 1.03 * after["oracle_s"]
    assert after["open_s"] > 1.05 * after["oracle_s"]  # the prior alone stays off
    assert row["windows"] >= 3 and len(row["refits"]) == row["windows"] - 1
    first = row["refits"][0]
    assert first["rel_err_after"] < 0.1 < first["rel_err_before"]
    # the slow rank's factor: shrunk to 1 on a window's few rows, near 0.8 on all of them
    assert 0.8 < first["slowest_rank_speed"] < 0.9
    assert row["refits"][-1]["slowest_rank_speed"] == pytest.approx(0.8, abs=0.03)


def test_samples_per_rank_grows_the_data_with_n_and_num_samples_keeps_it():
    assert [sample_count({"samples_per_rank": 1250}, n) for n in (16, 1024)] == [20000, 1280000]
    assert [sample_count({"num_samples": 20000}, n) for n in (16, 1024)] == [20000, 20000]
    for neither_or_both in ({}, {"samples_per_rank": 1250, "num_samples": 20000}):
        with pytest.raises(UserError, match="samples_per_rank"):
            sample_count(neither_or_both, 16)


def test_each_n_plans_its_own_data_at_paper_scale():
    spec = {k: v for k, v in SPEC.items() if k != "num_samples"}
    rows = experiment({**spec, "samples_per_rank": 150, "world_sizes": [16, 32]})
    assert [(r["world_size"], r["num_samples"]) for r in rows] == [(16, 2400), (32, 4800)]
    # the same samples per rank: epochs of comparable steps at both N
    steps = [r["window_steps"] for r in rows]
    assert max(steps) <= 1.5 * min(steps)
