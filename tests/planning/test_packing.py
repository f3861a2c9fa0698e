"""The packed policy (adaptiveload-packed): its invariants as property tests over random
manifests, budgets and cost models, hand-checked packs, and its plan quality on paper-mixed."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from planning_data import bucketed, manifests
from repo_paths import H200_MEASURED, SUPPORT

from adaptiveload.costmodel import Calibration, CostModel, within_cap
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.mixtures import synthesize
from adaptiveload.planning.packing import PackLimits
from adaptiveload.planning.plan import build_plan, plan_warnings
from adaptiveload.planning.policies import Budgets, batch_size
from adaptiveload.tokens import token_count

PACKED = "adaptiveload-packed"
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def packed_budgets(draw) -> Budgets:
    p = draw(st.floats(1.0, 3.0))
    return Budgets(
        m_mem=draw(st.floats(50.0, 3e5)),
        m_comp=draw(st.floats(10.0, 1e5)) ** p,
        p=p,
        pack_tokens=draw(st.one_of(st.none(), st.floats(50.0, 3e5))),
    )


@st.composite
def calibrations(draw, budgets: Budgets) -> Calibration:
    """A calibration with a capacity: memory m_static + m_tok S + m_seq n, usable 90%."""
    m_tok = draw(st.floats(1.0, 100.0))
    m_seq = draw(st.floats(0.0, 1e5))
    m_static = draw(st.floats(0.0, 1e7))
    cost = CostModel(
        c0=draw(st.floats(0.0, 1.0)), a=draw(st.floats(1e-6, 1e-3)), b=draw(st.floats(0.0, 1e-7)),
        m_static=m_static, m_tok=m_tok, m_seq=m_seq, t_floor=draw(st.floats(0.0, 1.0)),
    )
    room = draw(st.floats(1e3, 1e8))  # bytes above the static part
    own_m_mem = draw(st.booleans())  # the budgets' M_mem is the calibration's (else explicit)
    return Calibration(
        "m", "dev", "model", cost, p=budgets.p, m_mem=budgets.m_mem if own_m_mem else 1.0,
        m_comp=budgets.m_comp, capacity_bytes=(m_static + room) / 0.9,
        extra={"headroom": 0.1},
    )


def cells(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, rank) micro-batch: n, sum S, and its pack id."""
    return (
        table.groupby(["step", "rank"])
        .agg(n=("sample_id", "size"), sum_s=("tokens", "sum"), ids=("batch_id", "nunique"),
             batch_id=("batch_id", "first"), pad=("is_padding", "first"))
        .reset_index()
    )


def limits_broken(table: pd.DataFrame, bud: Budgets, cal: Calibration | None) -> pd.Series:
    """Independent restatement of a pack's limits (docs/definitions.md), per batch_id: True
    where a pack of more than one sample breaks one."""
    over, n = over_limits(table, bud, cal)
    return over & (n > 1)


def over_limits(
    table: pd.DataFrame, bud: Budgets, cal: Calibration | None
) -> tuple[pd.Series, pd.Series]:
    """Per batch_id: over one of the pack limits, and the pack's sample count."""
    s = table["tokens"].astype(np.float64)
    per = pd.DataFrame({"id": table["batch_id"], "s": s, "sp": s**bud.p})
    g = per.groupby("id").agg(n=("s", "size"), s=("s", "sum"), sp=("sp", "sum"))
    over = ~within_cap(g["sp"], bud.m_comp)
    token_caps = [bud.pack_tokens]
    if cal is not None:
        mem = cal.cost.m_tok * g["s"] + cal.cost.m_seq * g["n"]
        over |= ~within_cap(mem, cal.capacity_bytes * 0.9 - cal.cost.m_static)
        token_caps.append(None if bud.m_mem == cal.m_mem else bud.m_mem)
    else:
        token_caps.append(bud.m_mem)
    for cap in token_caps:
        if cap is not None:
            over |= ~within_cap(g["s"], cap)
    return over, g["n"]


