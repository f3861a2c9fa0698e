"""Dealing micro-batches to (step, rank) slots.

A *slot list* is an ordering of batches: slot j runs at step ``j // N`` on rank ``j % N``
(Open-Sora's VariableVideoBatchSampler: rank r takes the r-th entry of the i-th group of N).
The cost-blind policies use the shuffled batch list as it is; ``deal_balanced`` reorders it.

Why sort-and-chunk rather than LPT / Karmarkar-Karp: with one micro-batch per rank per step
the step's compute time is the max over its N batches, and with the batches fixed, the sum
over steps of those maxima is minimised exactly by sorting the batches by cost and cutting
the sorted list into consecutive groups of N (exchange argument: the costliest batch sets
one step's time whatever it is grouped with, so it should be grouped with the next N-1
costliest, and so on). LPT/KK solve a different problem (several items per bin, bins =
ranks): which samples share a micro-batch, once a micro-batch may hold samples of several
lengths (``adaptiveload.planning.packing``, which deals its packs here). Sorting is
O(n log n) and vectorised.

**Ranks of different speeds.** Where a refit measured per-rank speed factors v_r
(`Calibration.rank_speeds`: rank r runs a micro-batch in its predicted time / v_r), a step's
time is max_r cost/v_r, and equal costs leave the slow rank the step's straggler. So each step
k of the chunked list gets a level q_k (its mean cost), every slot (k, r) a target q_k v_r, and
the batches sorted by cost go to the targets sorted by value, rank for rank: a rank at 0.8x
takes batches about 0.8x as costly as its step's others. With every speed equal this is the
sort-and-chunk above, draw for draw (the same plans); the ranks of a step are then not
shuffled, since which rank holds which batch is the point.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from adaptiveload.costmodel import Calibration

# Balance within windows of this many steps: a batch moves at most this far from where the
# shuffled list put it, so every stretch of the epoch keeps a representative mix of buckets.
# 128 steps keeps predicted imbalance near 2% on paper-mixed at N=16 (tests/bench); None
# (the whole epoch) balances best, and loses no randomness of step order, only locality.
DEFAULT_WINDOW_STEPS = 128


def narrow(codes: np.ndarray, n: int) -> np.ndarray:
    """Codes in [0, n) as int16 where they fit: a stable argsort of int16 keys is a radix sort
    (O(n)), and a gather through them reads a quarter of the bytes."""
    return codes.astype(np.int16 if n <= np.iinfo(np.int16).max else np.int64, copy=False)


def shuffled_by_code(codes: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """The positions of `codes` (in [0, n)) grouped by code in code order, random inside each
    group: the order in which a policy cuts batches or packs its samples."""
    perm = rng.permutation(codes.size)
    return perm[np.argsort(narrow(codes[perm], n), kind="stable")]


def rank_speeds(cost_model: Any, world_size: int) -> np.ndarray | None:
    """The per-rank speed factors a plan on `world_size` ranks deals by: a Calibration's
    `rank_speeds` when it has one factor per rank and they differ; None (every rank alike)
    otherwise."""
    speeds = cost_model.rank_speeds if isinstance(cost_model, Calibration) else None
    if speeds is None or len(speeds) != world_size or len(set(speeds)) == 1:
        return None
    return np.asarray(speeds, dtype=np.float64)


def deal_balanced(
    cost: np.ndarray,
    world_size: int,
    window_steps: int | None,
    rng: np.random.Generator,
    speeds: np.ndarray | None = None,
) -> np.ndarray:
    """A permutation of slots (length a multiple of `world_size`) balancing each step.

    Within each window of `window_steps` steps (None: the whole epoch), slots are sorted by
    `cost` and cut into steps of `world_size`; the steps of a window are then shuffled, and
    the ranks within a step too, so the order of steps stays random. `speeds`: per-rank
    speed factors (module docstring; None: every rank alike).
    """
    n_slots = np.asarray(cost).size
    if n_slots % world_size:
        raise ValueError("slot count must be a multiple of world_size (pad first)")
    steps = n_slots // world_size
    per_window = steps if window_steps is None else max(1, int(window_steps))
    return deal_in_windows(cost, world_size, np.arange(steps) // per_window, rng, speeds)


def deal_in_windows(
    cost: np.ndarray,
    world_size: int,
    step_window: np.ndarray,
    rng: np.random.Generator,
    speeds: np.ndarray | None = None,
) -> np.ndarray:
    """`deal_balanced` with the windows given: `step_window[s]` is the (non-decreasing) window
    of step s, so windows may differ in length (the packed policy's do)."""
    cost = np.asarray(cost, dtype=np.float64)
    step_window = np.asarray(step_window)
    steps = step_window.size
    if cost.size != steps * world_size:
        raise ValueError("slot count must be world_size times the number of steps")
    by_cost = _by_cost(cost, step_window, world_size)  # cheapest first in each window
    chunk_order = np.lexsort((rng.random(steps), step_window))  # shuffle steps in a window
    new_step = np.empty(steps, dtype=np.int64)
    new_step[chunk_order] = np.arange(steps)
    if speeds is not None:
        chunk = np.arange(cost.size) // world_size  # the step each sorted slot would form
        return _by_speed(cost, by_cost, chunk, new_step, step_window, speeds)
    # shuffle ranks in a step: sorted chunk k (slots k N .. k N + N - 1) becomes step
    # new_step[k], its slots in the order of their random keys (ties by slot, as a stable
    # sort over all slots by (new step, key) has them)
    within = np.argsort(rng.random(cost.size).reshape(steps, world_size), axis=1, kind="stable")
    within += np.arange(0, cost.size, world_size)[:, None]
    return by_cost[within[chunk_order].ravel()]


def _by_cost(cost: np.ndarray, step_window: np.ndarray, world_size: int) -> np.ndarray:
    """The slots in order of their window, then of `cost` (ties by slot): a stable sort of
    each window's slots, which are consecutive (`step_window` does not decrease)."""
    bounds = np.searchsorted(step_window, np.unique(step_window)) * world_size
    ends = np.append(bounds[1:], cost.size)
    parts = [a + np.argsort(cost[a:b], kind="stable") for a, b in zip(bounds, ends, strict=True)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _by_speed(
    cost: np.ndarray,
    by_cost: np.ndarray,
    chunk: np.ndarray,
    new_step: np.ndarray,
    step_window: np.ndarray,
    speeds: np.ndarray,
) -> np.ndarray:
    """The sorted slots `by_cost` (chunk k of them forming step k) matched to targets
    q_k v_r within each window (module docstring), steps placed at `new_step`."""
    world_size = speeds.size
    steps = step_window.size
    level = np.bincount(chunk, cost[by_cost], minlength=steps) / world_size
    target = (level[:, None] * speeds[None, :]).ravel()  # slot (k, r) at k N + r
    window = np.repeat(step_window, world_size)
    by_target = np.lexsort((np.arange(target.size), target, window))
    out = np.empty(cost.size, dtype=np.int64)
    step, rank = np.divmod(by_target, world_size)
    out[new_step[step] * world_size + rank] = by_cost
    return out
