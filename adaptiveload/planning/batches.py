"""What a policy forms an epoch's micro-batches from (``EpochInputs``) and what it hands the
plan back (``MicroBatches``), and the homogeneous way of forming them (``bucket_cuts``).

Every policy of ``policies.POLICIES`` owns its micro-batches: ``Policy.micro_batches(epoch)``
forms them and deals them to (step, rank) slots; ``plan.build_plan`` only lays out, counts and
digests what it gets back, so a new way of forming batches (packs, sequence-parallel groups)
is a new policy, not a new branch in the plan. The homogeneous policies cut buckets here
(steps 1-4 of ``plan``); the packed one forms packs (``packing``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.errors import UserError
from adaptiveload.planning.budgets import Budgets
from adaptiveload.planning.dealing import shuffled_by_code
from adaptiveload.step_table import SP_DEGREE


@dataclass(frozen=True)
class Buckets:
    """Each sample's bucket index `of`; each bucket's `shape` [buckets, 3] (frames, height,
    width) and `tokens` (checked: one count per shape, shapes positive, < 2^20)."""

    of: np.ndarray
    shape: np.ndarray
    tokens: np.ndarray

    def token_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """The samples' distinct token counts (sorted) and how many samples have each:
        ``np.unique(tokens, return_counts=True)`` of the samples (every bucket holds one),
        from the few buckets: no sort of a million samples."""
        values, inverse = np.unique(self.tokens, return_inverse=True)
        per_bucket = np.bincount(self.of, minlength=self.tokens.size)
        count = np.bincount(inverse, weights=per_bucket, minlength=values.size)
        return values, count.astype(np.int64)


@dataclass(frozen=True)
class Batches:
    """The epoch's micro-batches: batch k holds samples ``order[start[k] : start[k] + size[k]]``
    (row positions), all with ``tokens[k]`` tokens (None for packs, which mix lengths)."""

    order: np.ndarray
    start: np.ndarray
    size: np.ndarray
    tokens: np.ndarray | None = None


@dataclass(frozen=True)
class EpochInputs:
    """What one epoch's micro-batches are formed from: the samples' buckets and tokens (row
    order), the budgets, the cost model (None: proxies), the ranks, the dealing window (None:
    whole epoch), the epoch's one Generator and the step count asked for (None: the policy's
    own)."""

    buckets: Buckets
    tokens: np.ndarray
    budgets: Budgets
    cost_model: CostModel | Calibration | None
    world_size: int
    window_steps: int | None
    rng: np.random.Generator
    steps: int | None

    @property
    def cost(self) -> CostModel | None:
        """The cost model alone (a Calibration's), None without one."""
        cal = self.cost_model
        return cal.cost if isinstance(cal, Calibration) else cal


@dataclass(frozen=True)
class MicroBatches:
    """A policy's micro-batches of one epoch, dealt: `slots` lists the batch each slot runs
    (slot j: step j // N, rank j % N) and `slot_pad` flags padding repeats; `oversize` flags
    the samples over a budget on their own, `violations` counts batches of more than one
    sample over one; `dealt_on` names what a cost-aware deal ordered the slots by (None: dealt
    as shuffled); `summary`: fields of the policy's own for the plan summary; `slot_degree`:
    where some micro-batches run on sequence-parallel groups, each slot's degree (a group of
    d ranks: its pack on the first of its d consecutive slots, -1 on the others)."""

    batches: Batches
    slots: np.ndarray
    slot_pad: np.ndarray
    oversize: np.ndarray
    violations: int
    dealt_on: str | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    # per slot, the degree of the sequence-parallel group whose first rank it is (None: every
    # slot one rank's); a group's other ranks' slots hold batch -1 (``groups``)
    slot_degree: np.ndarray | None = None


def table_degrees(table: pd.DataFrame) -> np.ndarray:
    """Each row's sequence-parallel degree: the plan table's `SP_DEGREE` column (present
    where some group has d > 1, ``groups``; a row's `rank` then its group's first rank), 1
    without one."""
    if SP_DEGREE in table.columns:
        return table[SP_DEGREE].to_numpy(np.int64)
    return np.ones(len(table), dtype=np.int64)


def bucket_cuts(
    epoch: EpochInputs, b_size: np.ndarray, policy: str
) -> tuple[Batches, np.ndarray, np.ndarray]:
    """Steps 1-4 of the homogeneous policies: each bucket shuffled and cut into batches of
    `b_size` (its B(S); more, equal ones for a step count asked for), the batch list shuffled
    and padded to whole steps. The batches, the slot list and its padding flags."""
    counts = _batch_counts(epoch, b_size, policy)
    batches = _cut(epoch.buckets, b_size, epoch.rng, counts)
    slots, slot_pad = shuffle_and_pad(batches.size.size, epoch.world_size, epoch.rng)
    return batches, slots, slot_pad


def _batch_counts(epoch: EpochInputs, b_size: np.ndarray, policy: str) -> np.ndarray:
    """How many batches each bucket is cut into: ⌈n_b / B(S_b)⌉ (the policy's rule), or, for
    `steps` steps, more where the rule gives fewer than (steps - 1) N + 1 batches: the epoch
    then gets min(steps N, samples) batches, each new one split off a bucket whose batches
    are costliest (water-filling on the predicted batch time n_b w_b / k_b, w_b the
    per-sample cost, or S^p without a cost model), and a bucket's batches are as equal as
    whole samples allow. Batches only shrink, so no budget is broken."""
    buckets, budgets, cost = epoch.buckets, epoch.budgets, epoch.cost
    world_size, steps = epoch.world_size, epoch.steps
    count = np.bincount(buckets.of, minlength=buckets.tokens.size)
    k = -(-count // b_size)
    if steps is None or -(-int(k.sum()) // world_size) == steps:
        return k
    if -(-int(k.sum()) // world_size) > steps:
        raise UserError(
            f"steps_per_epoch={steps}: policy {policy} needs at least "
            f"{-(-int(k.sum()) // world_size)} steps for these samples on {world_size} ranks "
            "under its budgets; give more steps or free"
        )
    target = min(steps * world_size, int(count.sum()))
    if target <= (steps - 1) * world_size:
        raise UserError(
            f"steps_per_epoch={steps}: {int(count.sum())} samples fill at most "
            f"{-(-int(count.sum()) // world_size)} steps on {world_size} ranks; give fewer steps"
        )
    tok = buckets.tokens.astype(np.float64)
    w = cost.per_sample_time(tok) if cost is not None else tok ** (budgets.p or 1.0)
    work = count * w
    while k.sum() < target:  # a round splits one more batch off each of the costliest buckets
        per_batch = np.where(k < count, work / k, -1.0)
        take = min(target - int(k.sum()), int((per_batch >= 0).sum()))
        k[np.argsort(-per_batch, kind="stable")[:take]] += 1
    return k


def _cut(
    buckets: Buckets, b_size: np.ndarray, rng: np.random.Generator, n_batches: np.ndarray
) -> Batches:
    """Steps 1-2: shuffle within each bucket shape, cut each bucket into its `n_batches`:
    batches of B(S) (the last one the rest), or, where steps were matched, as equal as
    whole samples allow."""
    bucket, bucket_tokens = buckets.of, buckets.tokens
    n_buckets = bucket_tokens.size
    order = shuffled_by_code(bucket, n_buckets, rng)  # grouped by bucket, random inside
    count = np.bincount(bucket, minlength=n_buckets)
    split = n_batches > -(-count // b_size)  # more batches than the rule: equal sizes
    sorted_bucket = bucket[order]
    pos = np.arange(bucket.size) - starts(count)[sorted_bucket]
    within = np.where(
        split[sorted_bucket],
        pos * n_batches[sorted_bucket] // np.maximum(count[sorted_bucket], 1),
        pos // b_size[sorted_bucket],
    )
    batch_of_sorted = starts(n_batches)[sorted_bucket] + within
    size = np.bincount(batch_of_sorted, minlength=int(n_batches.sum()))
    batch_bucket = np.repeat(np.arange(n_buckets), n_batches)
    return Batches(order=order, start=starts(size), size=size, tokens=bucket_tokens[batch_bucket])


def shuffle_and_pad(
    n_batches: int, world_size: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Steps 3-4: the shuffled batch list, padded to whole steps with flagged repeats."""
    missing = -(-n_batches // world_size) * world_size - n_batches
    pad = rng.choice(n_batches, missing, replace=missing > n_batches)
    slots = np.concatenate((rng.permutation(n_batches), pad))
    slot_pad = np.zeros(slots.size, dtype=bool)
    slot_pad[n_batches:] = True
    return slots, slot_pad


def starts(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sum: where each run of `counts` begins."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