@SETTINGS
@given(
    df=manifests(), bud=packed_budgets(), data=st.data(), with_cal=st.booleans(),
    world_size=st.one_of(st.integers(1, 16), st.integers(17, 1024)),
    window=st.sampled_from([None, 1, 3, 128]), seed=st.integers(0, 2**31),
)
def test_packed_invariants(df, bud, data, with_cal, world_size, window, seed):
    cal = data.draw(calibrations(bud)) if with_cal else None
    if cal is not None:  # a sample one device cannot hold at all is never planned
        fits = cal.cost.memory(1, df["tokens"].to_numpy(np.float64)) <= cal.capacity_bytes
        assume(fits.any())
        df = df[fits].reset_index(drop=True)
    plan = build_plan(df, PACKED, bud, world_size, seed, epoch=1, cost_model=cal,
                      window_steps=window)
    t, s = plan.table, plan.summary
    real = t[~t["is_padding"]]
    # every sample exactly once; padding counted, not hidden
    assert sorted(real["sample_id"]) == sorted(df["sample_id"])
    assert s["num_planned"] == len(df) and s["duplicates"] == 0
    assert s["num_padding"] == int(t["is_padding"].sum())
    # each row carries its own sample's bucket shape and tokens
    assert (t["tokens"] == token_count(t["frames"], t["height"], t["width"])).all()
    # every rank holds exactly one pack in every step
    c = cells(t)
    assert len(c) == s["steps"] * world_size and (c["ids"] == 1).all()
    assert s["batches"] == real["batch_id"].nunique()
    # padding only where the samples cannot fill every rank of every step
    assert s["num_padding_batches"] == int(c["pad"].sum())
    assert s["num_padding_batches"] == max(0, s["steps"] * world_size - len(df))
    # memory never exceeded, every budget kept (a sample over one alone runs alone)
    assert not limits_broken(real, bud, cal).any()
    assert s["constraint_violations"] == 0
    alone = df.assign(batch_id=np.arange(len(df)))  # every sample a pack of its own
    assert s["num_oversize"] == int(over_limits(alone, bud, cal)[0].sum())
    # no fewer steps than the volume of the packs' limits allows... and not many more
    assert s["steps"] >= -(-s["batches"] // world_size)
    # identical on every rank: the same inputs plan the same, a copy of the frame too
    again = build_plan(df.copy(), PACKED, bud, world_size, seed, epoch=1, cost_model=cal,
                       window_steps=window)
    pd.testing.assert_frame_equal(t, again.table)
    assert again.summary["plan_digest"] == s["plan_digest"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(df=manifests(), bud=packed_budgets(), world_size=st.integers(1, 64),
       seed=st.integers(0, 2**31))
def test_no_plan_beats_the_lower_bound(df, bud, world_size, seed):
    """predicted_vs_lower_bound >= 1 for every policy: the bound is a bound."""
    cost = CostModel(c0=0.05, a=2e-5, b=1e-9, m_tok=1.0, t_floor=0.1)
    bud = Budgets(m_tok=bud.m_mem, m_mem=bud.m_mem, m_comp=bud.m_comp, p=bud.p)
    for policy in ("equal-token", "adaptiveload", "adaptiveload-balanced", PACKED):
        s = build_plan(df, policy, bud, world_size, seed, cost_model=cost).summary
        assert s["predicted_vs_lower_bound"] >= 1 - 1e-12


def frame(tokens: list[int]) -> pd.DataFrame:
    """A bucketed frame of image-shaped samples with the given tokens (S = H/16 * W/16)."""
    rows = []
    for i, s in enumerate(tokens):
        rows.append({"sample_id": f"s{i}", "bucket_frames": 1, "bucket_height": 16,
                     "bucket_width": 16 * s, "tokens": s})
    return pd.DataFrame(rows)


def test_lpt_by_cost_then_the_cap():
    # proxy cost S (p = 1), 2 ranks, room to spare: LPT puts 6, 5 apart, 4 with 5, 3 with 6,
    # 2 on a tie: 11 | 9 (the optimum is 10 | 10, LPT's worst case shape) ...
    roomy = Budgets(m_mem=100, m_comp=1e9, p=1.0)
    loads = build_plan(frame([6, 5, 4, 3, 2]), PACKED, roomy, 2, seed=0).table.groupby("rank")
    assert sorted(loads["tokens"].sum()) == [9, 11]
    # ... and cheaper samples placed last close the gap (Graham's bound: one sample)
    plan = build_plan(frame([6, 5, 4, 3, 2, 1, 1]), PACKED, roomy, 2, seed=0)
    assert sorted(plan.table.groupby("rank")["tokens"].sum()) == [11, 11]
    assert plan.summary["pack_limits"] == {"compute": 1e9, "tokens": 100.0}
    # a cap of 10 tokens: 20 tokens would fill 2 packs exactly, but LPT leaves the 2 without
    # room (6+3 | 5+4), so the epoch gets a second step; every pack stays within 10
    tight = build_plan(frame([6, 5, 4, 3, 2]), PACKED, Budgets(m_mem=10, m_comp=1e9, p=1.0), 2, 0)
    sums = tight.table.groupby("batch_id")["tokens"].sum()
    assert tight.summary["steps"] == 2 and sums.max() <= 10
    assert tight.summary["constraint_violations"] == 0
    # a cap met exactly is kept (token sums are exact): 5 + 5 = 10
    exact = build_plan(frame([5, 5, 5, 5]), PACKED, Budgets(m_mem=10, m_comp=1e9, p=1.0), 2, 0)
    assert exact.summary["steps"] == 1
    assert exact.table.groupby("batch_id")["tokens"].sum().tolist() == [10, 10]


def test_packs_fill_a_cap_exactly():
    """M_comp = B_ref S_ref^p, as a calibration derives it: B_ref reference samples fill it
    exactly, and the epoch bound, the homogeneous rule, the packer and the checks all accept
    that pack (one tolerance, `costmodel.CAP_TOLERANCE`), so an epoch of reference samples
    takes exactly K_min steps of packs of B_ref."""
    p, s_ref, b_ref, n = 1.3167432834503265, 75_600, 3, 16
    bud = Budgets(m_mem=1e9, m_comp=b_ref * float(s_ref) ** p, p=p)
    df = pd.DataFrame({"sample_id": [f"r{i}" for i in range(b_ref * n * 5)],
                       "bucket_frames": 81, "bucket_height": 720, "bucket_width": 1280,
                       "tokens": s_ref})  # 720p x 81 frames
    limits = PackLimits.of(bud, None)
    assert limits.min_micro_batches([s_ref], [b_ref * n * 5]) == n * 5
    assert batch_size("adaptiveload", [s_ref], bud)[0] == b_ref
    plan = build_plan(df, PACKED, bud, n, seed=0)
    assert plan.summary["steps"] == plan.summary["min_steps_per_epoch"] == 5
    assert (plan.table.groupby("batch_id").size() == b_ref).all()
    assert plan.summary["constraint_violations"] == 0
    assert not limits_broken(plan.table[~plan.table["is_padding"]], bud, None).any()


def test_step_counts_asked_for_are_kept_or_said():
    """An integer K (or match) is reached where the packs fit; where they cannot, the plan
    records the steps reached beside those asked and its warnings say so, with the count."""
    bud = Budgets(m_mem=10, m_comp=1e9, p=1.0)
    kept = build_plan(frame([5, 5, 5, 5, 1, 1]), PACKED, bud, 2, seed=0, steps_per_epoch=3)
    assert kept.summary["steps"] == kept.summary["steps_asked"] == 3
    assert not any("steps_per_epoch" in w for w in plan_warnings(kept.summary))
    # 6 5 4 3 2 fill two packs of 10 exactly only as 6+4 | 5+3+2, which LPT does not find
    short = build_plan(frame([6, 5, 4, 3, 2]), PACKED, bud, 2, seed=0, steps_per_epoch=1)
    assert (short.summary["steps_asked"], short.summary["steps"]) == (1, 2)
    said = [w for w in plan_warnings(short.summary) if "steps_per_epoch" in w]
    assert len(said) == 1 and "asked for 1 steps and the plan has 2 (+1)" in said[0]
    free = build_plan(frame([6, 5, 4, 3, 2]), PACKED, bud, 2, seed=0)
    assert free.summary["steps_asked"] is None
    assert not any("steps_per_epoch" in w for w in plan_warnings(free.summary))


def test_steps_are_levelled_where_ranks_must_double_up():
    """The pigeonhole case, proxy cost S: 10 samples of 100 and 400 of 1 on 4 ranks in 2
    steps. Two ranks must hold two 100s, so some step takes 200; LPT's packs levelled alone
    (200, 200 | 166.7 x 6) sum their steps' maxima to 366.7, but the step that takes 200 can
    hold 200 on every rank: 200 + 150 = 350, which step levelling reaches (to one sample)."""
    df = frame([100] * 10 + [1] * 400)
    bud = Budgets(m_mem=1e6, m_comp=1e9, p=1.0)
    plan = build_plan(df, PACKED, bud, 4, seed=0, steps_per_epoch=2)
    per_step = plan.table.groupby(["step", "rank"])["tokens"].sum().groupby("step").max()
    assert per_step.sum() <= 351


@pytest.mark.parametrize("mixture, grid, max_frames", [("reference-heavy", "wan", 81),
                                                       ("robotics", "wan-long", 161)])
def test_seeds_vary_what_shares_a_pack(mixture, grid, max_frames):
    """On the stress mixtures, where caps bind and a third of the samples share one token
    count, three seeds give three pack compositions (`composition_digest`: not only which
    sample of a token count fills a slot), and one seed gives one plan."""
    cal = Calibration.load(H200_MEASURED)
    bud = Budgets.resolve(calibration=cal)
    df = bucketize(synthesize(mixture, 3000, seed=0), grid=grid, max_frames=max_frames)
    digests = {build_plan(df, PACKED, bud, 64, seed, cost_model=cal).summary[
        "composition_digest"] for seed in (0, 1, 2)}
    assert len(digests) == 3
    again = build_plan(df, PACKED, bud, 64, 0, cost_model=cal).summary["composition_digest"]
    assert again in digests
    # blind to which sample of a token count sits where: one bucket, any seed, one digest
    one = frame([7] * 12)
    assert len({build_plan(one, "equal-token", Budgets(m_tok=21), 2, seed).summary[
        "composition_digest"] for seed in (0, 1)}) == 1


def test_cheap_samples_beside_costly_ones_plan_in_little_memory():
    """One-token images beside 36k-token clips at p = 2.9: a pack's load is ~10^12 of the
    image's cost, so LPT's levels of the image span ~10^12 (a histogram over them asked for
    3.45 TiB). The plan is made, every sample once, within its limits."""
    shapes = np.array([(1, 16, 16), (61, 240, 720), (49, 720, 720), (37, 608, 32),
                       (29, 944, 1216)])
    df = bucketed(400, seed=0, shapes=shapes)
    assert df["tokens"].min() == 1
    bud = Budgets(m_mem=269_397.2, m_comp=1.0255e12, p=2.8962, pack_tokens=269_397.2)
    plan = build_plan(df, PACKED, bud, 1, seed=3461, window_steps=128)
    real = plan.table[~plan.table["is_padding"]]
    assert sorted(real["sample_id"]) == sorted(df["sample_id"])
    assert plan.summary["constraint_violations"] == 0


def test_equal_values_are_taken_in_order():
    """`_smallest` (which packs at the m-th value's level take one more) picks the n
    smallest, equal ones from the first position on: what a stable sort picks, on every
    machine (np.argpartition's choice among equal values hangs on the CPU's vector kernel).
    Few distinct values, so ties sit at the boundary; sizes on both sides of its bins."""
    from adaptiveload.planning import packing

    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.choice([5, 300, packing.SELECT_BINS + 1, 20_000]))
        values = rng.choice(rng.random(int(rng.integers(1, 6))), size)
        n = int(rng.integers(1, size))
        got = packing._smallest(values, n)
        assert sorted(got) == sorted(np.argsort(values, kind="stable")[:n])


def test_levelling_is_skipped_only_where_it_gains_little():
    """Step levelling costs two more LPT passes a window, so it is skipped where LPT's steps
    already sum to within LEVEL_GAIN of the window's work over N, a bound no plan beats: on
    paper-mixed at N = 16 it is skipped in some window (the plan differs from the one that
    levels everywhere), and the epoch it predicts is within LEVEL_GAIN of that plan's (model,
    the measured H200 1.3B calibration)."""
    from adaptiveload.planning import packing

    cal = Calibration.load(H200_MEASURED)
    bud = Budgets.resolve(calibration=cal)
    df = bucketize(synthesize("paper-mixed", 20_000, seed=1), grid="wan")
    skipped = build_plan(df, PACKED, bud, 16, seed=1, cost_model=cal).summary
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packing, "LEVEL_GAIN", -1.0)  # level wherever a step is pinned
        levelled = build_plan(df, PACKED, bud, 16, seed=1, cost_model=cal).summary
    assert skipped["plan_digest"] != levelled["plan_digest"]
    assert skipped["steps"] == levelled["steps"]
    ratio = levelled["predicted_samples_per_s"] / skipped["predicted_samples_per_s"]
    assert 1 < ratio <= 1 + packing.LEVEL_GAIN


