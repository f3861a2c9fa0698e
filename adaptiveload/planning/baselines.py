"""The field's own ways of forming micro-batches, written here as baselines from their public
descriptions (no code of theirs is copied): what a user would pick instead of this project's
policies. ``policies`` wraps each in a ``Policy`` (``token-ffd``, ``token-kk``,
``flop-greedy``; the fourth, ``time-buckets``, is a B(S) rule and lives there whole);
docs/baselines.md says where each comes from and how it compares.

All three here form packs (samples of any lengths in one micro-batch) and hold every pack to
the same memory limit as ``adaptiveload-packed`` (``memory_limits``: its limits without the
compute one, which is this project's and none of theirs): a pack's predicted bytes under the
device's usable memory where the calibration knows it, else its tokens under M_mem (and
under ``pack_tokens`` when a user sets it). A sample over that limit on its own runs alone,
as under every policy. None of them is aware of what a pack costs across the ranks of a step
beyond its own balancing key (tokens, or an estimate of FLOPs).

- ``ffd_packs``: token-count packing (NVIDIA NeMo DFM on Megatron-Energon, which trains
  Wan 2.1): first-fit-decreasing of samples by tokens into packs up to the limit, the packs
  shuffled and dealt to ranks without regard to their cost;
- ``step_partitions`` with ``kk_partition`` (``karmarkar_karp``): verl's sequence-length balancing
  (``get_seqlen_balanced_partitions``): each step's global batch of samples split over the N
  ranks by the Karmarkar-Karp largest-differencing method on token counts;
- ``step_partitions`` with ``greedy_partition``: KnapFormer's workload balancing: each step's
  samples, costliest first by an estimate of FLOPs (``flop_workload``), each into the
  least-loaded of the N bags (ranks) that has room.

Steps of the last two are global batches of a fixed number of samples (verl's and
KnapFormer's ``train_batch_size``): the shuffled epoch cut into K equal parts, K the fewest
steps the memory volume allows (or the step count asked for). A step whose partition breaks
the memory limit runs as two steps of half its samples (verl's dynamic batch size gives such
a step more micro-batches; here one micro-batch per rank per step, so each is a step).

``ffd_packs`` places the samples of one token count at once (0.15 CPU-s for 200,000
paper-mixed samples on 64 ranks, measured on the 2-core development machine); the two
per-step partitions loop over samples in Python with numpy over ranks (2.6 and 4.4 CPU-s
there): baselines to compare against, not planners for 10M-sample epochs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import pandas as pd

from adaptiveload.costmodel import Calibration, CostModel
from adaptiveload.errors import UserError
from adaptiveload.model.analytic import flop_terms
from adaptiveload.model.architectures import get_config
from adaptiveload.planning.batches import (
    Batches,
    EpochInputs,
    MicroBatches,
    shuffle_and_pad,
    starts,
)
from adaptiveload.planning.budgets import MAX_BUDGET, Budgets
from adaptiveload.planning.dealing import shuffled_by_code
from adaptiveload.planning.packing import PackLimits, types_of

# the name PackLimits.of gives the compute limit (Σ S^p <= M_comp): the baselines know none
COMPUTE_LIMIT = "compute"


def memory_limits(
    budgets: Budgets, cost_model: CostModel | Calibration | None
) -> PackLimits:
    """The packed policy's limits of one pack (``PackLimits.of``) but its compute one: the
    device's memory in bytes (a Calibration with a capacity) or M_mem in tokens, and any cap
    on a pack's tokens. M_comp and p need not be set."""
    full = PackLimits.of(
        replace(budgets, m_comp=budgets.m_comp or MAX_BUDGET, p=budgets.p or 1.0), cost_model
    )
    keep = [i for i, name in enumerate(full.names) if name != COMPUTE_LIMIT]

    def pick(values: tuple) -> tuple:
        return tuple(values[i] for i in keep)

    return PackLimits(
        per_token=pick(full.per_token), power=pick(full.power),
        per_sample=pick(full.per_sample), caps=pick(full.caps), hard=pick(full.hard),
        names=pick(full.names),
    )


