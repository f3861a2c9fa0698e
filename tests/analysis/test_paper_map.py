"""The paper map: its design, the consistency and tornado logic on planted points, and a tiny
real sweep through the CLI into the figure and the paper table."""


import numpy as np
import pandas as pd
import pytest
from analysis_synth import MAP_CENTRE

from adaptiveload.analysis import paper_map as pm
from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.planning import paper_map as pmap


def test_design_is_one_axis_at_a_time_plus_the_factorial():
    spec = {"centre": MAP_CENTRE,
            "axes": {"world_size": [4, 8], "dealing": ["open-sora", "sorted"]},
            "factorial": {"m_comp_scale": [1.0, 2.0], "reference": ["heaviest", "median"]}}
    points = pmap.design(spec)
    centre = pmap.Point(**MAP_CENTRE)
    assert set(points[centre]) == {"centre", "oat:world_size", "oat:dealing", "factorial",
                                   *[f"oat:{a}" for a in pmap.AXES]}
    assert len(points) == 1 + 1 + 1 + 3  # centre, N=8, sorted, 3 new factorial corners
    corner = pmap.Point(**{**MAP_CENTRE, "m_comp_scale": 2.0, "reference": "median"})
    assert points[corner] == ["factorial"]
    with pytest.raises(UserError, match="dealing"):
        pmap.design({"centre": {**MAP_CENTRE, "dealing": "lpt"}, "axes": {}})


def _planted(rows):
    """Points with given numbers; axes vary so every row is its own setting."""
    absolute = {f"{role}_{k}": v for role in ("baseline", "adaptiveload") for k, v in
                (("vram_utilization", 0.5), ("samples_per_s", 1.0), ("tokens_per_s", 9.0),
                 ("idle_fraction", 0.2))}
    return pd.DataFrame([{**MAP_CENTRE, "world_size": 4 + i, "definition": "range",
                          "designs": "factorial", "source": "model (planted)", "seeds": 1,
                          **absolute, **dict(zip(pm.PAPER, r, strict=True))}
                         for i, r in enumerate(rows)])


def test_consistency_needs_all_four_numbers_within_tolerance():
    pts = _planted([
        (0.39, 0.189, 0.227, 0.272),  # the paper itself
        (0.43, 0.15, 0.19, 0.31),  # every number 3.8..4 pp off
        (0.39, 0.189, 0.227, 0.33),  # throughput 5.8 pp off
        (0.80, 0.70, 0.10, 0.20),
    ])
    dev = pm.deviation_pp(pts)
    assert dev.loc[2, "throughput_change"] == pytest.approx(5.8)
    assert list(pm.consistent(pts, 5.0)) == [True, True, False, False]
    assert list(pm.consistent(pts, 6.0)) == [True, True, True, False]
    reg = pm.region(pts, 5.0)
    assert reg["consistent"] == 2 and reg["settings"] == 4 and reg["rows"] == 4
    assert reg["within_tolerance_per_number"]["throughput_change"] == 2
    assert reg["axis_values"]["world_size"] == ["4", "5"]
    assert reg["number_ranges"]["baseline_imbalance"] == pytest.approx([0.39, 0.43])
    assert [s["world_size"] for s in reg["consistent_settings"]] == [4, 5]  # closest first


def test_no_consistent_setting_reports_the_nearest():
    pts = _planted([(0.80, 0.70, 0.10, 0.20), (0.45, 0.25, 0.20, 0.25)])
    reg = pm.region(pts, 5.0)
    assert reg["consistent"] == 0 and reg["consistent_settings"] == []
    assert reg["nearest"][0]["world_size"] == 5
    assert reg["nearest"][0]["worst_pp"] == pytest.approx(6.1)
    rows = pm.paper_table_rows({"region": reg})
    assert list(rows["policy"]) == ["equal-token", "adaptiveload"]
    assert rows["setup"].str.startswith("nearest to the paper").all()


def test_tornado_ranks_axes_by_how_far_they_move_each_number():
    rows = []
    for axis, values, effect in (("world_size", [4, 8, 16], 0.01),
                                 ("dealing", list(pmap.DEALINGS), 0.3)):
        for k, value in enumerate(values):
            rows.append({**MAP_CENTRE, axis: value, "definition": "range",
                         "designs": f"oat:{axis}", "baseline_imbalance": 0.5 + effect * k,
                         "adaptiveload_imbalance": 0.4, "vram_change": 0.1,
                         "throughput_change": 0.2 - effect * k})
    torn = pm.tornado(pd.DataFrame(rows))
    base = torn[torn["number"] == "baseline_imbalance"]
    assert list(base["axis"]) == ["dealing", "world_size"]
    assert base.iloc[0]["span"] == pytest.approx(0.6)
    assert (base.iloc[0]["low_at"], base.iloc[0]["high_at"]) == ("open-sora", "balanced")
    assert "adaptiveload_imbalance" not in set(torn["number"])  # nothing moves it


def test_centre_budgets_are_the_calibration_files_own():
    """At the centre (the manifest the calibration was derived on, heaviest reference) the
    map's per-point budgets are exactly the file's: the sweep applies the same rules."""
    cal = Calibration.load(MAP_CENTRE["calibration"])
    tokens = bucketize(synthesize("paper-mixed", 20_000, 0), grid="wan").samples["tokens"]
    b = pmap.point_budgets(cal, tokens.to_numpy(np.float64), "heaviest", 1.0)
    assert b["p"] == pytest.approx(cal.p) and b["m_mem"] == pytest.approx(cal.m_mem)
    assert b["m_comp"] == pytest.approx(cal.m_comp) and b["m_tok"] == pytest.approx(cal.m_tok)
    half = pmap.point_budgets(cal, tokens.to_numpy(np.float64), "median", 0.5)
    assert half["ref_tokens"] < b["ref_tokens"] and half["m_mem"] == pytest.approx(b["m_mem"])