def test_both_ways_to_the_mth_level_agree():
    """`_mth_level`'s histogram and its bisection give the same level and count below it."""
    from adaptiveload.planning import packing

    def oracle(lo, fits, m):
        runs = [np.arange(a, a + f) for a, f in zip(lo, fits, strict=True)]
        values = np.sort(np.concatenate(runs))
        return int(values[m - 1]), int((values < values[m - 1]).sum())

    rng = np.random.default_rng(0)
    for _ in range(300):
        packs = int(rng.integers(1, 40))
        lo = rng.integers(0, int(rng.choice([5, 50, 10**6])), packs)
        fits = rng.integers(1, 12, packs)
        m = int(rng.integers(1, fits.sum() + 1))
        assert packing._mth_level(lo, fits, m) == oracle(lo, fits, m)
        # far apart: the bisection (the levels between packs are never materialized)
        assert packing._mth_level(lo * 10**9, fits, m) == oracle(lo * 10**9, fits, m)


def test_the_bound_on_packs_never_exceeds_a_packing_lpt_finds():
    """`_least_packs` skips LPT below it, so it must be a bound: wherever LPT places every
    sample in n packs, it is at most n (random types under two limits, sizes around the
    thresholds it counts: a half, a third, a quarter of a cap)."""
    from adaptiveload.planning import packing

    rng = np.random.default_rng(0)
    caps = np.array([1.0, 1.0])
    for _ in range(200):
        n_types = int(rng.integers(1, 7))
        use = rng.choice([0.0, 0.1, 0.2, 0.25, 0.3, 1 / 3, 0.4, 0.5, 0.6, 0.9, 1.2], (n_types, 2))
        use = use * rng.uniform(0.98, 1.02, use.shape)
        w = rng.uniform(0.1, 1.0, n_types)
        by_cost = np.argsort(-w)
        alone = (use > caps).any(axis=1)
        types = packing._Types(w=w[by_cost], use=use[by_cost], alone=alone[by_cost], caps=caps,
                               of=np.zeros(0, dtype=np.int64), tokens=np.arange(n_types))
        count = rng.integers(0, 6, n_types)
        if count.sum() == 0:
            continue
        order = np.flatnonzero(count)
        bound = packing._least_packs(count, types)
        for n_packs in range(1, int(count.sum()) + 1):
            if packing._lpt(count, types, n_packs, np.zeros(n_packs), order) is not None:
                assert bound <= n_packs
                break


