"""Property tests of build_plan over random manifests, every policy and N from 1 to 1024."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planning_data import bucketed, manifests

from adaptiveload.planning.plan import build_plan
from adaptiveload.planning.policies import POLICIES, Budgets, batch_size
from adaptiveload.tokens import token_count

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# one bucket shape per micro-batch (the packed policy's invariants: tests/planning/test_packing.py;
# time-buckets', a field's method with a B(S) of the epoch's: tests/planning/test_baselines.py)
HOMOGENEOUS = sorted(name for name, cls in POLICIES.items() if not (cls.packed or cls.peer))


@st.composite
def budgets(draw) -> Budgets:
    p = draw(st.floats(1.0, 3.0))
    m_mem = draw(st.floats(50.0, 3e5))
    # M_comp around the S^p of typical shapes so both constraints bind somewhere
    m_comp = draw(st.floats(10.0, 1e5)) ** p
    return Budgets(m_tok=draw(st.floats(50.0, 3e5)), m_mem=m_mem, m_comp=m_comp, p=p)


def batches_of(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, rank) micro-batch: B, S, padding flag."""
    return (
        table.groupby(["step", "rank"])
        .agg(B=("sample_id", "size"), S=("tokens", "first"), S_max=("tokens", "max"),
             pad=("is_padding", "first"), batch_id=("batch_id", "first"),
             frames=("frames", "first"), height=("height", "first"), width=("width", "first"))
        .reset_index()
    )


def over(policy: str, b: np.ndarray, s: np.ndarray, bud: Budgets) -> np.ndarray:
    """Independent restatement of the constraints of docs/definitions.md (True = broken)."""
    s = s.astype(np.float64)
    if policy == "equal-token":
        return b * s > bud.m_tok
    return (b * s > bud.m_mem) | (b * s**bud.p > bud.m_comp)


@SETTINGS
@given(
    df=manifests(),
    bud=budgets(),
    policy=st.sampled_from(HOMOGENEOUS),
    world_size=st.one_of(st.integers(1, 16), st.integers(17, 1024)),
    seed=st.integers(0, 2**31),
)
def test_plan_invariants(df, bud, policy, world_size, seed):
    plan = build_plan(df, policy, bud, world_size, seed, epoch=1)
    t, s = plan.table, plan.summary
    real = t[~t["is_padding"]]
    # every bucketed sample exactly once; padding counted, not hidden
    assert sorted(real["sample_id"]) == sorted(df["sample_id"])
    assert s["num_planned"] == len(df) and s["duplicates"] == 0
    assert s["num_padding"] == int(t["is_padding"].sum())
    # tokens carried over faithfully, from the one token formula
    assert (t["tokens"] == token_count(t["frames"], t["height"], t["width"])).all()
    # every rank has exactly one micro-batch in every step
    mb = batches_of(t)
    assert len(mb) == s["steps"] * world_size
    assert s["steps"] == -(-s["batches"] // world_size)
    assert (mb["S"] == mb["S_max"]).all()  # one bucket shape per micro-batch
    assert s["num_padding_batches"] == int(mb["pad"].sum()) < world_size
    # constraints hold for every batch with B > 1
    b, tok = mb["B"].to_numpy(), mb["S"].to_numpy()
    assert not np.any((b > 1) & over(policy, b, tok, bud))
    assert s["constraint_violations"] == 0
    # a sample over budget alone runs alone and is counted
    alone = over(policy, np.ones(len(df)), df["tokens"].to_numpy(), bud)
    assert s["num_oversize"] == int(alone.sum())
    assert (mb.loc[over(policy, np.ones(len(mb)), tok, bud), "B"] == 1).all()
    # batches are as large as the policy allows, except one remainder per bucket shape
    full = batch_size(policy, tok, bud)
    assert (b <= full).all()
    short = mb[~mb["pad"].to_numpy() & (b < full)]
    assert (short.groupby(["frames", "height", "width"]).size() <= 1).all()


@SETTINGS
@given(df=manifests(), m=st.floats(50.0, 3e5), world_size=st.integers(1, 1024),
       seed=st.integers(0, 2**31))
def test_adaptiveload_p1_equals_equal_token(df, m, world_size, seed):
    equal = build_plan(df, "equal-token", Budgets(m_tok=m), world_size, seed)
    adaptive = build_plan(df, "adaptiveload", Budgets(m_mem=m, m_comp=m, p=1.0), world_size, seed)
    pd.testing.assert_frame_equal(equal.table, adaptive.table)


@SETTINGS
@given(df=manifests(), bud=budgets(), world_size=st.integers(1, 64), seed=st.integers(0, 2**31))
def test_balanced_deals_the_same_batches(df, bud, world_size, seed):
    def contents(table: pd.DataFrame) -> set[frozenset]:
        real = table[~table["is_padding"]]
        return {frozenset(g) for _, g in real.groupby("batch_id")["sample_id"]}

    plain = build_plan(df, "adaptiveload", bud, world_size, seed)
    balanced = build_plan(df, "adaptiveload-balanced", bud, world_size, seed)
    assert contents(plain.table) == contents(balanced.table)
    assert plain.summary["num_padding"] == balanced.summary["num_padding"]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_deterministic_and_epoch_dependent(policy):
    df = bucketed(500, seed=3)
    bud = Budgets(m_tok=40_000, m_mem=40_000, m_comp=40_000**1.5, p=1.5)
    a = build_plan(df, policy, bud, 8, seed=7, epoch=2)
    b = build_plan(df.copy(), policy, bud, 8, seed=7, epoch=2)
    pd.testing.assert_frame_equal(a.table, b.table)
    assert a.summary == b.summary
    assert a.summary["plan_digest"] == b.summary["plan_digest"]
    other = build_plan(df, policy, bud, 8, seed=7, epoch=3)
    assert not other.table["sample_id"].equals(a.table["sample_id"])
    reseeded = build_plan(df, policy, bud, 8, seed=8, epoch=2)
    assert not reseeded.table["sample_id"].equals(a.table["sample_id"])
    assert len({a.summary["plan_digest"], other.summary["plan_digest"],
                reseeded.summary["plan_digest"]}) == 3
