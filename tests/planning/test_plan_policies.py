"""Policies, budgets and build_plan on hand-checked cases."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from planning_data import bucketed

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.errors import UserError
from adaptiveload.planning import plan as plan_module
from adaptiveload.planning.plan import build_plan
from adaptiveload.planning.policies import POLICIES, AdaptiveLoad, Budgets, batch_size
from adaptiveload.planning.simulate import simulate

IMG, CLIP_17, CLIP_81, CLIP_720P = 1560, 7800, 32760, 75600  # Wan 2.1 tokens (docs/definitions.md)


def test_equal_token_batch_sizes():
    b = batch_size("equal-token", [IMG, CLIP_17, CLIP_81, CLIP_720P], Budgets(m_tok=CLIP_81))
    assert b.tolist() == [21, 4, 1, 1]  # floor(32,760 / S), at least 1 (docs/definitions.md)


def test_adaptiveload_takes_the_tighter_constraint():
    bud = Budgets(m_mem=3 * CLIP_81, m_comp=CLIP_81**2.0, p=2.0)
    # memory allows 63 images, compute 441: memory binds; 81f: memory 3, compute 1
    assert batch_size("adaptiveload", [IMG, CLIP_81], bud).tolist() == [63, 1]
    bud = Budgets(m_mem=10**9, m_comp=CLIP_81**1.5, p=1.5)
    assert batch_size("adaptiveload", [IMG], bud).tolist() == [int((CLIP_81 / IMG) ** 1.5)]


def test_floor_is_exact_at_integer_boundaries():
    # 0.1 * 3 rounds above 0.3: the naive floor(0.3 / 0.1) = 2 is right, but 3*0.1 > 0.3
    b = batch_size("equal-token", np.array([7, 10, 3]), Budgets(m_tok=21.0))
    assert b.tolist() == [3, 2, 7]
    s = np.arange(1, 5000)
    bud = Budgets(m_mem=1e6, m_comp=12345.678**1.7, p=1.7)
    got = batch_size("adaptiveload", s, bud)
    assert np.all((got == 1) | ((got * s <= bud.m_mem) & (got * s**1.7 <= bud.m_comp)))
    assert np.all(((got + 1) * s > bud.m_mem) | ((got + 1) * s**1.7 > bud.m_comp))


@pytest.mark.parametrize(
    "kwargs",
    [{"m_tok": 0}, {"m_mem": -1.0}, {"m_comp": float("nan")}, {"p": 0.5}, {"p": 3.01}],
)
def test_budget_validation(kwargs):
    with pytest.raises(UserError, match="budget"):
        Budgets(**kwargs)


def test_unknown_policy_and_missing_budget():
    with pytest.raises(UserError, match="unknown; expected one of"):
        batch_size("fifo", [1], Budgets(m_tok=1))
    with pytest.raises(UserError, match="m_comp, p not set") as info:
        batch_size("adaptiveload", [1], Budgets(m_mem=100))
    # a library caller is told about Budgets, not about the CLI's flags
    assert "Budgets.resolve(calibration=" in str(info.value) and "--" not in str(info.value)


def test_budgets_resolve_from_calibration():
    # reference batch 2 x 2000 tokens: M_tok = 4000, M_comp = 2 * 2000^p
    cal = Calibration("wan2.1-tiny", "cpu", "measured", CostModel(0.1, 1e-3, 1e-6),
                      p=1.4, m_mem=5000.0, m_comp=2 * 2000**1.4, m_tok=4000.0,
                      extra={"budgets": {"ref_tokens": 2000.0, "ref_batch": 2}})
    auto = Budgets.resolve(calibration=cal)
    assert auto == Budgets(m_tok=4000.0, m_mem=5000.0, m_comp=2 * 2000**1.4, p=1.4)
    # an explicit p moves the auto M_comp along the reference batch; an explicit one stays
    mixed = Budgets.resolve(m_mem=100, p="1.2", calibration=cal)
    assert mixed == Budgets(m_tok=4000.0, m_mem=100.0, m_comp=2 * 2000**1.2, p=1.2)
    assert Budgets.resolve(m_comp=3e5, p=1.2, calibration=cal).m_comp == 3e5
    assert Budgets.resolve(calibration=cal, m_comp_scale=0.5).m_comp == 2000**1.4
    # a calibration file older than the m_tok rule: the baseline gets M_mem
    old = replace(cal, m_tok=None)
    assert Budgets.resolve(calibration=old) == replace(auto, m_tok=5000.0)
    assert Budgets.resolve(m_mem=100, calibration=old).m_tok == 100.0
    assert Budgets.resolve(m_tok=7) == Budgets(m_tok=7.0)
    assert Budgets.resolve(m_tok="auto", m_mem="3e4") == Budgets(m_tok=3e4, m_mem=3e4)
    with pytest.raises(UserError, match="m_comp='lots'"):
        Budgets.resolve(m_comp="lots")


def test_adding_a_policy_is_one_class_and_one_entry(monkeypatch):
    class Halved(AdaptiveLoad):
        name = "halved"

        def batch_size(self, tokens, budgets):
            return np.maximum(1, super().batch_size(tokens, budgets) // 2)

    monkeypatch.setitem(POLICIES, "halved", Halved)
    df = bucketed(200)
    bud = Budgets(m_mem=1e5, m_comp=1e5, p=1.0)
    assert (
        build_plan(df, "halved", bud, 4, 0).summary["batches"]
        > build_plan(df, "adaptiveload", bud, 4, 0).summary["batches"]
    )


def test_a_policy_forms_and_deals_its_own_micro_batches(monkeypatch):
    """A new way of dealing (or forming) batches is a policy of its own: build_plan asks the
    policy for its micro-batches and branches on none of its attributes."""

    class Reversed(AdaptiveLoad):
        name = "reversed"

        def deal(self, batches, slots, epoch):
            return np.arange(slots.size)[::-1], "reversed slots"

    monkeypatch.setitem(POLICIES, "reversed", Reversed)
    df, bud = bucketed(200), Budgets(m_mem=1e5, m_comp=1e5, p=1.0)
    mine, base = build_plan(df, "reversed", bud, 4, 0), build_plan(df, "adaptiveload", bud, 4, 0)
    assert (mine.summary["deal_cost"], mine.summary["window_steps"]) == ("reversed slots", 128)
    assert base.summary["deal_cost"] is None and base.summary["window_steps"] is None
    # the same cuts, the slot list reversed: the last slot of the base plan runs first
    cell = ["step", "rank"]
    first = mine.table.groupby(cell, sort=True)["sample_id"].apply(sorted).iloc[0]
    last = base.table.groupby(cell, sort=True)["sample_id"].apply(sorted).iloc[-1]
    assert first == last
    source = Path(plan_module.__file__).read_text()
    assert not re.search(r"\.(packed|balanced)\b", source)


def test_padding_when_ranks_outnumber_batches():
    df = bucketed(5, shapes=np.array([(81, 480, 832)]))
    plan = build_plan(df, "equal-token", Budgets(m_tok=CLIP_81), world_size=12, seed=0)
    t, s = plan.table, plan.summary
    assert (s["steps"], s["batches"], s["num_padding"]) == (1, 5, 7)
    assert sorted(t["rank"]) == list(range(12))
    pads = t[t["is_padding"]]
    assert set(pads["sample_id"]) <= set(df["sample_id"]) and len(pads) == 7


def test_oversize_sample_runs_alone():
    df = bucketed(40, shapes=np.array([(81, 720, 1280), (1, 480, 832)]))
    plan = build_plan(df, "adaptiveload", Budgets(m_mem=CLIP_81, m_comp=CLIP_81, p=1.0), 2, 0)
    big = plan.table[(plan.table["tokens"] == CLIP_720P) & ~plan.table["is_padding"]]
    assert plan.summary["num_oversize"] == (df["tokens"] == CLIP_720P).sum() == len(big)
    assert big.groupby(["step", "rank"]).size().eq(1).all()
    assert plan.summary["max_tokens_per_batch"] == CLIP_720P


def test_balanced_flattens_predicted_steps():
    df = bucketed(4000, seed=1)
    cost = CostModel(c0=0.01, a=1e-5, b=2e-10)
    bud = Budgets(m_mem=2 * CLIP_81, m_comp=CLIP_81**1.4, p=1.4)
    plain = build_plan(df, "adaptiveload", bud, 16, 0, cost_model=cost)
    bal = build_plan(df, "adaptiveload-balanced", bud, 16, 0, cost_model=cost)
    assert bal.summary["predicted_imbalance_rate"] < 0.05
    assert bal.summary["predicted_imbalance_rate"] < plain.summary["predicted_imbalance_rate"]
    assert bal.summary["predicted_samples_per_s"] > plain.summary["predicted_samples_per_s"]
    assert bal.summary["predicted_source"] == "model"
    # without a cost model the B*S^p proxy balances too (and says so)
    proxy = build_plan(df, "adaptiveload-balanced", bud, 16, 0)
    assert proxy.summary["deal_cost"] == "B*S^p"
    assert simulate(proxy.table, cost).summary["imbalance_rate"] < 0.1


def test_bucketed_object_and_bad_inputs():
    class Bucketed:  # the shape of adaptiveload.data.bucketing.Bucketed that plans read
        samples = bucketed(30)
        num_excluded = 4

    s = build_plan(Bucketed(), "equal-token", Budgets(m_tok=CLIP_81), 3, 0).summary
    assert (s["num_samples"], s["num_planned"], s["num_excluded"]) == (34, 30, 4)
    bud = Budgets(m_tok=CLIP_81)
    with pytest.raises(UserError, match="world_size"):
        build_plan(bucketed(3), "equal-token", bud, 0, 0)
    with pytest.raises(UserError, match="column"):
        build_plan(bucketed(3).drop(columns="tokens"), "equal-token", bud, 2, 0)
    with pytest.raises(UserError, match="no samples"):
        build_plan(bucketed(3).iloc[:0], "equal-token", bud, 2, 0)
    with pytest.raises(UserError, match="seed"):
        build_plan(bucketed(3), "equal-token", bud, 2, -1)
    assert isinstance(build_plan(bucketed(3), "equal-token", bud, 2, 0).table, pd.DataFrame)


def test_sort_and_chunk_minimises_the_sum_of_step_maxima():
    from itertools import permutations

    from adaptiveload.planning.dealing import deal_balanced

    rng = np.random.default_rng(0)
    cost = rng.random(6)
    order = deal_balanced(cost, world_size=2, window_steps=None, rng=rng)
    assert sorted(order) == list(range(6))
    got = cost[order].reshape(3, 2).max(axis=1).sum()
    best = min(cost[list(p)].reshape(3, 2).max(axis=1).sum() for p in permutations(range(6)))
    assert got == pytest.approx(best)
    # windows: a slot never leaves its window of window_steps * world_size slots
    cost = rng.random(40)
    order = deal_balanced(cost, world_size=4, window_steps=2, rng=rng)
    assert (np.arange(40) // 8 == order // 8).all()


def test_huge_budgets_are_refused_and_never_wrap_around():
    """1e308 used to overflow int64 in the batch-size cast (every batch became B = 1)."""
    from adaptiveload.planning.policies import MAX_BUDGET, _floor_within

    for name in ("m_tok", "m_mem", "m_comp"):
        with pytest.raises(UserError, match=name):
            Budgets(**{name: 1e308})
    b = _floor_within(1e300, np.array([1.0, 7.0]))
    assert (b > 0).all() and (b <= MAX_BUDGET).all()
    big = Budgets(m_mem=MAX_BUDGET, m_comp=MAX_BUDGET, p=1.0)
    assert (batch_size("adaptiveload", [16, 4096], big) > 1).all()