def test_oversize_samples_run_alone_and_count():
    bud = Budgets(m_mem=100, m_comp=1e9, p=1.0, pack_tokens=50)
    plan = build_plan(frame([80, 60, 10, 10, 10, 10]), PACKED, bud, world_size=2, seed=1)
    t = plan.table[~plan.table["is_padding"]]
    alone = t.groupby("batch_id")["tokens"].agg(["size", "max"])
    assert (alone.loc[alone["max"] > 50, "size"] == 1).all()
    assert plan.summary["num_oversize"] == 2
    assert (alone.loc[alone["max"] <= 50, "size"] > 0).all()


def test_memory_is_held_in_bytes_with_a_calibration():
    """M_mem is a token budget sized for a batch of the smallest samples (their per-sample
    memory m_seq binds); packs of longer ones fill the bytes it stands for, never more."""
    cost = CostModel(c0=0.0, a=1e-4, b=0.0, m_static=1000.0, m_tok=1.0, m_seq=100.0)
    # smallest sample 100 tokens: M_mem = (usable - static) / (m_tok + m_seq / 100) = 4,500
    usable = 1000.0 + 9000.0
    cal = Calibration("m", "dev", "model", cost, p=1.0, m_mem=4500.0, m_comp=1e12,
                      capacity_bytes=usable / 0.9, extra={"headroom": 0.1})
    bud = Budgets.resolve(calibration=cal)
    df = frame([1000] * 16)
    plan = build_plan(df, PACKED, bud, world_size=2, seed=0, cost_model=cal)
    packs = plan.table.groupby("batch_id")["tokens"].agg(["size", "sum"])
    memory = cost.m_static + cost.m_tok * packs["sum"] + cost.m_seq * packs["size"]
    assert packs["sum"].max() > bud.m_mem  # above the token budget ...
    assert (memory <= usable).all()  # ... never above the memory it stands for
    assert plan.summary["pack_limits"]["memory_bytes"] == pytest.approx(9000.0)
    assert plan.summary["steps"] == 1  # 8 x 1,000 tokens = 8,800 B of 9,000 per pack
    # an explicit M_mem is kept as a token cap too
    small = Budgets.resolve(m_mem=3000, calibration=cal)
    sums = build_plan(df, PACKED, small, 2, 0, cost_model=cal).table.groupby("batch_id")["tokens"]
    assert sums.sum().max() <= 3000


