"""Packed micro-batches (policy ``adaptiveload-packed``): which samples share one rank's
micro-batch, so that every rank of a step holds near-equal predicted work and no micro-batch
breaks a budget.

A *pack* is a set of samples of any lengths that runs as one token stream with per-sample
(varlen) attention; it costs what its samples cost (``CostModel.pack_time`` and
``pack_memory`` over n, Σ S, Σ S²). Homogeneous batches leave two things on the table that
packing takes: which samples share a step is no longer fixed by B(S), so each step's ranks
can be equalised, not just sorted; and a pack fills the device's memory by what its samples
really need, where M_mem (a token budget sized for a batch of the manifest's *smallest*
samples, whose per-sample memory m_seq dominates) leaves room unused under longer ones.

**Limits of one pack** (``PackLimits``), each a sum over its samples under a cap:

- memory: with a calibration that knows its device's capacity, the predicted bytes above the
  static part, ``m_tok Σ S + m_seq n <= capacity (1 - headroom) - m_static``: the memory M_mem
  is derived to stay under. Without one, ``Σ S <= M_mem``; an explicit M_mem other than the
  calibration's caps ``Σ S`` too (a user's smaller memory budget is kept);
- compute: ``Σ S^p <= M_comp``, so the paper's compute bound holds per micro-batch;
- tokens: ``Σ S <= pack_tokens`` when set (``Budgets.pack_tokens``: a user's global batch).

A sample over a limit on its own runs alone (``num_oversize``), as under the other policies.
A pack may fill a cap exactly (``costmodel.CAP_TOLERANCE``, the one tolerance the epoch bound
and the plan's checks read too): B_ref reference samples fill M_comp = B_ref S_ref^p.

**How many packs.** At ``steps_per_epoch: free`` an epoch gets the fewest whole steps its
packs can fill: K = ⌈P / N⌉, with P the volume bound (max over limits of Σ use / cap, plus one
pack per oversize sample); at ``match`` or K, that many. The samples are spread over the K
steps' dealing windows stratified by cost (in cost order, by a low-discrepancy sequence over
the steps), so every window keeps the epoch's mix of lengths; a window whose share the greedy
below cannot place gets one more step. Where a step count was asked for and a window needed
one, the epoch is packed again as one window (no window's share then rounds up on its own);
if that too needs more, the plan has more steps than asked, and its summary (``steps``
beside ``steps_asked``) and warnings (``plan_warnings``) say so.

**Algorithm: LPT with capacities, step levelling, then sort-and-chunk.** Within a window of W
steps the W·N packs are formed by longest-processing-time-first: samples in decreasing
predicted cost (``CostModel.per_sample_time``, else the proxy S^p), each to the least-loaded
pack that still has room for it. Graham's bound for LPT: the most-loaded pack exceeds the mean
by less than the one sample that was placed on it last (plus the random offset below, a share
of the last block's work per pack), so with costliest samples first and the cheapest last the
gap to the mean is one of the window's cheapest samples; where a limit binds, the sample goes
to the least-loaded pack with room, which the bound does not cover (the summary's
``predicted_vs_lower_bound`` reports how close each plan comes). The packs are then dealt to
steps N at a time by predicted time (``dealing.deal_in_windows``: sort, chunk, shuffle steps
and ranks), so step k runs as long as its costliest pack L_k.

Levelling packs is not levelling steps where some packs cannot come down to the mean: a sample
costlier than the mean pack, or more of the costliest samples than packs, so some ranks must
hold two of them (the pigeonhole case). Those packs set the steps they are dealt to, and the
other packs of those steps could hold more work for free. ``_level_steps`` therefore takes the
levels L_k of LPT's packs as dealt, pins the h steps whose L_k exceeds the window's mean pack
(by LEVEL_MARGIN), and runs LPT again, without load offsets, with a target per pack (L_k for
the packs of pinned step k, the mean m_h of the work left for the other W - h steps for the
rest), comparing each pack's load less its target; the costliest samples then double up on the
pinned steps' ranks together, and the rest levels at m_h. It keeps whichever packs give the
smaller sum of step maxima (one levelling pass), so it never makes a window slower. Its
bound, per window: where every pack ends within one last-placed sample w_last of its target,
Σ_k L_k <= Σ_{k<h} L_k + (W - h)(m_h + w_last): the pinned steps at their costliest packs,
which no plan of those packs beats, and the rest of the work spread evenly over the other
steps, Graham's term per step. A cap that stops a pinned step's packs short of L_k (they are
full in compute or memory) leaves that work to the other steps, and the bound then does not
hold (docs/packing.md names those cases). Levelling is skipped where LPT's steps already sum
to within LEVEL_GAIN of the window's work over N, which no plan's steps beat (each step's
costliest pack is at least its mean): it could gain no more. Why not Karmarkar-Karp: its
differencing merges partial partitions with no regard to a per-pack capacity (verl's
``seqlen_balancing`` users hit OOM on packs over the token cap), and with ten or more samples
a pack its edge over LPT is below the cheapest sample anyway.

**Seeds that vary.** LPT is deterministic given the multiset of token counts; plans of two
seeds would differ only in which sample of a token count fills a slot. So each LPT pass
offsets each pack's load by a random share (up to OFFSET_SHARE) of the work still to place per
pack, large while the costly samples are placed and shrinking to a share of the last block's
(the levelling pass has none: it meets its targets), and takes the
token counts in a random order within bands of costs within COST_BAND of each other: which
counts share a pack, and which fill the room a cap leaves, varies with (seed, epoch). Where
that order leaves a sample without room, the pass is repeated in strict cost order before a
step is added. Everything comes from the one generator of (seed, epoch): every rank builds
the same packs without communication, on any machine (LPT takes equal values in pack order,
and the limits' powers and the cost bands come from the C library, not numpy's vector
kernels, which differ between CPUs); the summary's ``composition_digest`` says whether two
plans are made of the same packs.

LPT is vectorised per *block* of identical samples (one token count): LPT places a block's m
samples on the m smallest values of ``{load_b + k w : k < room_b}`` (pack b's load, the block's
cost w, the room it has for k more), which one histogram over levels of w finds for all packs
at once (``_place_block``); the samples of a block are in random order, so which sample lands
in which pack is random. One pass per distinct token count: 10M samples on 4,096 ranks plan in
seconds. Everything is deterministic from (seed, epoch): every rank builds the same packs.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload.costmodel import (
    CAP_TOLERANCE,
    Calibration,
    CostModel,
    EpochLimits,
    SequenceParallel,
)
from adaptiveload.errors import UserError
from adaptiveload.planning.budgets import Budgets
from adaptiveload.planning.dealing import deal_in_windows, narrow, rank_speeds, shuffled_by_code

# the device's memory, the limit a sample cannot break even alone at a sequence-parallel
# degree (`EpochLimits.hard`)
MEMORY_LIMIT = "memory_bytes"
# the costlier half of a window's samples is placed on loads offset by up to this share of
# a pack's mean load, drawn per (seed, epoch), so which costly samples share a pack varies
OFFSET_SHARE = 0.25
# LPT takes the types in random order within bands of costs within this factor of each other
# (a random phase per window): which types fill the room a cap leaves varies by seed
COST_BAND = 1.25
# a step counts as pinned above the others (`_level_steps`) when its costliest pack exceeds
# the mean pack of the rest by more than this share
LEVEL_MARGIN = 0.01
# step levelling runs where it may gain more than this share of a window: where LPT's steps
# sum to within it of the window's work over N (no plan's steps sum to less), it is skipped
LEVEL_GAIN = 1e-3
# samples over half a cap by more than this share cannot share a pack, and the sizes the
# bound on packs counts with are shrunk by it (`_least_packs_under`): rounding never beats it
HALF_MARGIN = 1e-9
# `_smallest` counts values in [0, 1) over this many bins before it partitions the one the
# n-th smallest lies in
SELECT_BINS = 1024


@dataclass(frozen=True)
class PackLimits(EpochLimits):
    """The limits one pack is held to (`EpochLimits`: limit d counts ``per_token[d] *
    S**power[d] + per_sample[d]`` for each of its samples and caps the sum at ``caps[d]``),
    by name. They are the limits every policy's epoch lower bound is taken under."""

    names: tuple[str, ...] = ()

    @classmethod
    def of(cls, budgets: Budgets, cost_model: CostModel | Calibration | None) -> PackLimits:
        """The limits of `budgets` (M_mem, M_comp, p, pack_tokens) and, where `cost_model` is a
        Calibration that knows its capacity, the device's usable memory in bytes."""
        rows = []
        usable = cost_model.usable_bytes if isinstance(cost_model, Calibration) else None
        token_caps = [budgets.pack_tokens]
        if usable is not None and cost_model.cost.m_tok > 0:
            cost = cost_model.cost
            if usable <= cost.m_static:
                raise UserError(
                    f"calibration of {cost_model.model} ({cost_model.label}): static memory "
                    f"{cost.m_static / 1e9:.2f} GB leaves no room under the usable "
                    f"{usable / 1e9:.2f} GB; raise the capacity or shard the model"
                )
            rows.append((MEMORY_LIMIT, cost.m_tok, 1.0, cost.m_seq, usable - cost.m_static))
            if budgets.m_mem != cost_model.m_mem:  # an explicit M_mem: keep it as a token cap
                token_caps.append(budgets.m_mem)
        else:
            token_caps.append(budgets.m_mem)
        rows.append(("compute", 1.0, float(budgets.p), 0.0, float(budgets.m_comp)))
        caps = [float(c) for c in token_caps if c is not None]
        if caps:
            rows.append(("tokens", 1.0, 1.0, 0.0, min(caps)))
        names, per_token, power, per_sample, cap = zip(*rows, strict=True)
        return cls(
            per_token=per_token, power=power, per_sample=per_sample, caps=cap, names=names,
            hard=tuple(name == MEMORY_LIMIT for name in names),
        )

    def as_dict(self) -> dict[str, float]:
        return dict(zip(self.names, self.caps, strict=True))


