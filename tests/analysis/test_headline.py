"""The headline tables and the generated blocks, on synthetic recorded runs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from analysis_synth import write_run

from adaptiveload.analysis import headline
from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.errors import UserError


def _runs(root, speedup: float, seeds=range(4)) -> pd.DataFrame:
    index = []
    for seed in seeds:
        index.append(write_run(root, "equal-token", seed, load=2.0 + seed))
        index.append(write_run(root, "adaptiveload", seed, speedup=speedup, spread=0.1,
                               load=3.0))
        for policy, s in (("equal-token", 1.0), ("adaptiveload", 1.5)):
            index.append(write_run(root, policy, seed, setup="sim/h200", source="model",
                                   device="H200", kernel="none", speedup=s, steps=12))
    runs = aggregate(parse_index(index)).runs
    runs["epoch_steps"] = 40.0
    runs["vs_epoch_lower_bound"] = 1.1
    return runs


def _record(root, name: str, runs: pd.DataFrame) -> None:
    (root / name).mkdir(parents=True)
    runs.to_csv(root / name / headline.RUNS_FILE, index=False)


def test_tables_put_measured_first_and_stay_small(tmp_path):
    tables = headline.headline_tables(_runs(tmp_path / "runs", 1.3))
    assert [t.setup for t in tables] == ["train", "sim/h200"]
    measured, model = tables
    assert len(measured.table.columns) <= 8 and len(model.table.columns) <= 8
    assert list(measured.table["policy"]) == ["equal-token", "adaptiveload"]
    fast = measured.table.iloc[1]
    assert fast["speedup"].startswith("×1.") and "[" in fast["speedup"]
    assert fast["p, seeds agreeing"] == "p=0.12, 4/4 seeds"  # 2 / 2**4: the floor
    assert "[" not in model.table.iloc[1]["speedup"]  # a model: no interval
    assert "no sampling error" in model.caption


def test_blocks_fill_and_refuse_what_they_do_not_know(tmp_path):
    root = tmp_path / "records"
    _record(root, "2026-01-01-aaaaaaa", _runs(tmp_path / "a", 1.3))
    text = ("x\n<!-- generated: headline:measured -->\nold\n<!-- end generated -->\n"
            "<!-- generated: findings -->\n<!-- end generated -->\ny\n")
    generated = headline.blocks(root)
    filled = headline.fill(text, generated, "doc")
    assert filled.startswith("x\n<!-- generated: headline:measured -->\n**train**")
    assert "old" not in filled and filled.endswith("<!-- end generated -->\ny\n")
    assert "resolved" in filled and "(model)" in filled
    assert headline.fill(filled, generated, "doc") == filled  # a second fill changes nothing
    assert "second run is recorded" in generated["reruns"]
    with pytest.raises(UserError, match="unknown"):
        headline.fill("<!-- generated: nope -->\n<!-- end generated -->", generated, "doc")


def test_reruns_say_how_far_the_measured_speedups_moved(tmp_path):
    root = tmp_path / "records"
    _record(root, "2026-01-01-aaaaaaa", _runs(tmp_path / "a", 1.3))
    _record(root, "2026-02-01-bbbbbbb", _runs(tmp_path / "b", 1.5))
    line = headline.blocks(root)["reruns"]
    assert "2026-01-01-aaaaaaa, 2026-02-01-bbbbbbb" in line and "(2 runs)" in line
    lo, hi = (float(x) for x in line.split("adaptiveload ×")[1].split(" ")[0].split("–×"))
    assert lo < hi and np.isclose(hi / lo, 1.5 / 1.3, rtol=0.1)


def test_no_record_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no recorded run"):
        headline.blocks(tmp_path)
