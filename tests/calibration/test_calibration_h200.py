"""The cost model on measured H200 points (tests/fixtures/h200-2026-11-30/, copies of
results/reference/h200/2026-11-30/): leave-one-out error, agreement of two calibrations of the
same device, and that the collapse of the first run cannot happen silently again.

`pytest -s` prints the numbers (measured on an NVIDIA H200, refitted here)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from repo_paths import H200_GRID7, H200_MEASURED, H200_RUNS, ROOT

from adaptiveload.calibration.files import refit
from adaptiveload.calibration.fit import _problems, fit, fit_measured
from adaptiveload.calibration.mix import mixture_token_mix
from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError


@pytest.fixture(scope="module")
def mix():
    return mixture_token_mix("paper-mixed", 20000, seed=0, grid="wan")


@pytest.fixture(scope="module")
def refits(mix):
    return {name: refit([path], mix) for name, path in H200_GRID7.items()}


def test_leave_one_out_error_on_the_measured_h200_points(refits):
    for name, cal in refits.items():
        fit_ = cal.extra["fit"]
        print(
            f"\n{name}: form {fit_['form']}, leave-one-out |pred-meas|/meas median "
            f"{100 * fit_['loo_median']:.2f}% max {100 * fit_['loo_max']:.2f}% over "
            f"{fit_['num_points']} points (measured H200, model refit)"
        )
        assert fit_["form"] == "floored" and fit_["num_points"] == 11
        assert fit_["loo_median"] <= 0.05
        assert fit_["loo_max"] <= 0.15
        # the floor is what the small batches show: B = 2 x 1,560 tokens no slower than B = 1
        assert 0.25 < cal.cost.t_floor < 0.32


def test_two_calibrations_of_one_h200_agree(refits):
    run2, run3 = refits["run2"], refits["run3"]
    print(
        f"\np: run2 {run2.p:.4f} run3 {run3.p:.4f} (diff {abs(run2.p - run3.p):.4f}); M_mem: "
        f"run2 {run2.m_mem:.0f} run3 {run3.m_mem:.0f} tokens (measured H200, model refit)"
    )
    assert abs(run2.p - run3.p) <= 0.05
    assert abs(run2.m_mem / run3.m_mem - 1) <= 0.05
    assert 1.0 < run2.p < 2.0 and run2.cost.a > 0 and run2.cost.b > 0


def test_the_old_collapse_is_caught_and_the_floored_form_does_not_collapse(mix):
    """run1's grid: the four-term NNLS gave a = 0 (p = 2); its checks now name the problem."""
    data = json.loads((H200_RUNS / "run1-calibration-grid5.json").read_text())
    ok = [p for p in data["points"] if p["status"] == "ok"]
    B, S = (np.array([p[k] for p in ok], float) for k in ("batch", "tokens"))
    T = np.array([min(p["wall_s_passes"]) for p in ok])
    collapsed, _ = fit(B, S, T)
    assert collapsed.a == 0
    problems = _problems(collapsed, "three-term", B, S, None, ("a", "b"), 0.25)
    assert any("linear term a pinned at 0" in p and "add B = 1 points" in p for p in problems)
    cal = refit([H200_RUNS / "run1-calibration-grid5.json"], mix)
    assert cal.extra["fit"]["form"] == "floored" and cal.cost.a > 0
    assert 1.2 < cal.p < 1.5
    assert any("largest bucket" in note for note in cal.extra["notes"])


def test_a_grid_without_enough_sizes_is_refused_with_the_points_to_add():
    B, S = np.array([1, 2, 1, 2]), np.array([1560, 1560, 32760, 32760])
    T = np.array([0.28, 0.28, 2.8, 5.6])
    with pytest.raises(UserError, match="add B = 1 points at more token sizes"):
        fit_measured(B, S, T)
    # a fit that a left-out point contradicts is refused, naming the point
    S = np.array([1560, 3120, 7200, 16380, 32760, 50400, 1560, 16380])
    B = np.array([1, 1, 1, 1, 1, 1, 2, 2])
    T = np.array([0.28, 0.28, 0.44, 1.07, 9.0, 5.5, 0.28, 2.06])  # 32,760 is off by 3x
    with pytest.raises(UserError, match=r"leave-one-out error .* at point \(B=1, S="):
        fit_measured(B, S, T)


def test_shipped_measured_calibration_is_the_refit_of_both_runs(mix):
    shipped = Calibration.load(H200_MEASURED)
    assert shipped.source == "measured" and shipped.device == "cuda:NVIDIA H200"
    refs = [r["file"] for r in shipped.extra["provenance"]["refit_of"]]
    grid7 = H200_GRID7.values()
    assert refs == [f"results/reference/h200/2026-11-30/grid7/{p.name}" for p in grid7]
    for ref in refs:
        assert (ROOT / ref).exists()
    fresh = refit([ROOT / r for r in refs], mix)
    for name in ("p", "m_mem", "m_comp", "m_tok"):
        assert getattr(fresh, name) == pytest.approx(getattr(shipped, name), rel=1e-6), name
    assert shipped.cost.t_floor > 0 and shipped.extra["fit"]["loo_max"] <= 0.15