@pytest.mark.parametrize("steps, per_window", [(78, 4), (173, 128), (3, 1), (1000, 7)])
def test_windows_keep_the_epochs_mix(steps, per_window):
    """Samples, in cost order, are spread over the dealing windows so that every run of one
    token count lands on the windows in proportion to their steps, within a few samples."""
    from adaptiveload.planning.packing import _spread_over_windows

    runs = np.random.default_rng(1).integers(1, 4000, size=12)  # one run per token count
    window = _spread_over_windows(int(runs.sum()), steps, per_window, phase=0.37)
    n_windows = -(-steps // per_window)
    steps_in = np.minimum(per_window, steps - per_window * np.arange(n_windows))
    bounds = np.concatenate(([0], np.cumsum(runs)))
    for a, b in itertools.pairwise(bounds):
        got = np.bincount(window[a:b], minlength=n_windows)
        assert np.abs(got - (b - a) * steps_in / steps).max() <= 3


def _cpu_feature_levels() -> list[str]:
    """NPY_DISABLE_CPU_FEATURES values that take numpy down this CPU's vector levels: none
    off, then each level numpy dispatches to (and this CPU has) off from the top, down to
    its baseline (on x86-64: AVX-512, then AVX2 too)."""
    from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__

    found = [f for f in __cpu_dispatch__ if __cpu_features__.get(f)]
    return [" ".join(found[i:]) for i in range(len(found), -1, -1)]


def test_plans_agree_across_processes_and_cpus():
    """Every rank plans alone: interpreters with other hash seeds, and numpy held to fewer
    of this CPU's vector instructions (its AVX-512 and AVX2 kernels pick among equal values
    and round powers differently), print one set of digests. Before the packer took equal
    loads in pack order and powers through libm, reference-heavy's packed plan and the
    14B's fixed-degree SP plan differed between these processes."""
    digests = []
    for hash_seed, disabled in [("1", ""), *(("2", level) for level in _cpu_feature_levels())]:
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=str(SUPPORT),
                   NPY_DISABLE_CPU_FEATURES=disabled)
        out = subprocess.run([sys.executable, str(SUPPORT / "plan_digest_worker.py")], env=env,
                             capture_output=True, text=True, check=True)
        digests.append(json.loads(out.stdout))
    assert len(digests[0]) == 4
    assert all(d == digests[0] for d in digests), digests


