"""The closed loop's plans (planning.replan): a refit mid-epoch replans the remaining samples,
each once, in the remaining steps; the state and the logged calibrations replay every plan;
the sampler's observe/refine replan what it has not handed out yet."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from planning_data import SHAPES, bucketed

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.planning.policies import Budgets
from adaptiveload.planning.replan import Replanner, cost_digest
from adaptiveload.planning.sampler import PlanBatchSampler, PlanBuilder, PlanWarning

WORLD = 4
BUDGETS = Budgets(m_tok=40_000, m_mem=40_000, m_comp=40_000**1.5, p=1.5)
# the prior the plans start from, and the device the rows are "measured" on: another c0 and
# attention term, rank 1 at 0.7x speed
PRIOR = Calibration(
    "wan2.1-1.3b",
    "cpu",
    "model",
    CostModel(c0=0.05, a=2e-6, b=1e-11),
    p=1.5,
    m_mem=40_000,
    m_comp=40_000**1.5,
    m_tok=40_000,
)
TRUTH = CostModel(c0=0.5, a=2e-6, b=8e-11)
SPEEDS = np.array([1.0, 0.7, 1.0, 1.0])
COST_POLICIES = ["adaptiveload", "adaptiveload-balanced", "adaptiveload-packed"]


@pytest.fixture(scope="module")
def samples() -> pd.DataFrame:
    return bucketed(300, seed=3, shapes=SHAPES[SHAPES[:, 2] < 1280])  # each within budgets


def measured(table: pd.DataFrame, steps: range) -> pd.DataFrame:
    """The rows a device of cost TRUTH and speeds SPEEDS measures for `steps` of a plan."""
    part = table[table["step"].isin(steps)]
    cells = (
        part.groupby(["step", "rank"])["tokens"]
        .agg(samples="size", tokens="sum", tokens_sq=lambda s: int((s.astype(np.int64) ** 2).sum()))
        .reset_index()
    )
    cells["compute_s"] = TRUTH.pack_time(cells["samples"], cells["tokens"], cells["tokens_sq"])
    cells["compute_s"] /= SPEEDS[cells["rank"].to_numpy()]
    return cells


def real_ids(table: pd.DataFrame) -> pd.Series:
    return table.loc[~table["is_padding"], "sample_id"]


@pytest.mark.parametrize("policy", COST_POLICIES)
def test_a_refit_mid_epoch_replans_the_rest_each_sample_once(samples, policy):
    replanner = Replanner(PlanBuilder(samples, policy, BUDGETS, WORLD, 1, cost_model=PRIOR))
    before = replanner(0)
    steps = int(before.table["step"].max()) + 1
    k = steps // 3
    replanner.observe(measured(before.table, range(k)))
    made = replanner.refine(0, k)
    after = replanner(0)
    assert made.replanned and made.rows == k * WORLD
    # the steps run keep their batches; the epoch keeps its length
    head = after.table[after.table["step"] < k].reset_index(drop=True)
    pd.testing.assert_frame_equal(
        head[["step", "rank", "sample_id"]],
        before.table.loc[before.table["step"] < k, ["step", "rank", "sample_id"]].reset_index(
            drop=True
        ),
    )
    assert int(after.table["step"].max()) + 1 == steps
    # every sample of the epoch exactly once over the switch
    ids = real_ids(after.table)
    assert not ids.duplicated().any() and set(ids) == set(samples["sample_id"])
    # the plan names the coefficients it was planned with
    assert after.summary["refits"] == [{"step": k, "cost_digest": cost_digest(made.calibration)}]
    assert after.summary["plan_digest"] != before.summary["plan_digest"]
    assert made.calibration.cost.c0 > PRIOR.cost.c0  # it learned the larger fixed cost


def test_a_switch_to_a_slow_rank_shifts_work_off_it(samples):
    """The rest of the epoch is dealt with the switch's speed factors: rank 1 (0.7x) gets
    cheaper micro-batches in the replanned steps than in the open-loop plan's same steps."""
    replanner = Replanner(
        PlanBuilder(samples, "adaptiveload-balanced", BUDGETS, WORLD, 1, cost_model=PRIOR)
    )
    before = replanner(0).table
    k = 2
    slow = replace(PRIOR, cost=TRUTH, extra={"rank_speeds": SPEEDS.tolist()})
    assert replanner.switch(0, k, slow).replanned
    after = replanner(0).table

    def share(table: pd.DataFrame) -> float:  # rank 1's part of the work after step k
        cells = measured(table, range(k, int(table["step"].max()) + 1))
        work = (cells["compute_s"] * SPEEDS[cells["rank"]]).groupby(cells["rank"]).sum()
        return float(work[1] / work.sum())

    assert share(after) < share(before)


