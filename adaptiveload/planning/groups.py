"""Sequence-parallel groups (policies ``adaptiveload-sp`` and ``adaptiveload-sp-fixed``): which
samples run on several ranks at once, at which degree, and which ranks of which step run them.

A *group* of degree d is d ranks of one step, an aligned block ``[k d, (k+1) d)`` (d a power of
two that divides the model's head count and N: `SequenceParallel.max_degree`), that runs one
pack together (Ulysses: every segment's tokens cut into d chunks, rank r of the group holding
chunk r of each). The pack costs each of its ranks the cost of a set at degree d
(`SequenceParallel.cost_at`) and is held, per rank, to the packed policy's limits at degree d
(`EpochLimits.at_degree`: memory m_tok ΣS/d + m_seq n under the device's usable bytes,
ΣS^p/d <= M_comp, ΣS/d <= pack_tokens). A step's groups and single ranks fill its N ranks.

**Degrees** (``adaptiveload-sp``, per token count, `choose_degrees`): `d_min` is the least
degree at which one sample's per-rank memory fits the device's usable bytes (its hard limit).
It is doubled, round by round, while the sample sets the epoch and a larger degree is faster:
the samples costing w or more need at least ceil(their rank units / N) steps of at least w
each, and where that exceeds the epoch's work spread over the N ranks, nothing else can hide
them (the pigeonhole term of the epoch bound, docs/definitions.md); elsewhere more ranks would
only add all-to-alls and fixed costs. Samples of degree 1 are the *small* ones. A sample that
fits no allowed degree within the device's whole capacity is excluded as over capacity
(`plan.over_capacity` at the policy's largest degree), as one over a single device is under
the other policies. Where every sample is of degree 1, the plan is the packed policy's.

**Plan** (vectorised but for a loop over steps; deterministic from (seed, epoch)):

1. The samples of each degree d > 1 form packs of degree d by LPT under the limits at d
   (`packing.pack_members`, into as many packs as their volume at d needs, more where one
   finds no room); K, the steps, is the fewest whole steps their rank units and the small
   samples' volume fill (or the step count asked for).
2. *Top-up*: a group whose predicted time falls short of the epoch's mean rank time T (its
   rank-seconds over K N) would leave its ranks idle, so a stratified share of the small
   samples (every token count the same share, by a low-discrepancy sequence) joins the groups
   of each degree, as much as fills their time to T within 80% of their free room
   (`TOP_UP_ROOM`), and those groups are packed again with them.
3. The groups are spread over the dealing windows stratified by time (a low-discrepancy
   sequence over them from the slowest); a window's single ranks are its steps' ranks less
   its groups' (a window gets more steps where its groups need them).
4. Per window, the small samples left (spread over the windows in proportion to their single
   ranks) pack into exactly those single ranks (LPT; where they do not fit, the window gets
   another step of N single ranks; an empty pack takes a sample from a pack of several,
   else it repeats one: padding). Groups and single packs are then dealt by sort-and-chunk
   over rank units (`_chunks`: slowest first, each step filled to N ranks, a group that would
   cross a step's end leading the next), so slow groups share steps with slow packs; steps
   are shuffled within the window and so are the single ranks within a step, while the
   groups sit from rank 0 in decreasing degree, each on an aligned block.

``adaptiveload-sp-fixed`` is the baseline of trainers that run sequence parallelism at one
degree throughout (Wan's and DiffSynth's SP 4 or 8): every micro-batch at the degree D =
`FIXED_DEGREE` (capped to the largest allowed: 4 for Wan 2.1 1.3B's 12 heads), i.e. the packed
policy on N / D groups, each one rank of D times the room at the cost of a set at D.

A plan that holds a group of degree > 1 has the column ``sp_degree`` (`step_table.SP_DEGREE`):
one row per sample of each micro-batch, as always, with ``rank`` the group's first rank; the
group is ranks ``rank .. rank + sp_degree - 1`` of its step, every one of which trains that
pack (the sampler yields it to each, with its rank in the group). Plans without one have no
such column: every micro-batch is one rank's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from adaptiveload.costmodel import Calibration, CostModel, SequenceParallel, within_cap
from adaptiveload.errors import UserError
from adaptiveload.planning.batches import Batches, EpochInputs, MicroBatches, starts
from adaptiveload.planning.dealing import narrow
from adaptiveload.planning.packing import (
    PackLimits,
    _Fill,
    _fill_empty,
    _Types,
    _Window,
    pack_members,
    types_of,
)

# the degree of every micro-batch under adaptiveload-sp-fixed (capped to the largest the
# model's heads and the world size allow)
FIXED_DEGREE = 8
# the share of a long group's free memory the top-up may fill (the rest keeps LPT from
# running out of room: a sample that finds none costs the epoch a whole group)
TOP_UP_ROOM = 0.8
GOLDEN = (np.sqrt(5.0) - 1) / 2


@dataclass(frozen=True)
class _Degree:
    """One degree's limits, cost and types (`packing.types_of`, in its LPT order)."""

    degree: int
    limits: PackLimits
    cost: CostModel
    types: _Types

    def value_index(self, values: np.ndarray) -> np.ndarray:
        """Each type (in LPT order) as an index into the sorted token counts `values`."""
        return np.searchsorted(values, self.types.tokens)