def epoch_limits(
    budgets: Budgets | Mapping[str, Any], cost_model: CostModel | Calibration | None
) -> PackLimits | None:
    """The limits every policy's epoch lower bound is taken under: the packed policy's
    (`PackLimits.of`), from `budgets` or a plan summary holding them; None where M_comp or p
    is unset (a plan of equal-token alone), since the compute limit then has no cap."""
    if not isinstance(budgets, Budgets):
        budgets = Budgets(**{k: budgets.get(k) for k in Budgets.__dataclass_fields__})
    if budgets.m_comp is None or budgets.p is None:
        return None
    return PackLimits.of(budgets, cost_model)


@dataclass(frozen=True)
class Packs:
    """An epoch's packs and their dealing. Pack k holds the sample positions
    ``order[start[k] : start[k] + size[k]]``; slot j (step ``j // N``, rank ``j % N``) runs
    pack ``slots[j]``, a padding repeat where ``slot_pad[j]``. ``fill[k, d]``: pack k's use of
    limit d over its cap."""

    order: np.ndarray
    start: np.ndarray
    size: np.ndarray
    slots: np.ndarray
    slot_pad: np.ndarray
    fill: np.ndarray
    limits: PackLimits
    oversize: np.ndarray  # per sample position: over a limit on its own (it runs alone)


