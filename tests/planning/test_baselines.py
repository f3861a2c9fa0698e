"""The field's methods as baselines (``planning.baselines``, the ``peer`` policies): every
micro-batch within the memory limit, checked from the plan table alone; Karmarkar-Karp's and
first-fit-decreasing's own answers; time-equalised batch sizes; both step modes."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from planning_data import bucketed
from repo_paths import FIXTURES, H200_MEASURED, ROOT

from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.mixtures import synthesize
from adaptiveload.experiment import load_layered
from adaptiveload.planning.baselines import karmarkar_karp
from adaptiveload.planning.plan import build_plan
from adaptiveload.planning.policies import POLICIES, Budgets

PEERS = [name for name, policy in POLICIES.items() if policy.peer]


def micro_batches(table: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, rank) micro-batch of real samples: n, Σ S."""
    real = table[~table["is_padding"]]
    return real.groupby(["step", "rank"]).agg(n=("tokens", "size"), sum_s=("tokens", "sum"))


@pytest.fixture(scope="module")
def measured() -> Calibration:
    return Calibration.load(H200_MEASURED)


@pytest.mark.parametrize(
    ("mixture", "n"), [("paper-mixed", 4), ("paper-mixed", 64), ("long-clips", 16),
                       ("images-only", 8)],
)
def test_no_baseline_puts_a_micro_batch_over_the_memory_limit(measured, mixture, n):
    """The limit restated from the calibration alone: a micro-batch of two or more samples
    holds no more predicted bytes than the usable memory (the packs), no more tokens than
    M_mem (time-buckets' batches, as adaptiveload's), and no more tokens than a user's
    pack_tokens; without a cost model, no more tokens than M_mem."""
    samples = bucketize(synthesize(mixture, 800, seed=2))
    cal = measured.for_tokens(samples.samples["tokens"].to_numpy())
    usable = cal.usable_bytes
    # equal-token's steps (match) hold the samples under the calibration's budgets; under a
    # tighter limit a policy needs more, and the plan refuses (tests/costmodel)
    for budgets, cost_model, modes in (
        (Budgets.resolve(calibration=cal), cal, ("free", "match")),
        (Budgets.resolve(calibration=cal, pack_tokens=0.6 * cal.m_mem), cal, ("free",)),
        (Budgets(m_tok=cal.m_tok, m_mem=0.5 * cal.m_mem, p=cal.p), None, ("free",)),
    ):
        for mode in modes:
            for policy in PEERS:
                plan = build_plan(samples, policy, budgets, n, 1, cost_model=cost_model,
                                  steps_per_epoch=mode)
                mb = micro_batches(plan.table)
                shared = mb[mb["n"] > 1]
                where = (mode, policy, budgets)
                if cost_model is not None and POLICIES[policy].packed:
                    bytes_ = cal.cost.pack_memory(shared["n"], shared["sum_s"])
                    assert (bytes_ <= usable).all(), where
                else:
                    assert (shared["sum_s"] <= budgets.m_mem).all(), where
                if budgets.pack_tokens is not None and POLICIES[policy].packed:
                    assert (shared["sum_s"] <= budgets.pack_tokens).all(), where
                assert plan.summary["constraint_violations"] == 0, where
                assert plan.summary["num_planned"] == len(samples.samples), where
                assert plan.summary["duplicates"] == 0, where


def test_karmarkar_karp_gives_its_own_answer():
    """The textbook case where largest differencing is not optimal: {8, 7, 6, 5, 4} in two
    parts differs by 2 (the best split, {8, 7} and {6, 5, 4}, by 0); every item lands once."""
    parts = karmarkar_karp(np.array([8, 7, 6, 5, 4]), 2)
    sums = sorted(float(np.array([8, 7, 6, 5, 4])[p].sum()) for p in parts)
    assert sums == [14.0, 16.0]
    rng = np.random.default_rng(0)
    for k in (3, 16):
        w = rng.integers(1, 1000, 200).astype(float)
        parts = karmarkar_karp(w, k)
        assert len(parts) == k
        assert sorted(np.concatenate(parts).tolist()) == list(range(w.size))
        sums = np.array([w[p].sum() for p in parts])
        assert sums.max() - sums.min() <= w.max()  # far better in practice; never worse