@dataclass(frozen=True)
class _Packed:
    """Packs of one degree (a degree's groups, or a dealing window's single ranks), of what
    LPT made only what the deal and the summary read: each pack's size and predicted time
    (0 for an empty one), the use of each limit by the packs that hold samples, and how many
    of several samples break a limit (none, by construction). Their samples' places go to
    the epoch's order when they are made (`_Order`): at 10M samples the windows' own arrays
    would hold a gigabyte until the deal."""

    degree: int
    size: np.ndarray
    time: np.ndarray
    used: np.ndarray
    violations: int


class _Order:
    """The epoch's samples in pack order, packs numbered as they are added (the groups by
    degree, then each dealing window's single ranks): pack k holds ``order[start[k] :
    start[k] + size[k]]`` of the sizes of all added packs in turn."""

    def __init__(self, samples: int) -> None:
        self.order = np.empty(samples, dtype=np.int64)
        self.placed = 0

    def add(self, window: _Window, t: _Degree) -> _Packed:
        """`window`'s samples into the order after the packs added before; its packs at
        degree `t` as `_Packed`."""
        fill = window.fill
        self.order[self.placed + starts(fill.size)[window.pack_of] + window.place] = (
            window.members
        )
        self.placed += int(fill.size.sum())
        over = ~within_cap(fill.used, np.asarray(t.limits.caps)[:, None]).all(axis=0)
        return _Packed(t.degree, fill.size, t.cost.pack_time(fill.size, fill.sum_s, fill.sum_sq),
                       fill.used[:, fill.size > 0], int((over & (fill.size > 1)).sum()))


def _degrees(
    epoch: EpochInputs, sp: SequenceParallel, max_degree: int, code: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, dict[int, _Degree]]:
    """The epoch's distinct token counts (sorted, from its few buckets), how many samples
    have each, and each allowed degree's terms: over those counts alone, or, given every
    sample's index into them (`code`), over the samples (what packing needs)."""
    cal = epoch.cost_model
    assert isinstance(cal, Calibration)
    values, count = epoch.buckets.token_counts()
    base = PackLimits.of(epoch.budgets, cal)
    p = float(epoch.budgets.p)
    coded = np.zeros(0, dtype=np.int64) if code is None else code
    per = {}
    for d in sp.bound(max_degree).degrees:
        limits, cost = base.at_degree(d), sp.cost_at(cal.cost, d)
        per[d] = _Degree(d, limits, cost, types_of(coded, values, limits, cost, p))
    return values, count, per