def test_state_and_logged_calibrations_replay_every_plan(samples):
    builder = PlanBuilder(samples, "adaptiveload-packed", BUDGETS, WORLD, 2, cost_model=PRIOR)
    run = Replanner(builder)
    first = run(0).table
    run.observe(measured(first, range(2)))
    run.refine(0, 2)
    run.observe(measured(run(0).table, range(2, 4)))
    run.refine(0, 4)
    run.observe(measured(run(0).table, range(4, int(first["step"].max()) + 1)))
    run.refine(0, 10**6)  # the epoch's end: the next epoch from step 0
    digests = [run(e).summary["plan_digest"] for e in (0, 1)]
    assert run.switches[-1].epoch == 1 and run.switches[-1].step == 0

    resumed = Replanner(builder)
    resumed.load_state_dict(run.state_dict())
    assert [resumed(e).summary["plan_digest"] for e in (0, 1)] == digests

    replayed = Replanner(builder)
    for s in run.switches:  # what refits.json holds, through its JSON form
        replayed.switch(s.epoch, s.step, Calibration.from_dict(s.to_dict()["calibration"]))
    assert [replayed(e).summary["plan_digest"] for e in (0, 1)] == digests

    state = run.state_dict()
    state["rows"]["compute_s"][0] *= 3  # rows that do not give the saved refit
    with pytest.raises(ValueError, match="other coefficients"):
        Replanner(builder).load_state_dict(state)


def test_sampler_observe_and_refine_replan_what_it_has_not_handed_out(samples):
    builder = PlanBuilder(samples, "adaptiveload-balanced", BUDGETS, WORLD, 4, cost_model=PRIOR)
    open_loop = builder(0).table
    replanner = Replanner(builder)
    samplers = [PlanBatchSampler(replanner, r) for r in range(WORLD)]
    passes = [iter(s) for s in samplers]
    got: list[int] = []
    for step in range(int(open_loop["step"].max()) + 1):
        batches = [next(p) for p in passes]
        assert {b.info.step for b in batches} == {step}
        got += [i for b in batches if not b.info.is_padding for i in b]
        if step % 3 == 2:  # every rank observes every rank's rows, then refines
            for sampler in samplers:
                sampler.observe(measured(replanner(0).table, [step]))
            made = {id(s.refine()) for s in samplers}
            assert len(made) == 1  # one refit, every rank follows it
    for p in passes:
        with pytest.raises(StopIteration):
            next(p)
    assert len(got) == len(set(got)) == len(samples)  # each sample once across the switches
    assert len(replanner.switches) >= 3
    assert replanner(0).summary["plan_digest"] != builder(0).summary["plan_digest"]


def test_a_closed_loop_needs_a_calibration_and_rows(samples):
    with pytest.raises(ValueError, match="Calibration"):
        Replanner(
            PlanBuilder(samples, "adaptiveload-balanced", BUDGETS, WORLD, 1, cost_model=PRIOR.cost)
        )
    replanner = Replanner(
        PlanBuilder(samples, "adaptiveload-balanced", BUDGETS, WORLD, 1, cost_model=replace(PRIOR))
    )
    with pytest.raises(ValueError, match="no rows"):
        replanner.refine(0, 1)
    with pytest.raises(ValueError, match="Replanner"):
        PlanBatchSampler(PlanBuilder(samples, "equal-token", BUDGETS, WORLD, 1), 0).refine()


@pytest.mark.filterwarnings("ignore:plan \\(adaptiveload-sp\\)")  # its baseline is faster here
def test_sequence_parallel_plans_replan_their_groups(samples):
    """adaptiveload-sp: on a device that holds 20k tokens a sample, the longest clips (32,760
    tokens) run on groups of 2 ranks, before and after a switch; every sample still once. A
    refit whose packs do not fit the steps left keeps the plan, with one warning."""
    device = replace(
        PRIOR,
        model="wan2.1-micro",  # a registered shape: heads for the groups
        cost=replace(PRIOR.cost, m_static=1e6, m_tok=3e3, m_seq=5e4),
        capacity_bytes=1.0e6 + 5e4 + 3e3 * 20_000,
    )
    replanner = Replanner(
        PlanBuilder(samples, "adaptiveload-sp", BUDGETS, WORLD, 1, cost_model=device)
    )
    before = replanner(0).table
    assert (before["sp_degree"] == 2).any()
    made = replanner.switch(0, 3, replace(device, cost=replace(device.cost, b=2e-11)))
    after = replanner(0).table
    assert made.replanned and (after.loc[after["step"] >= 3, "sp_degree"] == 2).any()
    ids = real_ids(after)
    assert not ids.duplicated().any() and set(ids) == set(samples["sample_id"])
    # TRUTH's fixed cost (10x) and attention (8x) pack the rest in more steps than are left
    truth = replace(TRUTH, m_static=1e6, m_tok=3e3, m_seq=5e4)
    with pytest.warns(PlanWarning, match="cannot be planned in its"):
        kept = replanner.switch(0, 6, replace(device, cost=truth))
    assert not kept.replanned
    pd.testing.assert_frame_equal(replanner(0).table, after)


def test_a_refit_that_prices_samples_at_zero_keeps_the_plan(samples):
    """A calibration with no per-sample term (handed to `switch`; `refine` keeps the prior's)
    cannot price a pack: the epoch keeps its plan, with one warning, instead of packing on a
    cost of 0 s per sample."""
    replanner = Replanner(
        PlanBuilder(samples, "adaptiveload-packed", BUDGETS, WORLD, 1, cost_model=PRIOR)
    )
    before = replanner(0).table
    flat = replace(PRIOR, cost=CostModel(c0=0.1, a=0.0, b=0.0))
    with pytest.warns(PlanWarning, match="prices a sample at 0 s"):
        made = replanner.switch(0, 2, flat)
    assert not made.replanned
    pd.testing.assert_frame_equal(replanner(0).table, before)
