"""The refit from a run's rows (`costmodel.refit.refine`): it recovers known coefficients and
speed factors from noisy rows with outliers, stays near the prior on a few rows, gives the
same bits whatever the rows' order, and refuses rows it cannot use."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from adaptiveload.costmodel import Calibration, CostModel, features
from adaptiveload.costmodel.refit import PRIOR_ROWS, refine
from adaptiveload.errors import UserError

RANKS = 16
SLOW_RANK, SLOW = 5, 0.8
BUCKETS = np.array([1560, 4680, 9360, 18720, 32760])


@pytest.fixture(scope="module")
def prior() -> Calibration:
    return Calibration.load("h200-wan2.1-t2v-1.3b")


def truth_of(prior: Calibration) -> CostModel:
    """A device unlike the prior: c0 doubled, c_seq x3, linear work x0.7, attention x1.6."""
    c = prior.cost
    return replace(c, c0=2 * c.c0, c_seq=3 * c.c_seq, a=0.7 * c.a, b=1.6 * c.b)


def rows_of(truth: CostModel, steps: int, seed: int = 0, noise: float = 0.05) -> pd.DataFrame:
    """Micro-batches of 1-8 samples from the buckets on RANKS ranks, timed on `truth` with
    multiplicative noise, rank SLOW_RANK at SLOW speed; two outliers: the first step's
    compile (x8) and a pause (x4)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        for rank in range(RANKS):
            s = rng.choice(BUCKETS, size=int(rng.integers(1, 9)))
            seconds = float(truth.set_time(s)) * (1 + noise * rng.standard_normal())
            out.append(
                {
                    "step": step,
                    "rank": rank,
                    "compute_s": seconds / (SLOW if rank == SLOW_RANK else 1.0),
                    "samples": s.size,
                    "tokens": int(s.sum()),
                    "tokens_sq": int((s * s).sum()),
                }
            )
    table = pd.DataFrame(out)
    table.loc[0, "compute_s"] *= 8.0
    table.loc[len(table) // 2, "compute_s"] *= 4.0
    return table


def mix_error(cost: CostModel, truth: CostModel) -> float:
    """The worst relative error of `cost` against `truth` over typical packs of the buckets."""
    x = features(
        [1, 4, 8, 1, 2],
        [1560, 4 * 4680, 8 * 1560, 32760, 2 * 18720],
        [1560**2, 4 * 4680**2, 8 * 1560**2, 32760**2, 2 * 18720**2],
    )
    mine = cost.pack_time(x[:, 1], x[:, 2], x[:, 3])
    true = truth.pack_time(x[:, 1], x[:, 2], x[:, 3])
    return float(np.max(np.abs(mine / true - 1)))


def test_refit_recovers_coefficients_and_speeds_despite_noise_and_outliers(prior):
    truth = truth_of(prior)
    rows = rows_of(truth, steps=40)
    refit = refine(prior, rows, world_size=RANKS)
    assert mix_error(prior.cost, truth) > 0.2  # the prior is far off
    assert mix_error(refit.cost, truth) < 0.03
    for name, tol in (("a", 0.05), ("b", 0.05)):
        assert getattr(refit.cost, name) == pytest.approx(getattr(truth, name), rel=tol)
    speeds = np.array(refit.rank_speeds)
    assert speeds.size == RANKS and np.median(speeds) == pytest.approx(1.0)
    assert speeds[SLOW_RANK] == pytest.approx(SLOW, abs=0.03)
    assert np.delete(speeds, SLOW_RANK) == pytest.approx(1.0, abs=0.03)
    record = refit.extra["refit"]
    assert record["rows"] == len(rows) and record["rows_rejected"] >= 2
    assert record["rel_err_after"]["median"] < 0.05 < record["rel_err_before"]["median"]
    assert refit.cost.m_static == prior.cost.m_static  # no peak memory: memory unchanged


def test_outliers_do_not_move_the_refit(prior):
    truth = truth_of(prior)
    rows = rows_of(truth, steps=20)
    clean = rows.copy()
    clean.loc[0, "compute_s"] /= 8.0
    clean.loc[len(clean) // 2, "compute_s"] /= 4.0
    with_outliers, without = refine(prior, rows), refine(prior, clean)
    assert mix_error(with_outliers.cost, without.cost) < 0.005


def test_a_few_rows_move_the_prior_little(prior):
    truth = truth_of(prior)
    rows = rows_of(truth, steps=1, noise=0.0).iloc[1:4]  # three clean rows

    def on_rows(cost: CostModel) -> np.ndarray:
        return cost.pack_time(rows["samples"], rows["tokens"], rows["tokens_sq"])

    few = refine(prior, rows, world_size=RANKS)
    # three rows against the eight the prior counts as: about 3/11 of the way on the rows
    moved = (on_rows(few.cost) - on_rows(prior.cost)) / (on_rows(truth) - on_rows(prior.cost))
    assert np.all((moved > 0.1) & (moved < 0.4))
    many = refine(prior, rows_of(truth, steps=40), world_size=RANKS)
    assert mix_error(many.cost, truth) < 0.1 * mix_error(prior.cost, truth)


def test_row_order_is_irrelevant_to_the_last_bit(prior):
    rows = rows_of(truth_of(prior), steps=6, seed=3)
    first = refine(prior, rows, world_size=RANKS)
    shuffled = refine(prior, rows.sample(frac=1.0, random_state=7), world_size=RANKS)
    assert first.cost == shuffled.cost
    assert first.rank_speeds == shuffled.rank_speeds
    assert first.extra["refit"] == shuffled.extra["refit"]


def test_memory_refit_keeps_budgets_within_what_was_measured(prior):
    truth = replace(prior.cost, m_static=1.1 * prior.cost.m_static, m_tok=1.3 * prior.cost.m_tok)
    rows = rows_of(truth_of(prior), steps=10)
    rng = np.random.default_rng(1)
    rows["peak_bytes"] = [
        float(truth.pack_memory(n, s)) * (1 + 0.01 * rng.standard_normal())
        for n, s in zip(rows["samples"], rows["tokens"], strict=True)
    ]
    tokens = np.repeat(BUCKETS, 50)
    refit = refine(prior, rows, world_size=RANKS, tokens=tokens)
    assert refit.cost.m_tok == pytest.approx(truth.m_tok, rel=0.05)
    assert refit.extra["refit"]["memory"]["rows"] == len(rows)
    ceiling = max(prior.m_mem, rows["tokens"].max())
    assert refit.m_mem <= ceiling * (1 + 1e-9)
    assert refit.capacity_bytes == prior.capacity_bytes
    # a memory model that grew: the budget shrinks, never grows past the measured
    assert refit.m_mem < prior.for_tokens(tokens).m_mem


def test_refit_round_trips_through_a_calibration_file(prior):
    refit = refine(prior, rows_of(truth_of(prior), steps=3), world_size=RANKS)
    again = Calibration.from_dict(refit.to_dict())
    assert again.cost == refit.cost and again.rank_speeds == refit.rank_speeds


def test_rows_without_the_step_tables_columns_are_refused(prior):
    with pytest.raises(UserError, match="tokens_sq"):
        refine(
            prior, pd.DataFrame({"rank": [0], "compute_s": [1.0], "samples": [1], "tokens": [10]})
        )
    with pytest.raises(UserError, match="no rows"):
        refine(
            prior,
            pd.DataFrame(
                {
                    "rank": [0],
                    "compute_s": [0.0],
                    "samples": [1],
                    "tokens": [10],
                    "tokens_sq": [100],
                }
            ),
        )


def test_sequence_parallel_rows_refit_the_per_rank_cost(prior):
    """Groups of 2 ranks: the lead's row holds the set, the follower's none (step table);
    times are the set at degree 2 with its all-to-alls. The refit reads both ranks' rows at
    their degree and finds the single-rank coefficients."""
    from adaptiveload.costmodel import SequenceParallel

    truth = truth_of(prior)
    at_two = SequenceParallel.of(replace(prior, cost=truth)).cost_at(truth, 2)
    rng = np.random.default_rng(5)
    out = []
    for step in range(30):
        for lead in range(0, RANKS, 2):
            s = rng.choice(BUCKETS, size=int(rng.integers(1, 9)))
            for rank in (lead, lead + 1):
                seconds = float(at_two.set_time(s)) * (1 + 0.02 * rng.standard_normal())
                own = rank == lead
                out.append(
                    {
                        "step": step,
                        "rank": rank,
                        "compute_s": seconds,
                        "sp_degree": 2,
                        "samples": s.size if own else 0,
                        "tokens": int(s.sum()) if own else 0,
                        "tokens_sq": int((s * s).sum()) if own else 0,
                    }
                )
    refit = refine(prior, pd.DataFrame(out), world_size=RANKS)
    assert refit.extra["refit"]["rows"] == len(out)  # followers count, with their group's set
    assert mix_error(refit.cost, truth) < 0.03 < mix_error(prior.cost, truth)


def test_a_few_rows_of_one_shape_keep_every_term_of_the_prior():
    """4 rows of a 2-rank packed run on a CPU far faster than its prior (packs of one size,
    times a third of the prior's): the rows cannot tell c0 from the linear term. The refit
    lowers both, but no term below the prior's share of the estimate, n0 / (n0 + 4): it still
    prices a sample above 0 s (it once zeroed a, and packing divided by 0)."""
    prior = Calibration(
        "wan2.1-micro", "cpu", "model", CostModel(c0=0.1, a=1e-6, b=0.0), p=1.4,
        m_mem=2048, m_comp=60000, m_tok=2048,
    )
    tokens = np.array([1980, 2040, 1900, 2010])
    rows = pd.DataFrame(
        {
            "step": [0, 0, 1, 1],
            "rank": [0, 1, 0, 1],
            "samples": [5, 6, 4, 7],
            "tokens": tokens,
            "tokens_sq": tokens**2 // 5,
            "compute_s": [0.031, 0.034, 0.029, 0.035],
        }
    )
    refit = refine(prior, rows, world_size=2).cost
    share = PRIOR_ROWS / (PRIOR_ROWS + len(rows))
    assert refit.c0 < 0.9 * prior.cost.c0  # the rows moved it
    assert refit.a >= share * prior.cost.a * (1 - 1e-12)
    assert refit.b == 0.0 and refit.c_seq == 0.0  # terms the prior lacks stay out
    assert np.all(refit.per_sample_time(np.array([100.0, 2000.0])) > 0)


def test_a_slow_rank_on_quiet_rows_is_a_speed_not_outliers(prior):
    """Rows of 1% noise (a quiet machine) from a prior of the device's form: their spread is
    1%, so the slow rank's rows, 25% off the others, are 25 spreads out. They are its speed
    (taken before the outlier weights), not outliers; the compile and the pause still are."""
    truth = truth_of(prior)
    refit = refine(
        replace(prior, cost=truth), rows_of(truth, steps=6, noise=0.01), world_size=RANKS
    )
    assert refit.rank_speeds[SLOW_RANK] == pytest.approx(SLOW, abs=0.02)
    assert refit.extra["refit"]["rows_rejected"] == 2