@dataclass(frozen=True)
class _Types:
    """The epoch's distinct token counts, samples that run alone first, then costliest
    first: cost `w`, limit use `use` [types, limits], `alone` (over a limit's `caps` on its
    own, `EpochLimits.ceiling`: oversize, it runs alone), and each sample position's type
    `of` (`dealing.narrow`: int16 where the types fit, a quarter of the bytes per sample)."""

    w: np.ndarray
    use: np.ndarray
    alone: np.ndarray
    caps: np.ndarray
    of: np.ndarray
    tokens: np.ndarray  # each type's token count


@dataclass(frozen=True)
class _Fill:
    """What LPT put in each pack: its `size`, predicted cost `load` (Σ w), Σ S, Σ S² and its
    use of each limit `used` [limits, packs]."""

    size: np.ndarray
    load: np.ndarray
    sum_s: np.ndarray
    sum_sq: np.ndarray
    used: np.ndarray

    @classmethod
    def zeros(cls, n_packs: int, n_limits: int) -> _Fill:
        """`n_packs` empty packs."""
        return cls(np.zeros(n_packs, dtype=np.int64), np.zeros(n_packs),
                   np.zeros(n_packs, dtype=np.int64), np.zeros(n_packs),
                   np.zeros((n_limits, n_packs)))

    @classmethod
    def concat(cls, fills: list[_Fill]) -> _Fill:
        return cls(*(np.concatenate([getattr(f, k) for f in fills], axis=-1) for k in _FIELDS))

    def take(self, packs: np.ndarray) -> _Fill:
        return _Fill(self.size[packs], self.load[packs], self.sum_s[packs],
                     self.sum_sq[packs], self.used[:, packs])

    def move(self, samples: np.ndarray, types: _Types, source: np.ndarray,
             target: np.ndarray) -> None:
        """In place: one sample of each type `samples` from pack `source[i]` (distinct) to
        the empty pack `target[i]`."""
        for field, per_type in (("size", 1), ("load", types.w), ("sum_s", types.tokens),
                                ("sum_sq", types.tokens.astype(np.float64) ** 2)):
            values = getattr(self, field)
            add = per_type if np.isscalar(per_type) else per_type[samples]
            values[source] -= add
            values[target] = add
        self.used[:, source] -= types.use[samples].T
        self.used[:, target] = types.use[samples].T


@dataclass(frozen=True)
class _Window:
    """One window's LPT: its `members` (sample positions, by type), the pack of each and its
    place in the pack, what each pack holds, and the window's `steps`."""

    members: np.ndarray
    pack_of: np.ndarray
    place: np.ndarray
    fill: _Fill
    steps: int