@pytest.fixture(scope="module")
def paper_mixed():
    return bucketize(synthesize("paper-mixed", 20_000, seed=0), grid="wan")


@pytest.mark.parametrize("world_size", [16, 256, 1024])
def test_plan_quality_on_paper_mixed(paper_mixed, world_size):
    """Predicted (model) quality through the measured H200 1.3B calibration: within 1% of the
    steps' lower bound, imbalance under the targets, faster than balanced dealing, no pack
    over memory. Deterministic numbers, not timings (results/benchmarks/packing_plans.json has
    the full sweep)."""
    cal = Calibration.load(H200_MEASURED)
    bud = Budgets.resolve(calibration=cal)
    packed = build_plan(paper_mixed, PACKED, bud, world_size, seed=0, cost_model=cal).summary
    balanced = build_plan(paper_mixed, "adaptiveload-balanced", bud, world_size, seed=0,
                          cost_model=cal).summary
    assert packed["predicted_vs_lower_bound"] <= 1.01
    assert packed["predicted_imbalance_rate"] <= {16: 0.005, 256: 0.01, 1024: 0.02}[world_size]
    assert packed["predicted_samples_per_s"] >= balanced["predicted_samples_per_s"]
    assert packed["predicted_vram_utilization_max"] <= 0.9 + 1e-9  # capacity x (1 - headroom)
    assert packed["constraint_violations"] == 0 and packed["num_padding"] == 0