def flop_workload(tokens: np.ndarray, cost_model: CostModel | Calibration | None,
                  p: float | None) -> np.ndarray:
    """KnapFormer's balancing key: a sample's forward FLOPs from its model's shape
    (``model.analytic.flop_terms``: linear in S, attention in S^2, per-sample text terms),
    where the calibration names a registered model; else the planner's proxy S^p (S without
    p)."""
    s = np.asarray(tokens, dtype=np.float64)
    if isinstance(cost_model, Calibration):
        try:
            return flop_terms(get_config(cost_model.model)).forward(s)
        except UserError:  # a model of unknown shape: no FLOPs to count
            pass
    return s ** (p or 1.0)


class _Samples:
    """The epoch's samples as the baselines see them: each sample position's limit use
    [samples, limits] (``types_of``), whether it runs alone (over a limit on its own:
    oversize), and the largest sums the caps hold (``EpochLimits.ceiling``: a cap may be
    filled exactly)."""

    def __init__(self, epoch: EpochInputs) -> None:
        self.limits = memory_limits(epoch.budgets, epoch.cost_model)
        code, values = pd.factorize(epoch.tokens, sort=True)
        types = types_of(code, np.asarray(values, dtype=np.int64), self.limits, epoch.cost,
                         epoch.budgets.p or 1.0)
        self.use = types.use[types.of]
        self.alone = types.alone[types.of]
        self.caps = types.caps
        self.values, self.count = types.tokens, np.bincount(types.of)

    def fits(self, members: np.ndarray) -> bool:
        """Whether a pack of these sample positions is within the limits (one runs alone)."""
        return members.size <= 1 or bool(np.all(self.use[members].sum(axis=0) <= self.caps))

    def min_steps(self, world_size: int) -> int:
        """The fewest steps the memory volume allows (``EpochLimits.min_micro_batches``)."""
        return max(1, -(-self.limits.min_micro_batches(self.values, self.count) // world_size))


def ffd_packs(epoch: EpochInputs) -> MicroBatches:
    """Token-count packing: first-fit-decreasing by tokens (equal ones in random order) into
    packs within the memory limit, more (split) packs for a step count asked for, shuffled and
    dealt as they come (module docstring)."""
    samples = _Samples(epoch)
    tokens = epoch.tokens
    code, values = pd.factorize(-tokens, sort=True)  # longest first
    order = shuffled_by_code(code, values.size, epoch.rng)
    packs = _first_fit(order, tokens[order], samples)
    packs = _to_step_count(packs, epoch, tokens, samples, "token-ffd")
    slots, slot_pad = shuffle_and_pad(len(packs), epoch.world_size, epoch.rng)
    return _micro_batches(packs, slots, slot_pad, samples)


def _first_fit(order: np.ndarray, tokens: np.ndarray, samples: _Samples) -> list[np.ndarray]:
    """Each sample of `order` (`tokens` each: runs of one count, longest first) into the first open
    pack with room, else a new one; a sample that must run alone gets a pack no other joins.
    A run of identical samples is placed at once, as one at a time would place it: first fit
    fills each open pack in turn with as many as it has room for, then opens new ones."""
    room = np.empty((samples.caps.size, order.size))  # [limits, packs]; a pack per sample at most
    pack_of = np.empty(order.size, dtype=np.int64)
    n_open = 0
    bounds = np.flatnonzero(np.diff(tokens)) + 1
    for run in np.split(np.arange(order.size), bounds):
        use, m = samples.use[order[run[0]]], run.size
        if samples.alone[order[run[0]]]:
            pack_of[run] = n_open + np.arange(m)
            room[:, n_open : n_open + m] = -1.0
            n_open += m
            continue
        used = use > 0
        fits = np.floor(np.min(room[used, :n_open] / use[used, None], axis=0, initial=np.inf))
        fits = np.clip(fits, 0, m).astype(np.int64)
        placed = min(m, int(fits.sum()))
        per_new = int(np.floor(np.min(samples.caps[used] / use[used])))
        new = -(-(m - placed) // per_new)
        room[:, n_open : n_open + new] = samples.caps[:, None]
        slots = np.concatenate((fits, np.full(new, per_new)))
        pack_of[run] = np.searchsorted(np.cumsum(slots), np.arange(m), side="right")
        n_open += new
        room[:, :n_open] -= use[:, None] * np.bincount(pack_of[run], minlength=n_open)
    by_pack = np.argsort(pack_of, kind="stable")
    return np.split(order[by_pack], np.cumsum(np.bincount(pack_of, minlength=n_open))[:-1])


def _to_step_count(
    packs: list[np.ndarray], epoch: EpochInputs, tokens: np.ndarray, samples: _Samples,
    policy: str,
) -> list[np.ndarray]:
    """`packs` for the step count asked for (none: as they are): UserError if they need more
    steps; more packs, each split off the pack with the most tokens (halves of near-equal
    tokens), until the steps are filled (splitting only lowers a pack's use)."""
    steps, n = epoch.steps, epoch.world_size
    if steps is None:
        return packs
    need = -(-len(packs) // n)
    _check_steps(steps, need, tokens.size, n, policy)
    target = min(steps * n, tokens.size)
    heap = [(-int(tokens[p].sum()), i, p) for i, p in enumerate(packs)]
    heapq.heapify(heap)
    counter = itertools.count(len(packs))
    while len(heap) < target:
        _, _, pack = heapq.heappop(heap)
        by_tokens = pack[np.argsort(-tokens[pack], kind="stable")]
        for half in (by_tokens[0::2], by_tokens[1::2]):
            heapq.heappush(heap, (-int(tokens[half].sum()), next(counter), half))
    return [p for _, _, p in sorted(heap, key=lambda e: e[1])]


def _check_steps(steps: int, need: int, n_samples: int, world_size: int, policy: str) -> None:
    """UserError unless `steps` steps can hold these samples: at least the `need` the policy's
    own way takes, and few enough that each step has a sample."""
    if steps < need:
        raise UserError(
            f"steps_per_epoch={steps}: policy {policy} needs at least {need} steps for these "
            f"samples on {world_size} ranks under the memory limit; give more steps or free"
        )
    if n_samples <= (steps - 1) * world_size:
        raise UserError(
            f"steps_per_epoch={steps}: {n_samples} samples fill at most "
            f"{-(-n_samples // world_size)} steps on {world_size} ranks; give fewer steps"
        )


# a partitioner: one step's sample positions into at most N parts (lists of positions), or
# None where it finds no way within the memory limit
Partition = Callable[[np.ndarray, int, _Samples, EpochInputs], list[np.ndarray] | None]


def step_partitions(epoch: EpochInputs, partition: Partition, policy: str) -> MicroBatches:
    """Global batches of equal sample counts (the shuffled epoch cut into K steps: the fewest
    the memory volume allows, or the count asked for), each split over the N ranks by
    `partition`; a step whose split breaks the memory limit runs as two of half its samples
    each (module docstring). Ranks a step leaves empty repeat a random pack (padding)."""
    samples = _Samples(epoch)
    n, n_samples = epoch.world_size, epoch.tokens.size
    steps = epoch.steps if epoch.steps is not None else samples.min_steps(n)
    _check_steps(steps, 1, n_samples, n, policy)
    pending = np.array_split(epoch.rng.permutation(n_samples), steps)[::-1]
    parts_of_steps: list[list[np.ndarray]] = []
    while pending:
        step = pending.pop()
        parts = partition(step, n, samples, epoch)
        if parts is not None and all(samples.fits(p) for p in parts):
            parts_of_steps.append([p for p in parts if p.size])
        else:  # at most N samples always fit (one a rank), so halving ends
            first, second = np.array_split(step, 2)
            pending += [second, first]
    if epoch.steps is not None and len(parts_of_steps) > epoch.steps:
        raise UserError(
            f"steps_per_epoch={epoch.steps}: policy {policy}'s global batches of "
            f"{-(-n_samples // epoch.steps)} samples break the memory limit on "
            f"{len(parts_of_steps) - epoch.steps} steps; give more steps or free"
        )
    packs = [p for parts in parts_of_steps for p in parts]
    n_real = np.array([len(parts) for parts in parts_of_steps])
    first = starts(n_real)
    rank = np.arange(n)
    real = rank[None, :] < n_real[:, None]  # [steps, N]
    repeat = epoch.rng.integers(0, len(packs), size=real.shape)
    slots = np.where(real, first[:, None] + rank[None, :], repeat).ravel()
    return _micro_batches(packs, slots, ~real.ravel(), samples)


def karmarkar_karp(weights: np.ndarray, k: int) -> list[np.ndarray]:
    """The indices of `weights` in k parts of near-equal sums by Karmarkar-Karp's largest
    differencing for k parts: every item starts as a partial partition (itself in one part,
    k - 1 empty); the two partial partitions of largest spread (max - min part) are merged,
    the largest part of one with the smallest of the other, until one is left. Parts are
    tracked as a tree of merges (a part is a leaf, an item, or the union of two parts)."""
    w = np.asarray(weights, dtype=np.float64)
    children: list[tuple[int, int]] = []  # node len(w) + i: the union of children[i]
    heap = []
    for i in np.argsort(w, kind="stable"):  # ascending, as a heap of ties pops them
        sums = np.zeros(k)
        nodes = np.full(k, -1, dtype=np.int64)
        sums[0], nodes[0] = w[i], i
        heap.append((-w[i], int(i), sums, nodes))
    heapq.heapify(heap)
    counter = itertools.count(w.size)
    while len(heap) > 1:
        _, _, sums_a, nodes_a = heapq.heappop(heap)
        _, _, sums_b, nodes_b = heapq.heappop(heap)
        sums = sums_a + sums_b[::-1]
        node_b = nodes_b[::-1]
        both = (nodes_a >= 0) & (node_b >= 0)
        nodes = np.where(nodes_a >= 0, nodes_a, node_b)
        new = w.size + len(children) + np.arange(int(both.sum()))
        children += zip(nodes_a[both].tolist(), node_b[both].tolist(), strict=True)
        nodes[both] = new
        by_sum = np.argsort(-sums, kind="stable")
        sums, nodes = sums[by_sum], nodes[by_sum]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), next(counter), sums, nodes))
    return [_leaves(int(node), w.size, children) for node in heap[0][3]]


def _leaves(node: int, n_items: int, children: list[tuple[int, int]]) -> np.ndarray:
    """The items under `node` of a merge tree (-1: an empty part)."""
    out, stack = [], [node] if node >= 0 else []
    while stack:
        x = stack.pop()
        if x < n_items:
            out.append(x)
        else:
            stack.extend(children[x - n_items])
    return np.asarray(sorted(out), dtype=np.int64)


def kk_partition(
    step: np.ndarray, n: int, samples: _Samples, epoch: EpochInputs
) -> list[np.ndarray]:
    """verl's balancing of one step: Karmarkar-Karp on token counts over the N ranks."""
    return [step[part] for part in karmarkar_karp(epoch.tokens[step], n)]


def greedy_partition(
    step: np.ndarray, n: int, samples: _Samples, epoch: EpochInputs
) -> list[np.ndarray] | None:
    """KnapFormer's balancing of one step: its samples costliest first by estimated FLOPs
    (``flop_workload``; equal ones in the step's random order), each into the least-loaded
    of the N bags with room for it (a sample that must run alone: an empty bag); None if no
    bag has room."""
    work = flop_workload(epoch.tokens[step], epoch.cost_model, epoch.budgets.p)
    load, held = np.zeros(n), np.zeros(n, dtype=np.int64)
    room = np.repeat(samples.caps[:, None], n, axis=1)
    bag = np.empty(step.size, dtype=np.int64)
    for i in np.argsort(-work, kind="stable"):
        pos = step[i]
        if samples.alone[pos]:
            open_ = held == 0
        else:
            open_ = np.all(room >= samples.use[pos][:, None], axis=0)
        if not open_.any():
            return None
        b = int(np.argmin(np.where(open_, load, np.inf)))
        bag[i] = b
        load[b] += work[i]
        held[b] += 1
        room[:, b] = -1.0 if samples.alone[pos] else room[:, b] - samples.use[pos]
    return [step[bag == b] for b in range(n)]


def _micro_batches(
    packs: list[np.ndarray], slots: np.ndarray, slot_pad: np.ndarray, samples: _Samples
) -> MicroBatches:
    """The plan's view of `packs` dealt to `slots`; `violations`: packs of two or more samples
    over a memory limit, counted from their members again (the construction promises none)."""
    size = np.array([p.size for p in packs], dtype=np.int64)
    over = np.array([not samples.fits(p) for p in packs])
    return MicroBatches(
        batches=Batches(order=np.concatenate(packs), start=starts(size), size=size),
        slots=np.asarray(slots, dtype=np.int64),
        slot_pad=np.asarray(slot_pad, dtype=bool),
        oversize=samples.alone,
        violations=int(over.sum()),
        summary={"pack_limits": samples.limits.as_dict()},
    )
