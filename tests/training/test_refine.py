"""train.refine: a closed-loop training run refits at its windows' ends, runs the replanned
epochs (each sample once per epoch), shows the windows in its table and metrics, and its
logged refits replay every plan it ran."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml
from training_setup import write_experiment

from adaptiveload import experiment
from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.errors import UserError
from adaptiveload.io import write_json
from adaptiveload.planning.replan import Replanner
from adaptiveload.step_table import REFINE_COLUMNS
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import step_metrics
from adaptiveload.training.refine import refine_mode
from adaptiveload.training.session import REFITS, Request, resolve, train

WORLD, EVERY, WARMUP = 3, 2, 1
# a prior far from this CPU (a fixed cost 10x too large, no attention term)
PRIOR = Calibration("wan2.1-micro", "cpu", "model", CostModel(c0=0.1, a=1e-6, b=0.0), p=1.4,
                    m_mem=2048, m_comp=60000, m_tok=2048)


@pytest.fixture(scope="module")
def closed_loop_run(tmp_path_factory):
    """A 2-epoch closed-loop run of the balanced policy on 3 emulated ranks (30 samples)."""
    tmp = tmp_path_factory.mktemp("refine")
    cal = tmp / "prior.json"
    write_json(cal, PRIOR.to_dict())
    exp = write_experiment(
        tmp, data={"num_samples": 30}, steps="epoch", epochs=2, warmup_steps=WARMUP,
        refine={"every": EVERY}, checkpoint_every=1000,
    )
    req = Request(config=exp, policy="adaptiveload-balanced", seed=0, emulate_world_size=WORLD,
                  calibration=cal, out=tmp / "run", progress=False, checkpoint=False)
    train(req)
    return req, tmp / "run"


def test_the_run_executes_the_plans_its_refits_replay(closed_loop_run):
    req, out = closed_loop_run
    table = pd.read_parquet(out / "steps.parquet")
    refits = json.loads((out / REFITS).read_text())
    run = resolve(req)
    builder = prepare_data(run.exp, run.cfg, run.calibration).builder
    replay = Replanner(builder)
    for r in refits:
        replay.switch(r["epoch"], r["step"], Calibration.from_dict(r["calibration"]))
    assert len(refits) >= 3 and any(r["step"] > 0 for r in refits)  # mid-epoch switches
    # every step after the warm-up is the replayed plan's (epoch 0, then 1), rank by rank
    done = WARMUP
    for epoch in (0, 1):
        plan = replay(epoch).table
        real = plan.loc[~plan["is_padding"], "sample_id"]
        assert not real.duplicated().any() and set(real) == set(builder.samples["sample_id"])
        cells = plan.groupby(["step", "rank"])["tokens"].agg(["size", "sum"]).reset_index()
        cells["step"] += done
        ran = table[table["step"].isin(cells["step"])][["step", "rank", "samples", "tokens"]]
        np.testing.assert_array_equal(ran.to_numpy(), cells.to_numpy())
        done += int(plan["step"].max()) + 1
    assert done == int(table["step"].max()) + 1  # the epochs kept their step counts
    assert replay(1).summary["plan_digest"] != builder(1).summary["plan_digest"]


def test_windows_show_in_the_table_metrics_and_summary(closed_loop_run):
    _, out = closed_loop_run
    table = pd.read_parquet(out / "steps.parquet")
    ends = table[table["refit"].notna()]
    timed_steps = sorted(ends["step"].unique())
    assert timed_steps[0] == WARMUP + EVERY - 1 and all(len(g) == WORLD for _, g in
                                                        ends.groupby("step"))
    assert ends[list(REFINE_COLUMNS)].notna().all().all()
    first = ends[ends["step"] == timed_steps[0]]
    # the prior is far off: its first window's error is large, the refit moves it
    assert first["model_error_median"].iat[0] > 0.5 and first["refit_moved"].iat[0] > 0.3
    assert table.loc[table["refit"].isna(), list(REFINE_COLUMNS)].isna().all().all()
    logged = step_metrics(first.to_dict("records"), None, WARMUP)
    assert {"refine/model_error_p90", "refine/refit_c0", "rank2/speed_factor"} <= set(logged)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sim_rel_err_median"] > 0.5  # the prior's error on the plans that ran


def test_refine_forms_and_refusals(tmp_path):
    forms = (False, "off", "epoch", {"every": 3})
    assert [refine_mode(v) for v in forms] == ["off", "off", "epoch", 3]
    for bad in ({"every": 0}, "always", {"every": True}):
        with pytest.raises(UserError, match=r"train\.refine"):
            refine_mode(bad)
    path = write_experiment(tmp_path, refine="off")
    path.write_text(path.read_text().replace("refine: 'off'", "refine: off"))  # YAML's false
    assert yaml.safe_load(path.read_text())["train"]["refine"] is False
    assert experiment.load(path)["train"]["refine"] is False
    assert experiment.load(write_experiment(tmp_path, name="d"))["train"]["refine"] == "off"
    with pytest.raises(UserError):
        experiment.load(write_experiment(tmp_path, name="b", refine={"every": 0}))
    no_calibration = write_experiment(tmp_path, name="n", refine="epoch")
    with pytest.raises(UserError, match="calibration"):
        train(Request(config=no_calibration, policy="adaptiveload-balanced", seed=0,
                      emulate_world_size=WORLD, out=tmp_path / "n", progress=False))
    assert not (tmp_path / "n").exists()  # refused before anything is written