def first_fit_decreasing(tokens: list[int], cap: float) -> list[float]:
    """The textbook first-fit-decreasing, for one token cap: the packs' token sums."""
    packs: list[float] = []
    for s in sorted(tokens, reverse=True):
        fit = next((i for i, used in enumerate(packs) if used + s <= cap), None)
        if fit is None:
            packs.append(float(s))
        else:
            packs[fit] += s
    return sorted(packs)


def test_token_ffd_packs_as_first_fit_decreasing_does():
    samples = bucketed(400, seed=5)
    budgets = Budgets(m_mem=150_000)
    plan = build_plan(samples, "token-ffd", budgets, 4, 3)
    sums = sorted(micro_batches(plan.table)["sum_s"].astype(float).tolist())
    assert sums == first_fit_decreasing(samples["tokens"].tolist(), budgets.m_mem)


def test_time_buckets_equalise_the_predicted_step(measured):
    """The reference is equal-token's slowest batch; each bucket's batches are the largest
    within it and M_mem (restated here by counting up from B = 1); at equal-token's steps the
    reference is raised until the batches fit them."""
    samples = bucketize(synthesize("paper-mixed", 3000, seed=1))
    budgets = Budgets.resolve(calibration=measured)
    cost = measured.cost
    plan = build_plan(samples, "time-buckets", budgets, 8, 0, cost_model=measured)
    values = np.unique(samples.samples["tokens"])
    within = values <= budgets.m_tok
    slowest = cost.step_time(np.floor(budgets.m_tok / values), values)[within].max()
    reference = plan.summary["reference_step"]
    assert reference == pytest.approx(slowest, rel=1e-12)
    table = plan.table[~plan.table["is_padding"]]
    shape = ["frames", "height", "width"]
    batches = table.groupby("batch_id").agg(B=("tokens", "size"), S=("tokens", "first"),
                                            **{c: (c, "first") for c in shape})
    largest = batches.groupby(shape).agg(B=("B", "max"), S=("S", "first"))
    count = samples.samples.groupby(["bucket_frames", "bucket_height", "bucket_width"]).size()
    for (b_largest, s), n in zip(largest.itertuples(index=False), count, strict=True):
        b = 1
        while cost.step_time(b + 1, s) <= reference and (b + 1) * s <= budgets.m_mem:
            b += 1
        assert b_largest == min(b, n), s
    free_steps = build_plan(samples, "equal-token", budgets, 8, 0).summary["steps"]
    matched = build_plan(samples, "time-buckets", budgets, 8, 0, cost_model=measured,
                         steps_per_epoch="match")
    assert matched.summary["steps"] == free_steps
    assert matched.summary["reference_step"] >= reference


def test_per_step_balancing_beats_cost_blind_dealing(measured):
    """On the same samples the step-balancing peers' ranks are far closer than token-ffd's,
    whose packs are dealt blind to cost, and KnapFormer's FLOP key closer than verl's
    tokens (model: the measured H200 1.3B calibration)."""
    samples = bucketize(synthesize("paper-mixed", 4000, seed=3))
    budgets = Budgets.resolve(calibration=measured)
    imbalance = {
        policy: build_plan(samples, policy, budgets, 16, 0, cost_model=measured).summary[
            "predicted_imbalance_rate"
        ]
        for policy in ("token-ffd", "token-kk", "flop-greedy")
    }
    assert imbalance["flop-greedy"] < imbalance["token-kk"] < 0.5 * imbalance["token-ffd"]


def test_the_baselines_experiment_plans_its_policies():
    """experiments/baselines.yaml as the pipeline layers it: its policies (the project's
    packed, the analysis baseline, and two peers) plan its data at its world size with a
    stand-in of its calibration (the tiny prior), and the peers' packs train packed."""
    cfg = load_layered(ROOT / "experiments" / "baselines.yaml")
    assert "adaptiveload-packed" in cfg["policies"]
    assert cfg["analysis"]["baseline"] == "adaptiveload-packed"
    assert sum(POLICIES[p].peer for p in cfg["policies"]) == 2
    assert cfg["simulate"] == []
    cal = Calibration.load(FIXTURES / "tiny-prior.json")
    data = cfg["data"]
    samples = bucketize(synthesize(data["mixture"], data["num_samples"], seed=0),
                        mode=data["bucketing"], grid=data["grid"])
    for policy in cfg["policies"]:
        plan = build_plan(samples, policy, Budgets.resolve(calibration=cal),
                          cfg["train"]["world_size"], 0, cost_model=cal)
        assert plan.summary["num_planned"] == data["num_samples"], policy
        assert plan.summary["constraint_violations"] == 0, policy