def choose_degrees(
    values: np.ndarray, count: np.ndarray, per: dict[int, _Degree], world_size: int
) -> np.ndarray:
    """The degree of each token count of `values` (`count` samples each; module docstring):
    d_min, raised where the pigeonhole term binds (`_raise`)."""
    degrees = sorted(per)
    d_min = np.zeros(values.size, dtype=np.int64)
    for d in degrees:
        t = per[d]
        hard = np.asarray(t.limits.hard or (False,) * len(t.limits.caps), dtype=bool)
        fits = np.zeros(values.size, dtype=bool)
        fits[t.value_index(values)] = ~((t.types.use > t.types.caps) & hard).any(1)
        d_min[(d_min == 0) & fits] = d
    d_min[d_min == 0] = degrees[-1]  # over the memory at every degree: alone, with most room
    return _raise(values, count, d_min, per, world_size)


def _raise(
    values: np.ndarray, count: np.ndarray, degree: np.ndarray, per: dict[int, _Degree],
    world_size: int,
) -> np.ndarray:
    """`degree` doubled, round by round, for the token counts whose pigeonhole term binds:
    the samples costing w or more need at least ceil(their rank units / N) steps, each at
    least w long; where that exceeds the epoch's work spread over the N ranks, those samples
    set the epoch, and a larger degree (where it is faster) shortens their steps."""
    degree = degree.copy()
    top = max(per)
    times = {d: t.cost.per_sample_time(values) for d, t in per.items()}
    while True:
        w = np.choose(np.searchsorted(sorted(per), degree), [times[d] for d in sorted(per)])
        units = count * degree
        spread = float((units * w).sum()) / world_size
        order = np.argsort(-w, kind="stable")
        steps = -(-np.cumsum(units[order]) // world_size)
        binds = order[w[order] * steps > spread * (1 + 1e-9)]
        doubled = np.minimum(2 * degree, top)
        faster = np.choose(np.searchsorted(sorted(per), doubled),
                           [times[d] for d in sorted(per)]) < w
        up = binds[(degree[binds] < top) & faster[binds]]
        if up.size == 0:
            return degree
        degree[up] *= 2


def make_groups(
    epoch: EpochInputs, sp: SequenceParallel, max_degree: int
) -> MicroBatches | None:
    """The epoch's groups and single ranks, dealt (module docstring); None where every sample
    is of degree 1: the packed policy's plan is then the plan."""
    values, count, per = _degrees(epoch, sp, max_degree)
    degree = choose_degrees(values, count, per, epoch.world_size)
    if (degree == 1).all():
        return None
    code = np.searchsorted(values, epoch.buckets.tokens)[epoch.buckets.of]
    _, _, per = _degrees(epoch, sp, max_degree, code)
    rng, n = epoch.rng, epoch.world_size
    perm = rng.permutation(code.size)
    own = degree[code]
    long = [d for d in sorted(per, reverse=True) if (degree == d).any() and d > 1]
    own_packs = {d: _pack_degree(d, perm, own, per[d], None, rng) for d in long}
    made = {d: w.fill.size.size for d, w in own_packs.items()}
    small_volume = per[1].limits.min_micro_batches(values[degree == 1], count[degree == 1])
    steps = _step_count(epoch, sum(d * k for d, k in made.items()) + small_volume)
    joins = _top_up(values, count, degree, per, made, steps * n)
    group_of = _assign(perm, code, degree, joins, per, rng.random())
    order = _Order(code.size)
    packs = []
    for d in long:
        if joins.get(d):  # packed again with the small samples that join them
            del own_packs[d]  # (the first packs go before)
            packs.append(order.add(_pack_degree(d, perm, group_of, per[d], made[d], rng), per[d]))
        else:
            packs.append(order.add(own_packs.pop(d), per[d]))
    small = perm[group_of[perm] == 1]
    small = small[np.argsort(narrow(per[1].types.of[small], per[1].types.w.size), kind="stable")]
    layout = _Layout(n, epoch.window_steps or steps, packs, steps, rng)
    windows = layout.pack_small(small, per[1], order, rng)
    slots, slot_pad, slot_degree, start, size = layout.deal(windows, rng)
    return MicroBatches(
        batches=Batches(order=order.order, start=start, size=size),
        slots=slots, slot_pad=slot_pad, slot_degree=slot_degree,
        oversize=_oversize(code, own, per),
        violations=sum(p.violations for p in packs + windows),
        dealt_on="cost_model",
        summary=_summary(per[1].limits, max_degree, packs, windows, group_of, own),
    )


def _step_count(epoch: EpochInputs, units: int) -> int:
    """K: the fewest whole steps of N ranks that `units` rank units fill (the groups' ranks
    and the small samples' volume), or the count asked for (UserError below that)."""
    k_min = max(1, -(-units // epoch.world_size))
    if epoch.steps is None:
        return k_min
    if epoch.steps < k_min:
        raise UserError(
            f"steps_per_epoch={epoch.steps}: the groups' limits need at least {k_min} steps for "
            f"these {epoch.tokens.size} samples on {epoch.world_size} ranks; give {k_min} or "
            "more, or free"
        )
    return int(epoch.steps)


def _top_up(
    values: np.ndarray, count: np.ndarray, degree: np.ndarray, per: dict[int, _Degree],
    made: dict[int, int], rank_slots: int,
) -> dict[int, float]:
    """The share of the small samples each degree's groups take in (module docstring, 2):
    enough to fill their predicted time to the epoch's mean rank time T, within TOP_UP_ROOM
    of their free room under every limit; the shares sum to at most 1. `made`: how many
    groups of each degree their own samples form."""
    small = degree == 1
    if not small.any():
        return {}
    long_units = sum(d * k for d, k in made.items())
    rank_s = (rank_slots - long_units) * per[1].cost.c0
    rank_s += float((per[1].cost.per_sample_time(values) * count)[small].sum())
    own_s = {}
    for d, k in made.items():
        own_s[d] = k * per[d].cost.c0 + float(
            (per[d].cost.per_sample_time(values) * count)[degree == d].sum())
        rank_s += d * own_s[d]
    mean_t = rank_s / rank_slots
    shares = {}
    for d, k in made.items():
        t = per[d]
        small_s = float((t.cost.per_sample_time(values) * count)[small].sum())
        use = t.limits.use(values) * count[:, None]
        room = k * t.types.caps - use[degree == d].sum(axis=0)
        small_use = use[small].sum(axis=0)
        by_room = np.where(small_use > 0, TOP_UP_ROOM * np.maximum(room, 0) / small_use, np.inf)
        by_time = (k * mean_t - own_s[d]) / small_s if small_s > 0 else 0.0
        shares[d] = max(0.0, min(by_time, float(by_room.min())))
    total = sum(shares.values())
    return {d: q / max(1.0, total) for d, q in shares.items()}


def _assign(
    perm: np.ndarray, code: np.ndarray, degree: np.ndarray, joins: dict[int, float],
    per: dict[int, _Degree], phase: float,
) -> np.ndarray:
    """Each sample's group degree: its own, or, for a small sample, the degree whose groups
    it tops up: the small samples in type order (random inside, by `perm`) take the share of
    each degree by a low-discrepancy sequence, so every token count gives the same share."""
    group_of = degree[code].copy()
    small = perm[group_of[perm] == 1]
    small = small[np.argsort(narrow(per[1].types.of[small], per[1].types.w.size), kind="stable")]
    u = np.modf(np.arange(small.size) * GOLDEN + phase)[0]
    low = 0.0
    for d, q in joins.items():
        group_of[small[(u >= low) & (u < low + q)]] = d
        low += q
    return group_of


def _pack_degree(
    d: int, perm: np.ndarray, group_of: np.ndarray, t: _Degree, packs: int | None,
    rng: np.random.Generator,
) -> _Window:
    """The packs of degree `d` (its own samples and the small ones topping them up) by LPT
    into `packs` packs (None: the volume of the members at degree d), more where some sample
    finds no room, empty ones dropped."""
    members = perm[group_of[perm] == d]
    members = members[np.argsort(narrow(t.types.of[members], t.types.w.size), kind="stable")]
    if packs is None:
        values, count = np.unique(t.types.tokens[t.types.of[members]], return_counts=True)
        packs = t.limits.min_micro_batches(values, count)
    return _nonempty(pack_members(members, t.types, packs, max(1, packs // 50), rng.random))


def _nonempty(window: _Window) -> _Window:
    """`window` without its empty packs (renumbered)."""
    keep = window.fill.size > 0
    if keep.all():
        return window
    renumber = np.cumsum(keep) - 1
    return _Window(window.members, renumber[window.pack_of], window.place,
                   window.fill.take(np.flatnonzero(keep)), window.steps)


class _Layout:
    """The groups (`packs`, of degree > 1), spread over the dealing windows of `per_window`
    steps of the epoch's K (`steps`), stratified by time (a low-discrepancy sequence over
    the groups from the slowest), and each window's single ranks."""

    def __init__(
        self, world_size: int, per_window: int, packs: list[_Packed], steps: int,
        rng: np.random.Generator,
    ) -> None:
        self.world_size, self.packs = world_size, packs
        self.degree = np.concatenate([np.full(p.time.size, p.degree) for p in packs])
        self.time = np.concatenate([p.time for p in packs])
        window_steps = np.diff(np.append(np.arange(0, steps, per_window), steps))
        slowest = np.argsort(-self.time, kind="stable")
        u = np.modf(np.arange(self.time.size) * GOLDEN + rng.random())[0]
        at_step = np.minimum((u * steps).astype(np.int64), steps - 1)
        self.window_of = np.empty(self.time.size, dtype=np.int64)
        self.window_of[slowest] = at_step // per_window
        units = np.bincount(self.window_of, weights=self.degree, minlength=window_steps.size)
        units = units.astype(np.int64)
        # each window's single ranks: its steps' (more steps where its groups need them)
        self.free = np.maximum(window_steps, -(-units // world_size)) * world_size - units

    def pack_small(
        self, small: np.ndarray, t: _Degree, order: _Order, rng: np.random.Generator
    ) -> list[_Packed]:
        """The small samples (in type order) spread over the windows in proportion to their
        single ranks (a low-discrepancy sequence), each window's packed into exactly its
        single ranks (module docstring, 4): more whole steps where LPT finds no room, empty
        packs filled from packs of several samples (`packing._fill_empty`), then added to
        `order` (a window without small samples: no packs; else as many as its single
        ranks, empty ones padding)."""
        n, free = self.world_size, self.free
        x = np.modf(np.arange(small.size) * GOLDEN + rng.random())[0] * max(int(free.sum()), 1)
        at = np.minimum(np.searchsorted(np.cumsum(free), x, side="right"), free.size - 1)
        by = np.argsort(narrow(at, free.size), kind="stable")
        parts = np.split(small[by], np.searchsorted(at[by], np.arange(1, free.size)))
        out = []
        for slots, part in zip(free.tolist(), parts, strict=True):
            if part.size == 0:
                out.append(_Packed(1, np.zeros(0, dtype=np.int64), np.zeros(0),
                                   np.zeros((t.types.caps.size, 0)), 0))
                continue
            packed = pack_members(part, t.types, slots or n, n, rng.random)
            extra = -(-max(0, packed.fill.size.size - slots) // n)  # whole steps more
            out.append(order.add(_fill_to(packed, slots + extra * n, t.types), t))
        return out

    def deal(self, windows: list[_Packed], rng: np.random.Generator) -> tuple[np.ndarray, ...]:
        """The slot list (every step's N ranks: a pack id on a group's first rank and on a
        single rank, -1 on a group's other ranks), its padding flags and degrees, and the
        packs' starts and sizes in the epoch's order (`_Order`: groups first, then each
        window's small packs, the empty ones left out)."""
        size = np.concatenate([p.size for p in self.packs + windows])
        start = starts(size)
        time = np.concatenate([self.time, *(w.time for w in windows)])
        degree = np.concatenate([self.degree, np.ones(time.size - self.time.size, np.int64)])
        first = np.cumsum([self.time.size] + [w.time.size for w in windows])
        pool = np.flatnonzero(size[self.time.size :] > 0) + self.time.size
        rows = []
        for w in range(len(windows)):
            ids = np.arange(first[w], first[w + 1])
            singles, pad = _padded(ids, size[ids] > 0, pool, rng)
            items = np.concatenate([np.flatnonzero(self.window_of == w), singles])
            flags = np.concatenate([np.zeros(items.size - singles.size, bool), pad])
            rows += self._deal_window(items, flags, degree, time, pool, rng)
        slots, pad, deg = (np.concatenate(r) for r in zip(*rows, strict=True))
        keep = size > 0  # a small pack left empty is never dealt: padding repeats real ones
        renumber = np.cumsum(keep) - 1
        slots = np.where(slots >= 0, renumber[np.maximum(slots, 0)], -1)
        return slots, pad, deg, start[keep], size[keep]

    def _deal_window(
        self, items: np.ndarray, pad: np.ndarray, degree: np.ndarray, time: np.ndarray,
        pool: np.ndarray, rng: np.random.Generator,
    ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """A window's groups and single-rank packs (`items`, padding repeats where `pad`) as
        whole steps, by sort-and-chunk over rank units (`_chunks`); steps then shuffled. A
        step left short is filled with padding (`_step_row`; `pool`: the epoch's real
        single-rank packs)."""
        is_group = degree[items] > 1
        slow = np.lexsort((rng.random(items.size), -time[items]))
        groups, singles = slow[is_group[slow]], slow[~is_group[slow]]
        steps = _chunks(groups, singles, degree[items], time[items], self.world_size)
        return [self._step_row(items[steps[k]], pad[steps[k]], degree, pool, rng)
                for k in rng.permutation(len(steps))]

    def _step_row(
        self, items: np.ndarray, pad: np.ndarray, degree: np.ndarray, pool: np.ndarray,
        rng: np.random.Generator,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step's N slots: its groups from rank 0 in decreasing degree (random among equal
        ones, so each is aligned), its single ranks in random order after them; ranks left
        over repeat random single packs of `pool` (padding), or, where the epoch has none,
        groups of the least degree (then only groups fill the step: they divide its rest)."""
        n = self.world_size
        deg = degree[items]
        by = np.lexsort((rng.random(items.size), -deg))
        items, pad, deg = items[by], pad[by], deg[by]
        slot = np.full(n, -1, dtype=np.int64)
        flags = np.zeros(n, dtype=bool)
        out = np.zeros(n, dtype=np.int64)
        first = np.cumsum(deg) - deg
        slot[first], flags[first], out[first] = items, pad, deg
        used = int(deg.sum())
        if used < n and pool.size:
            at = np.arange(used, n)
            slot[at], flags[at], out[at] = rng.choice(pool, at.size), True, 1
        elif used < n:
            least = int(self.degree.min())
            fill = rng.choice(np.flatnonzero(self.degree == least), (n - used) // least)
            at = used + np.arange(fill.size) * least
            slot[at], flags[at], out[at] = fill, True, least
        return slot, flags, out


def _chunks(
    groups: np.ndarray, singles: np.ndarray, degree: np.ndarray, time: np.ndarray,
    world_size: int,
) -> list[np.ndarray]:
    """Sort-and-chunk over rank units: `groups` and `singles` (item indices, each slowest
    first; `degree`, `time` per item) into steps of N ranks, each step the slowest items left
    whose units fill it, in their merged order by time (as dealing's sort-and-chunk takes the
    next N batches): a group that would cross the step's end waits for the next step and the
    step's last ranks take the next singles; once the singles are out, later groups that
    still fit, then nothing (`_step_row` pads the step)."""
    n, g_deg, g_time, s_time = world_size, degree[groups], time[groups], time[singles]
    steps, gi, si = [], 0, 0
    used = np.zeros(groups.size, dtype=bool)
    while True:
        while gi < groups.size and used[gi]:  # the first group left, a window of N at a time
            gi += int(np.argmin(used[gi : gi + n])) or min(n, groups.size - gi)
        if gi >= groups.size and si >= singles.size:
            return steps
        head_g = gi + np.flatnonzero(~used[gi : gi + n])
        head_s = np.arange(si, min(si + n, singles.size))
        t = np.concatenate([g_time[head_g], s_time[head_s]])
        units = np.concatenate([g_deg[head_g], np.ones(head_s.size, dtype=np.int64)])
        single = np.arange(t.size) >= head_g.size
        order = np.lexsort((single, -t))  # slowest first, a group before a single as slow
        cum = np.cumsum(units[order])
        taken = order[: int(np.searchsorted(cum, n, side="right"))]
        took_g = head_g[taken[~single[taken]]]
        rest = n - int(units[taken].sum())
        n_s = int(single[taken].sum())
        extra = min(rest, singles.size - si - n_s)
        n_s, rest = n_s + extra, rest - extra
        used[took_g] = True
        fill = []
        k = gi
        while rest > 0 and k < groups.size:  # the singles are out: later groups that fit
            if not used[k] and g_deg[k] <= rest:
                used[k] = True
                fill.append(k)
                rest -= int(g_deg[k])
            k += 1
        picked = np.concatenate([took_g, np.asarray(fill, dtype=np.int64)])
        steps.append(np.concatenate([groups[picked], singles[si : si + n_s]]))
        si += n_s


def _fill_to(window: _Window, slots: int, types: _Types) -> _Window:
    """`window` with empty packs up to `slots` packs, filled where packs hold several samples
    (`packing._fill_empty`); those left empty become padding."""
    missing = slots - window.fill.size.size
    if missing <= 0:
        return window
    fill = _Fill.concat([window.fill, _Fill.zeros(missing, window.fill.used.shape[0])])
    pack_of, place = window.pack_of.copy(), window.place.copy()
    _fill_empty(pack_of, place, fill, types.of[window.members], types)
    return _Window(window.members, pack_of, place, fill, window.steps)


def _padded(
    ids: np.ndarray, real: np.ndarray, pool: np.ndarray, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The window's single-rank packs: its real ones, and for each empty one a repeat of a
    random real one of the window (of the epoch where the window has none)."""
    if ids.size == 0:
        return ids, np.zeros(0, dtype=bool)
    source = ids[real] if real.any() else pool
    pack = ids.copy()
    pack[~real] = rng.choice(source, int((~real).sum()))
    return pack, ~real


def widen(formed: MicroBatches, degree: int) -> MicroBatches:
    """A plan of one pack per group of `degree` ranks (slot j: step j // (N/d), group j %
    (N/d)) as rank slots: each group's pack on its first rank, -1 on its others
    (``adaptiveload-sp-fixed``)."""
    k = formed.slots.size
    slots = np.full((k, degree), -1, dtype=np.int64)
    pad = np.zeros((k, degree), dtype=bool)
    deg = np.zeros((k, degree), dtype=np.int64)
    slots[:, 0], pad[:, 0], deg[:, 0] = formed.slots, formed.slot_pad, degree
    return replace(formed, slots=slots.ravel(), slot_pad=pad.ravel(), slot_degree=deg.ravel(),
                   summary={**formed.summary, "sp_max_degree": degree})


def _oversize(code: np.ndarray, sample_degree: np.ndarray, per: dict[int, _Degree]) -> np.ndarray:
    """Per sample: over a limit on its own at its degree (it runs alone)."""
    over = np.zeros(code.size, dtype=bool)
    for d, t in per.items():
        at = sample_degree == d
        over[at] = t.types.alone[t.types.of[at]]
    return over


def _summary(
    limits: PackLimits, max_degree: int, packs: list[_Packed], windows: list[_Packed],
    group_of: np.ndarray, sample_degree: np.ndarray,
) -> dict[str, object]:
    """The policy's own plan-summary fields: the limits and mean fill (per rank, at each
    pack's degree), the largest degree allowed, the groups and samples per degree, and the
    small samples that topped up groups."""
    used = np.concatenate([p.used for p in packs + windows], axis=1)
    fill = used.mean(axis=1) / np.asarray(limits.caps)
    degrees, samples = np.unique(group_of, return_counts=True)
    return {
        "pack_limits": limits.as_dict(),
        "pack_fill_mean": {name: float(f) for name, f in zip(limits.names, fill, strict=True)},
        "sp_max_degree": max_degree,
        "sp_groups": {str(p.degree): int(p.time.size) for p in packs},
        "sp_samples": {str(d): int(c) for d, c in zip(degrees, samples, strict=True)},
        "sp_topped_up": int(((group_of > 1) & (sample_degree == 1)).sum()),
    }