def test_sampler_yields_a_pack_per_step_and_resumes():
    """PlanBatchSampler over the packed policy: each rank gets its pack (several shapes) per
    step through a DataLoader, the all-ranks view (rank=None) is step-major, and a resumed
    sampler yields exactly the rest."""
    from torch.utils.data import DataLoader

    from adaptiveload.planning.sampler import PlanBatchSampler, PlanBuilder

    samples = bucketed(400, seed=9)
    bud = Budgets(m_mem=120_000, m_comp=120_000**1.4, p=1.4)
    builder = PlanBuilder(samples, PACKED, bud, world_size=3, seed=2)
    table = builder(0).table
    assert (table.groupby(["step", "rank"])["tokens"].nunique() > 1).any()  # real packs

    def collate(items: list[int]) -> list[int]:  # what a packed collate receives: any shapes
        return items

    per_rank = []
    for rank in range(3):
        got = list(DataLoader(range(len(samples)), batch_sampler=PlanBatchSampler(builder, rank),
                              collate_fn=collate))
        mine = table[table["rank"] == rank]
        assert [samples["sample_id"].to_numpy()[b].tolist() for b in got] == [
            g.tolist() for _, g in mine.groupby("step")["sample_id"]
        ]
        per_rank.append(got)
    every = PlanBatchSampler(builder, None)
    assert list(every) == [b for step in zip(*per_rank, strict=True) for b in step]
    state = every.state_dict(consumed_steps=2)
    resumed = PlanBatchSampler(PlanBuilder(samples, PACKED, bud, world_size=3, seed=2), None)
    resumed.load_state_dict(state)
    assert list(resumed) == list(every)[2 * 3 :]


def test_the_trainer_runs_packed_plans_with_the_auto_layout(tmp_path):
    """`model.batch_layout: auto` trains adaptiveload-packed packed and the others dense; the
    rows of a packed run report each rank's pack (n, Σ S, Σ S²) as the plan made it, and the
    per-step metrics carry them per rank."""
    import torch
    from training_setup import write_experiment

    from adaptiveload import experiment as experiment_config
    from adaptiveload.training.distributed import Ranks
    from adaptiveload.training.inputs import prepare_data
    from adaptiveload.training.loop import Trainer
    from adaptiveload.training.settings import from_experiment

    torch.set_num_threads(1)
    exp = experiment_config.load(write_experiment(tmp_path, steps=3))
    assert exp["model"]["batch_layout"] == "auto"
    layouts = {p: from_experiment(exp, p, 0, launch_mode="emulated", world_size=3).batch_layout
               for p in (PACKED, "adaptiveload-balanced")}
    assert layouts == {PACKED: "packed", "adaptiveload-balanced": "dense"}
    cfg = from_experiment(exp, PACKED, 0, launch_mode="emulated", world_size=3)
    data = prepare_data(exp, cfg)
    plan = data.builder(0).table
    assert (plan.groupby(["step", "rank"])["tokens"].nunique() > 1).any()

    class Sink:  # what the MLflow tracker is handed, step by step
        def __init__(self) -> None:
            self.logged: dict[int, dict] = {}

        def log_step(self, step: int, metrics: dict) -> None:
            self.logged[step] = dict(metrics)

        def state_dict(self) -> dict:
            return {}

    sink = Sink()
    trainer = Trainer(cfg, data, None, Ranks.emulated(3), sink=sink, progress=False)
    try:
        result = trainer.run()
    finally:
        trainer.close()
    assert len(result.steps) == 3 * 3
    for row in result.steps.itertuples():
        tok = plan.loc[(plan["step"] == row.step) & (plan["rank"] == row.rank), "tokens"]
        assert (row.samples, row.tokens, row.tokens_sq) == (len(tok), tok.sum(), (tok**2).sum())
        logged = sink.logged[row.step]
        assert [logged[f"rank{row.rank}/{k}"] for k in ("samples", "tokens", "tokens_sq")] == [
            row.samples, row.tokens, row.tokens_sq
        ]