def make_packs(
    tokens: np.ndarray, budgets: Budgets, cost_model: CostModel | Calibration | None,
    world_size: int, window_steps: int | None, rng: np.random.Generator,
    steps: int | None = None, degree: int = 1, sp: SequenceParallel | None = None,
) -> Packs:
    """Pack one epoch of samples (`tokens`: each sample's bucket tokens, by position) for
    `world_size` ranks in `steps` steps (None: K_min, the fewest the limits allow) and deal
    the packs to steps (module docstring). `degree` > 1: each of the `world_size` is a group
    of that many ranks, its pack held to the limits at `degree` and costing the set at
    `degree` through `sp` (``adaptiveload-sp-fixed``)."""
    limits = PackLimits.of(budgets, cost_model).at_degree(degree)
    cost = cost_model.cost if isinstance(cost_model, Calibration) else cost_model
    if degree > 1:
        cost = sp.cost_at(cost, degree)
    types = _types(tokens, limits, cost, float(budgets.p))
    order = shuffled_by_code(types.of, types.w.size, rng)  # by type, random inside
    count = np.bincount(types.of, minlength=types.w.size)
    k_min = max(1, -(-limits.min_micro_batches(types.tokens, count) // world_size))
    if steps is not None and steps < k_min:
        raise UserError(
            f"steps_per_epoch={steps}: the packs' limits need at least {k_min} steps for "
            f"these {tokens.size} samples on {_ranks(world_size, degree)}; give {k_min} or "
            "more, or free"
        )
    asked, steps = steps, k_min if steps is None else steps
    per_window = steps if window_steps is None else max(1, int(window_steps))
    windows = _pack_windows(order, types, steps, per_window, world_size, rng)
    if asked is not None and per_window < steps and sum(w.steps for w in windows) > steps:
        # a step count asked for is kept where one window over the epoch can: no window's
        # share then rounds up to a step of its own (else the plan says so: plan_warnings)
        windows = _pack_windows(order, types, steps, steps, world_size, rng)
    speeds = rank_speeds(cost_model, world_size) if degree == 1 else None
    return _assemble(tokens, windows, types, limits, cost, world_size, rng, speeds)


def _pack_windows(
    order: np.ndarray, types: _Types, steps: int, per_window: int, world_size: int,
    rng: np.random.Generator,
) -> list[_Window]:
    """The samples (`order`: positions by type) spread over the dealing windows of
    `per_window` of the `steps` steps and packed window by window (module docstring)."""
    spread = _spread_over_windows(order.size, steps, per_window, rng.random())
    offset = rng.random  # each window's LPT starts its packs at random loads (docstring)
    return [
        _pack_window(part, types, min(per_window, steps - w * per_window), world_size, offset)
        for w, part in enumerate(_window_members(order, spread))
    ]


def _ranks(world_size: int, degree: int) -> str:
    """How a message names the ranks packs go to: N ranks, or N groups of d ranks."""
    return f"{world_size} ranks" if degree == 1 else f"{world_size} groups of {degree} ranks"


def _types(tokens: np.ndarray, limits: PackLimits, cost: CostModel | None, p: float) -> _Types:
    """Distinct token counts of the epoch (hashing: O(n), few distinct), in LPT order."""
    code, values = pd.factorize(tokens, sort=True)
    return types_of(code, np.asarray(values, dtype=np.int64), limits, cost, p)


def types_of(
    code: np.ndarray, values: np.ndarray, limits: PackLimits, cost: CostModel | None, p: float
) -> _Types:
    """`_types` of samples already coded: sample i has token count ``values[code[i]]``
    (`values` sorted); the sequence-parallel planner codes once and orders per degree."""
    w = cost.per_sample_time(values) if cost is not None else values.astype(np.float64) ** p
    use = limits.use(values)
    caps = limits.ceiling
    alone = (use > caps).any(axis=1)
    rank = np.lexsort((-values, -w, ~alone))  # alone first, then costliest, then longest
    new_code = np.empty_like(rank)
    new_code[rank] = np.arange(rank.size)
    return _Types(w=w[rank], use=use[rank], alone=alone[rank], caps=caps,
                  of=narrow(new_code, rank.size)[code], tokens=values[rank])


def _spread_over_windows(n: int, steps: int, per_window: int, phase: float) -> np.ndarray:
    """The dealing window of each position of the type-ordered sample list: position i goes
    to step ``floor(frac(i phi + phase) K)`` (phi the golden ratio's fraction: a
    low-discrepancy sequence; `phase` in [0, 1) drawn per epoch), so any run of consecutive
    positions, such as one token count's samples, lands on the windows in proportion to
    their steps, within a few samples."""
    golden = (np.sqrt(5.0) - 1) / 2
    x = np.arange(n, dtype=np.float64) * golden + phase
    step = np.floor(np.modf(x)[0] * steps).astype(np.int64)
    return np.minimum(step, steps - 1) // per_window


def _window_members(order: np.ndarray, windows: np.ndarray) -> list[np.ndarray]:
    """`order` split by window, each part keeping its type order."""
    n_windows = int(windows.max()) + 1
    by_window = np.argsort(narrow(windows, n_windows), kind="stable")
    bounds = np.searchsorted(windows[by_window], np.arange(n_windows + 1))
    return [order[by_window[a:b]] for a, b in itertools.pairwise(bounds)]


def _pack_window(
    members: np.ndarray,
    types: _Types,
    steps: int,
    world_size: int,
    offset: Callable[[int], np.ndarray],
) -> _Window:
    """LPT of a window's members into steps * N packs, with one more step whenever a member
    finds no pack with room (one at a time: each extra step costs the epoch c0 and an
    all-reduce, and the epoch's K should stay within a few percent of K_min)."""
    count = np.bincount(types.of[members], minlength=types.w.size)
    if members.size == 0:  # a window the spread left empty: its packs are filled or padded
        empty = np.zeros(0, dtype=np.int64)
        return _Window(members, empty, empty, _Fill.zeros(steps * world_size,
                                                          types.use.shape[1]), steps)
    most = -(-members.size // world_size)  # as many packs as members: every one fits alone
    while True:
        placed = _lpt_offset(count, types, steps * world_size, offset)
        if placed is not None:
            leveled = _level_steps(placed[2].load, count, types, world_size, offset)
            return _Window(members, *(leveled or placed), steps=steps)
        steps = min(steps + 1, most)


def _level_steps(
    load: np.ndarray, count: np.ndarray, types: _Types, world_size: int,
    offset: Callable[[int], np.ndarray],
) -> tuple[np.ndarray, np.ndarray, _Fill] | None:
    """LPT again with a target load per pack, where LPT's packs (their `load`) leave steps
    pinned above the rest: the window's W steps each take the N packs next in cost order
    (the deal), so step k runs as long as its costliest pack, L_k. Where the costliest
    samples cannot be levelled (one alone costs more than the mean pack, or ranks must
    double them up: the pigeonhole case), the first h steps are pinned at L_0..L_{h-1} while
    L_h exceeds the mean m_h of the work left for the other W - h steps; LPT then fills every
    pack of a pinned step k up to L_k (work there is free: the step waits for L_k anyway) and
    levels the others at m_h, by comparing each pack's load less its target. The packs with
    the smaller sum of step maxima are kept; None: LPT's own (no step pinned, or no better)."""
    n_packs = load.size
    steps = n_packs // world_size
    by_cost = np.sort(load)[::-1]
    peak = by_cost[::world_size]  # L_k, each step's costliest pack
    total = float(load.sum())
    pinned = min(steps - 1, int((peak > total / n_packs * (1 + LEVEL_MARGIN)).sum()))
    if pinned == 0:
        return None
    offset(n_packs)  # the draw of LPT's offsets, none here: the levels are its targets
    order = _banded(count, types, offset)
    if float(peak.sum()) <= total / world_size * (1 + LEVEL_GAIN):
        return None  # after the draws: a window's choice never moves the next one's
    mean = (total - world_size * float(peak[:pinned].sum())) / (n_packs - pinned * world_size)
    target = np.concatenate([np.repeat(peak[:pinned], world_size),
                             np.full(n_packs - pinned * world_size, max(mean, 0.0))])
    candidates = [
        _lpt_or_strict(count, types, n_packs, np.zeros(n_packs), order, target),
        _fill_pinned(count, types, np.repeat(peak[:pinned], world_size), n_packs, order),
    ]
    best, best_sum = None, float(peak.sum())
    for placed in candidates:
        if placed is not None:
            leveled = float(np.sort(placed[2].load)[::-1][::world_size].sum())
            if leveled < best_sum:
                best, best_sum = placed, leveled
    return best


def _fill_pinned(
    count: np.ndarray, types: _Types, level: np.ndarray, n_packs: int, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray, _Fill] | None:
    """`_level_steps`' second way: the packs of the pinned steps (one per entry of `level`,
    its step's L_k) filled first, costliest samples first, each pack as far as its level
    and its limits let it (a sample that runs alone into an empty one whose level covers
    it); then the samples left by LPT into the other packs. Where a limit binds before the
    level (packs full in compute that a third reference clip fills to L_k but cheaper
    samples fill short of it), giving the pinned steps the costliest samples moves the most
    work off the other steps. Both parts take the types in `order` (the levelling pass's
    draws, so seeds vary the packs here too, and the plans it does not win are the ones the
    first way makes). None where the rest finds no room."""
    pinned = level.size
    empty = _Fill(np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int64), np.zeros(0),
                  np.zeros((types.caps.size, 0)))
    packs = _Open.start(pinned, 0, types.caps, 0.0, np.zeros(pinned), empty)
    first = np.cumsum(count) - count
    pack_of = np.empty(int(count.sum()), dtype=np.int64)
    place = np.empty_like(pack_of)
    taken = np.zeros_like(count)
    for t in order:
        w = types.w[t]
        if types.alone[t]:
            fits = ((packs.size == 0) & (level >= w)).astype(np.int64)
        else:
            used = types.use[t] > 0
            fits = np.floor(np.min(packs.room[used] / types.use[t][used, None], axis=0,
                                   initial=np.inf))
            # the level is met exactly where its own pack's samples refill it
            fits = np.minimum(fits, np.floor((level * (1 + CAP_TOLERANCE) - packs.load) / w))
            fits = np.clip(fits, 0, count[t]).astype(np.int64)
        m = int(min(count[t], fits.sum()))
        if m == 0:
            continue
        if types.alone[t]:
            into = np.flatnonzero(fits & (np.cumsum(fits) <= m))
            k = np.ones(into.size, dtype=np.int64)
        else:
            into, k = _place_block(packs.room, m, w, types.use[t], packs.load.__getitem__, fits)
        at = first[t] + np.arange(m)
        pack_of[at] = np.repeat(packs.index[into], k)
        place[at] = np.repeat(packs.size[into] - np.cumsum(k) + k, k) + np.arange(m)
        packs.add(into, k, types, t)
        if types.alone[t]:
            packs.room[:, into] = -1.0
        taken[t] = m
    rest = count - taken
    others = _lpt_or_strict(rest, types, n_packs - pinned, np.zeros(n_packs - pinned),
                            order[rest[order] > 0])
    if others is None:
        return None
    within = np.arange(pack_of.size) - np.repeat(first, count)  # a sample's rank in its type
    at = np.flatnonzero(within >= np.repeat(taken, count))  # those the pinned packs left
    pack_of[at], place[at] = pinned + others[0], others[1]
    return pack_of, place, _Fill.concat([packs.fill(pinned, types.caps.size), others[2]])


def pack_members(
    members: np.ndarray, types: _Types, n_packs: int, grow: int,
    offset: Callable[[int], np.ndarray],
) -> _Window:
    """LPT of `members` (sample positions in type order) into `n_packs` packs, `grow` more
    whenever a member finds no pack with room (at most one pack per member): the
    sequence-parallel planner's packs of one degree, whose count is set by its groups, not
    by whole steps of N."""
    count = np.bincount(types.of[members], minlength=types.w.size)
    n_packs = max(1, min(n_packs, members.size))
    while True:
        placed = _lpt_offset(count, types, n_packs, offset)
        if placed is not None:
            return _Window(members, *placed, steps=0)
        n_packs = min(n_packs + grow, members.size)


def _lpt_offset(
    count: np.ndarray, types: _Types, n_packs: int, offset: Callable[[int], np.ndarray],
    target: np.ndarray | float = 0.0, offset_share: float = OFFSET_SHARE,
) -> tuple[np.ndarray, np.ndarray, _Fill] | None:
    """`_lpt` with each pack's load offset by a random share (in [0, 1), drawn once per pack
    from `offset`) of OFFSET_SHARE of the work left to place per pack, and the types taken
    in a random order within cost bands (module docstring: seeds that vary); where that
    leaves a sample without room, in cost order (strict LPT), before more packs are asked."""
    share = offset_share * offset(n_packs)
    order = _banded(count, types, offset)
    if n_packs < _least_packs(count, types):  # after the draws: they never depend on it
        return None
    return _lpt_or_strict(count, types, n_packs, share, order, target)


def _banded(count: np.ndarray, types: _Types, offset: Callable[[int], np.ndarray]) -> np.ndarray:
    """The types present in `count`, those that run alone first, then by bands of costs
    within COST_BAND of each other (a random phase), in random order inside a band."""
    present = np.flatnonzero(count)
    w = types.w[present]
    # math.log: the same bands on every machine (numpy's vector log is not: `libm_power`)
    ratio = (w / w.max()).tolist()
    band = np.floor(np.array([math.log(r) / math.log(COST_BAND) for r in ratio]) + offset(1)[0])
    return present[np.lexsort((offset(present.size), -band, ~types.alone[present]))]


def _lpt_or_strict(
    count: np.ndarray, types: _Types, n_packs: int, share: np.ndarray, order: np.ndarray,
    target: np.ndarray | float = 0.0,
) -> tuple[np.ndarray, np.ndarray, _Fill] | None:
    """`_lpt` of the types in `order`, else (a sample left without room) in cost order."""
    placed = _lpt(count, types, n_packs, share, order, target)
    if placed is not None:
        return placed
    return _lpt(count, types, n_packs, share, np.flatnonzero(count), target)


def _least_packs(count: np.ndarray, types: _Types) -> int:
    """The fewest packs `count[t]` samples of each type need at least, beyond the volume:
    one each for the samples that run alone, and the most any one limit needs on its own
    (`_least_packs_under`). LPT into fewer packs fails, so it is not tried: long clips at a
    sequence-parallel degree need more packs than their volume (a window of them fails LPT
    at one step short, before a step more succeeds)."""
    under = (_least_packs_under(count, types, d) for d in range(types.caps.size))
    return int(count[types.alone].sum()) + max(under, default=0)


def _least_packs_under(count: np.ndarray, types: _Types, d: int) -> int:
    """The fewest packs the samples that do not run alone need under limit `d` alone, each
    sample of size s (its use over the cap): one each for the large ones (s > 1/2: no two
    share a pack), and enough for the small ones: for each small size a, a pack holds at
    most ⌊1/a⌋ samples of size >= a, and a large sample's pack ⌊(1 - s)/a⌋ of them beside
    it, so the small samples of size >= a need packs beyond the large ones' where they
    outnumber those places. Sizes are shrunk and the places rounded up by HALF_MARGIN, so
    the rounding of LPT's room never fits a sample where this bound says none fits."""
    size = types.use[:, d] / types.caps[d] * (1 - HALF_MARGIN)
    present = (count > 0) & ~types.alone & (size > 0)
    large = present & (types.use[:, d] > types.caps[d] * (0.5 * (1 + HALF_MARGIN)))
    small = present & ~large
    n_large = int(count[large].sum())
    if not small.any():
        return n_large
    a = np.unique(size[small])  # each small size a threshold
    beside = np.floor((1 - size[large, None]) / a + HALF_MARGIN)  # [large types, a]
    places = (count[large, None] * beside).sum(axis=0).astype(np.int64)
    at_least = (count[small, None] * (size[small, None] >= a)).sum(axis=0)
    per_pack = np.floor(1 / a + HALF_MARGIN).astype(np.int64)
    more = -(-np.maximum(at_least - places, 0) // per_pack)
    return n_large + int(more.max())


def _lpt(
    count: np.ndarray, types: _Types, n_packs: int, share: np.ndarray, order: np.ndarray,
    target: np.ndarray | float = 0.0,
) -> tuple[np.ndarray, np.ndarray, _Fill] | None:
    """`count[t]` samples of each type into `n_packs` packs by LPT, a block of one type after
    another in `order` (the types that run alone first): each sample's pack and place in it
    (samples listed in type order), and what each pack holds; None if a sample finds no room.
    LPT compares each pack's load less its `target` plus `share` of the work left per pack
    (this block's included), an offset that shrinks to a share of the last block's (module
    docstring: seeds that vary).

    Each block looks only at the packs still open (`_Open`): a pack closed by a sample that
    runs alone, or left without room for the least use of every type still to come, is
    dropped from the arrays the blocks scan. Long clips close most packs early (one or two
    samples fill them), so later blocks scan a fraction of the packs; the packs a block would
    find no room in are exactly those, so the plan is the one a scan of all packs makes."""
    pack_of = np.empty(int(count.sum()), dtype=np.int64)
    place = np.zeros_like(pack_of)
    first = np.cumsum(count) - count  # where each type's samples start in type order
    left = float((count * types.w).sum())
    # the types that run alone (first in `order`) take one empty pack each, in pack order:
    # packs 0, 1, ... (every pack is empty before them), each then closed
    lead = order[: int(types.alone[order].sum())]
    if count[lead].sum() > n_packs:
        return None
    alone_pack = 0
    for t in lead:
        left -= count[t] * types.w[t]
        m = int(count[t])
        pack_of[first[t] : first[t] + m] = np.arange(alone_pack, alone_pack + m)
        alone_pack += m
    lone = np.repeat(lead, count[lead])  # the type of each pack a sample runs alone in
    closed = _Fill(np.ones(lone.size, dtype=np.int64), types.w[lone], types.tokens[lone],
                   types.tokens[lone].astype(np.float64) ** 2, types.use[lone].T.copy())
    packs = _Open.start(n_packs, alone_pack, types.caps, target, share, closed)
    # the least use of each limit over the types after each block
    rest = order[lead.size :]
    least = np.minimum.accumulate(types.use[rest][::-1], axis=0)[::-1]
    least = np.vstack([least[1:], np.full((1, least.shape[1]), np.inf)])
    for i, t in enumerate(rest):
        load = functools.partial(packs.lpt_load, spread=left / n_packs)
        left -= count[t] * types.w[t]
        m = int(count[t])
        placed = _place_block(packs.room, m, types.w[t], types.use[t], load)
        if placed is None:
            return None
        at, took = placed  # the open packs that take some of the block, how many each
        done = first[t]
        pack_of[done : done + m] = np.repeat(packs.index[at], took)
        # a sample's place: its pack's size before the block, plus its rank among the block's
        place[done : done + m] = np.repeat(packs.size[at] - np.cumsum(took) + took, took) + (
            np.arange(m)
        )
        packs.add(at, took, types, t)
        packs = packs.without_full(least[i])
    return pack_of, place, packs.fill(n_packs, types.use.shape[1])


@dataclass
class _Open:
    """`_lpt`'s packs still open: their `index` among all packs, what each holds (as
    `_Fill`'s fields), its `room` under each limit, LPT's `target` and `share` for it; the
    packs closed so far in `closed` (their index, what they hold) until `fill` puts all
    together."""

    index: np.ndarray
    size: np.ndarray
    load: np.ndarray
    sum_s: np.ndarray
    sum_sq: np.ndarray
    used: np.ndarray
    room: np.ndarray
    target: np.ndarray | float
    share: np.ndarray
    closed: list[tuple[np.ndarray, _Fill]]

    @classmethod
    def start(cls, n_packs: int, first: int, caps: np.ndarray, target: np.ndarray | float,
              share: np.ndarray, closed: _Fill) -> _Open:
        """Packs `first` .. `n_packs` - 1 open and empty; those before it `closed`."""
        empty = _Fill.zeros(n_packs - first, caps.size)
        return cls(np.arange(first, n_packs), empty.size, empty.load, empty.sum_s,
                   empty.sum_sq, empty.used, np.repeat(caps[:, None], n_packs - first, axis=1),
                   target if np.isscalar(target) else target[first:], share[first:],
                   [(np.arange(first), closed)])

    def lpt_load(self, at: np.ndarray | slice, spread: float) -> np.ndarray:
        """What LPT compares of open packs `at`: the load less the target, plus the share of
        `spread` (the work left per pack)."""
        target = self.target if np.isscalar(self.target) else self.target[at]
        return self.load[at] - target + self.share[at] * spread

    def add(self, at: np.ndarray, k: np.ndarray, types: _Types, t: int) -> None:
        """In place: k[i] samples of type `t` into open pack at[i] (distinct). Only the packs
        that take some are touched: a block of m samples lands in at most m of them, row by
        row (indexing columns of a 2-D array, ``x[:, at]``, costs several times more)."""
        self.size[at] += k
        self.load[at] += k * types.w[t]
        self.sum_s[at] += k * types.tokens[t]
        self.sum_sq[at] += k * float(types.tokens[t]) ** 2
        for used, room, use in zip(self.used, self.room, types.use[t], strict=True):
            added = use * k
            used[at] += added  # a row's view indexed: a third of ``x[d, at]``'s time
            room[at] -= added

    def without_full(self, least: np.ndarray) -> _Open:
        """These packs less those without room for `least` (each limit's least use by any
        type still to place): no later block puts a sample in them. Room r < l leaves none
        for a use u >= l: r / u <= r / l < 1 (division rounds monotonically, and a quotient
        of r < l never rounds up to 1)."""
        full = np.zeros(self.index.size, dtype=bool)
        for d in np.flatnonzero(np.isfinite(least) & (least > 0)):
            full |= self.room[d] < least[d]
        if full.sum() * 8 < full.size:  # a few: not worth the copies yet
            return self
        keep = ~full
        self.closed.append((self.index[full], self._fill(full)))
        target = self.target if np.isscalar(self.target) else self.target[keep]
        return _Open(self.index[keep], *(getattr(self._fill(keep), f) for f in _FIELDS),
                     self.room[:, keep], target, self.share[keep], self.closed)

    def _fill(self, at: np.ndarray) -> _Fill:
        return _Fill(self.size[at], self.load[at], self.sum_s[at], self.sum_sq[at],
                     self.used[:, at])

    def fill(self, n_packs: int, n_limits: int) -> _Fill:
        """What every pack holds, open or closed, by pack index."""
        out = _Fill.zeros(n_packs, n_limits)
        for index, part in [*self.closed, (self.index, self._fill(slice(None)))]:
            for f in _FIELDS:  # by row: a 2-D array's columns cost several times more
                rows = zip(np.atleast_2d(getattr(out, f)), np.atleast_2d(getattr(part, f)),
                           strict=True)
                for row, part_row in rows:
                    row[index] = part_row
        return out


_FIELDS = ("size", "load", "sum_s", "sum_sq", "used")


def _place_block(
    room: np.ndarray, m: int, w: float, use: np.ndarray,
    load: Callable[[np.ndarray | slice], np.ndarray], most: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """How many of m identical samples (cost `w`, limit use `use`) LPT puts in each pack:
    the m smallest of ``{load_b + k w : k < fits_b}`` (equal ones in pack order;
    `most` caps fits_b). `load(packs)` gives the loads of the packs with room, the only ones
    LPT compares (no load is computed for a pack that cannot take a sample). With
    ``load_b = w (level_b + frac_b)`` those values sit on integer levels ``level_b + k``
    ordered by ``frac_b`` inside one level, so a count over levels finds the level of
    the m-th value (`_mth_level`); of the packs whose values reach that level, those with the
    smallest fractions take one more (`_smallest`: equal ones by pack order, the same on
    every machine). Returned sparse: the packs that take some and how many each takes (a
    block lands in at most m of them); None if the packs have room for fewer than m.

    This runs once per block over every open pack (the planner's inner loop): the packs with
    room are a slice where all have room (no copies), and once the m-th value's level is
    known only the packs that reach it are looked at again."""
    used = np.flatnonzero(use > 0)  # a limit the samples do not use never stops them
    if used.size == 0:
        ratio = np.full(room.shape[1], np.inf)
    else:
        ratio = room[used[0]] / use[used[0]]
        for d in used[1:]:
            np.minimum(ratio, room[d] / use[d], out=ratio)
    if most is not None:
        np.minimum(ratio, most, out=ratio)
    open_: np.ndarray | slice = np.flatnonzero(ratio >= 1)  # the packs with room for one
    if open_.size == ratio.size:
        open_ = slice(None)
    fits = np.minimum(ratio[open_], m).astype(np.int64)  # ratio >= 1: truncation is floor
    if fits.size < m and fits.sum() < m:  # (one each where the packs outnumber the samples)
        return None
    x = load(open_) / w
    level = np.floor(x)
    lo = (level - level.min()).astype(np.int64)
    at, below = _mth_level(lo, fits, m)
    reach = np.flatnonzero(lo <= at)  # the packs with a value at or below the m-th's level
    step = at - lo[reach]  # the m-th value's level over each pack's first
    fits = fits[reach]
    k = np.minimum(step, fits)  # every value below that level
    tied = np.flatnonzero(step < fits)  # and one at it
    need = m - below
    if need < tied.size:
        tied = tied[_smallest(x[reach[tied]] - level[reach[tied]], need)]
    k[tied] += 1
    took = reach[k > 0]
    return (took if isinstance(open_, slice) else open_[took]), k[k > 0]


def _smallest(values: np.ndarray, n: int) -> np.ndarray:
    """The positions of the `n` smallest of `values` (in [0, 1), 0 < n < values.size), equal
    values taken from the first position on: the choice is the same on every machine.
    (``np.argpartition`` picks among equal values by its SIMD kernel, which differs between
    CPUs with and without AVX-512: two ranks would build different plans.) The n-th smallest
    value is found by a count over SELECT_BINS bins and a partition of the one bin it lies
    in; every value below it is taken, then the first of those equal to it."""
    want = n
    inside = values
    if values.size > SELECT_BINS:
        bins = (values * SELECT_BINS).astype(np.int64)
        through = np.cumsum(np.bincount(bins, minlength=SELECT_BINS))
        last = int(np.searchsorted(through, n))  # the bin of the n-th smallest
        inside = values[bins == last]
        want = n - (int(through[last - 1]) if last else 0)
    nth = np.partition(inside, want - 1)[want - 1]
    below = np.flatnonzero(values < nth)
    return np.concatenate([below, np.flatnonzero(values == nth)[: n - below.size]])


def _mth_level(lo: np.ndarray, fits: np.ndarray, m: int) -> tuple[int, int]:
    """The level of the m-th smallest value when pack b holds one value at each level
    ``lo_b .. lo_b + fits_b - 1``, and how many values lie below it. A histogram over the
    levels where they are few (the usual case: loads within a few samples' cost of each
    other); where loads span many levels of a cheap sample (one pack's level can be 10^10),
    a bisection over the count of values at or below a level, ``Σ clip(L - lo_b + 1, 0,
    fits_b)``, which gives the same level in O(packs) memory."""
    hi = lo + fits
    top = int(hi.max())
    if top <= 8 * lo.size + 2 * m + 1024:
        per_level = np.cumsum(
            np.bincount(lo, minlength=top + 1) - np.bincount(hi, minlength=top + 1)
        )
        through = np.cumsum(per_level)  # values at levels <= j
        at = int(np.searchsorted(through, m))
        return at, int(through[at - 1]) if at else 0

    def through_level(level: int) -> int:
        return int(np.clip(level - lo + 1, 0, fits).sum())

    low, high = 0, top  # through_level(top) counts every value: at least m
    while low < high:
        mid = (low + high) // 2
        if through_level(mid) >= m:
            high = mid
        else:
            low = mid + 1
    return low, through_level(low - 1) if low else 0


def _assemble(
    tokens: np.ndarray, windows: list[_Window], types: _Types, limits: PackLimits,
    cost: CostModel | None, world_size: int, rng: np.random.Generator,
    speeds: np.ndarray | None = None,
) -> Packs:
    """The windows' packs as one epoch (numbered window by window), every pack given a sample
    where the epoch has enough, the rest padded, all dealt to steps by predicted cost. It
    consumes `windows` (the list is emptied once joined) and drops each array once used:
    at 10M samples each copy of the epoch's packs holds hundreds of MB."""
    offset = np.cumsum([0] + [w.fill.size.size for w in windows[:-1]])
    pack_of = np.concatenate([off + w.pack_of for w, off in zip(windows, offset, strict=True)])
    place = np.concatenate([w.place for w in windows])
    members = np.concatenate([w.members for w in windows])
    fill = _Fill.concat([w.fill for w in windows])
    step_window = np.repeat(np.arange(len(windows)), [w.steps for w in windows])
    windows.clear()
    _fill_empty(pack_of, place, fill, types.of[members], types)
    start = np.concatenate(([0], np.cumsum(fill.size)[:-1])).astype(np.int64)
    order = np.empty(tokens.size, dtype=np.int64)
    order[start[pack_of] + place] = members
    del pack_of, place, members
    real = fill.size > 0
    packs = fill.take(np.flatnonzero(real))
    del fill
    pack_cost = (
        cost.pack_time(packs.size, packs.sum_s, packs.sum_sq) if cost is not None else packs.load
    )
    # a slot per pack of every window; one left empty repeats a random pack (padding)
    slot_pack = np.cumsum(real) - 1
    n_pad = int((~real).sum())
    slot_pack[~real] = rng.choice(packs.size.size, n_pad, replace=n_pad > packs.size.size)
    deal = deal_in_windows(pack_cost[slot_pack], world_size, step_window, rng, speeds)
    return Packs(
        order=order, start=start[real], size=packs.size, slots=slot_pack[deal],
        slot_pad=~real[deal], fill=(packs.used / np.asarray(limits.caps)[:, None]).T,
        limits=limits, oversize=types.alone[types.of],
    )


def _fill_empty(
    pack_of: np.ndarray, place: np.ndarray, fill: _Fill, type_of: np.ndarray, types: _Types
) -> None:
    """In place: while a pack is empty and another holds two or more samples, move the
    cheapest sample (placed last) of the costliest such pack into it. A window gets an empty
    pack only when its share of the samples is short of its packs (an extra step, or a share
    a sample below its steps), and an empty pack would be padding: repeated work, where one
    moved sample is real work."""
    size = fill.size
    while True:
        empty, multi = np.flatnonzero(size == 0), np.flatnonzero(size > 1)
        k = min(empty.size, multi.size)
        if k == 0:
            return
        donor = np.zeros(size.size, dtype=bool)
        donor[multi[np.argsort(-fill.load[multi], kind="stable")[:k]]] = True
        last = np.flatnonzero(place == size[pack_of] - 1)  # each pack's last-placed sample
        moved = last[donor[pack_of[last]]]
        fill.move(type_of[moved], types, pack_of[moved], empty[:k])
        pack_of[moved], place[moved] = empty[:k], 0
