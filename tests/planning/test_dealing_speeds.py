"""Dealing to ranks of different speeds (`dealing.deal_in_windows` with `speeds`): a slow
rank gets proportionally cheaper micro-batches, and equal speeds deal as before."""

from __future__ import annotations

import numpy as np

from adaptiveload.costmodel import Calibration
from adaptiveload.planning.dealing import deal_balanced, rank_speeds

RANKS, STEPS = 16, 200


def slot_costs(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(0.0, 0.6, RANKS * STEPS)


def step_times(cost: np.ndarray, order: np.ndarray, speeds: np.ndarray) -> np.ndarray:
    """Each step's time: the slowest of its ranks, rank r at cost / speeds[r]."""
    return (cost[order].reshape(STEPS, RANKS) / speeds).max(axis=1)


def test_a_slow_rank_gets_less_work_and_the_epoch_is_shorter():
    cost = slot_costs()
    speeds = np.ones(RANKS)
    speeds[3] = 0.8
    blind = deal_balanced(cost, RANKS, 50, np.random.default_rng(1))
    aware = deal_balanced(cost, RANKS, 50, np.random.default_rng(1), speeds)
    assert np.array_equal(np.sort(aware), np.arange(cost.size))  # every slot once
    per_rank = cost[aware].reshape(STEPS, RANKS).sum(axis=0)
    share = per_rank[3] / np.median(np.delete(per_rank, 3))
    assert 0.75 < share < 0.85
    assert step_times(cost, aware, speeds).sum() < 0.9 * step_times(cost, blind, speeds).sum()


def test_equal_speeds_deal_exactly_as_without_them():
    cost = slot_costs(2)
    plain = deal_balanced(cost, RANKS, 50, np.random.default_rng(3))
    cal = Calibration.load("h200-wan2.1-t2v-1.3b")
    cal.extra["rank_speeds"] = [1.0] * RANKS
    assert rank_speeds(cal, RANKS) is None  # all alike: the plain deal
    cal.extra["rank_speeds"] = [1.0] * (RANKS - 1) + [0.9]
    assert rank_speeds(cal, RANKS - 1) is None  # another world size: not this plan's ranks
    assert rank_speeds(cal, RANKS) is not None
    again = deal_balanced(cost, RANKS, 50, np.random.default_rng(3), None)
    assert np.array_equal(plain, again)
