"""The plan of one epoch: which samples form each micro-batch and which rank runs it when.

Every rank calls ``build_plan`` with the same arguments and gets the identical plan: all
randomness comes from one numpy Generator seeded by (seed, epoch), nothing is communicated.

Per epoch (everything vectorised; 1M samples at N = 1024 plan in about a second) the policy
forms and deals its micro-batches (``Policy.micro_batches``: the plan branches on no policy);
the homogeneous policies (``batches.bucket_cuts``):

1. shuffle the samples within each bucket shape;
2. cut each bucket into micro-batches of B(S) samples (the policy's rule); a bucket's last
   batch may be smaller: it is kept, never dropped or padded, so every sample runs exactly
   once;
3. shuffle the list of batches;
4. **padding (documented choice):** if the batch count K is not a multiple of N, the last
   step's missing ranks get repeats of distinct, randomly drawn batches of this epoch (with
   replacement only if K < missing ranks). Their rows carry ``is_padding=True`` and are
   counted in ``num_padding``; every rank thus runs the same number of steps (what DDP
   needs), and the repeats are never hidden;
5. deal: slot j -> step j // N, rank j % N (Open-Sora style); ``adaptiveload-balanced``
   first reorders the slots with ``dealing.deal_balanced`` on predicted cost.

The packed policy forms packs instead (``packing.make_packs``): samples of any lengths under
the memory and compute limits, dealt by predicted cost; it pads only where a window has fewer
samples than packs (fewer samples than ranks, or samples that each need a pack of their own).

A sample over a budget on its own forms B = 1 and is counted in ``num_oversize``. A sample
that cannot run at all (a Calibration's predicted memory of B = 1 above its capacity, on one
device, or per rank at the policy's largest sequence-parallel degree: `Policy.max_degree`,
``adaptiveload-sp``) is never planned: it is excluded and counted in ``num_over_capacity``
(and in ``num_excluded``).

Table columns: ``step, rank, sample_id``; ``frames, height, width, tokens`` of the sample's
*bucket* shape (what the model is fed); ``batch_id`` (a padding repeat shares the id of the
batch it repeats); ``is_padding``. One row per (step, rank, sample): a (step, rank) cell is one
micro-batch, of one bucket shape under the homogeneous policies, of several in a pack. A plan
with sequence-parallel groups (``groups``) has one more column, ``sp_degree``: a row's
micro-batch runs on ranks ``rank .. rank + sp_degree - 1`` of its step (``rank`` the group's
first), every one of which trains it; plans without groups have no such column, and their
digests are as before. ``table.attrs["plan"]`` holds the summary (kept in Parquet).

With a cost model the summary adds predicted metrics (``PREDICTED``, through
``simulate.simulate``), among them ``predicted_vs_lower_bound``: the plan's summed step compute
over the sum of each step's lower bound (``CostModel.step_lower_bound``: no packing of the
step's samples can do better), for every policy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration, CostModel, group_bound
from adaptiveload.data.bucketing import Bucketed
from adaptiveload.errors import UserError
from adaptiveload.planning.batches import (
    Batches,
    Buckets,
    EpochInputs,
    MicroBatches,
    starts,
)
from adaptiveload.planning.dealing import DEFAULT_WINDOW_STEPS, narrow
from adaptiveload.planning.packing import epoch_limits
from adaptiveload.planning.policies import Budgets, Policy, get_policy
from adaptiveload.planning.simulate import (
    DEFAULT_ALLREDUCE_GBPS,
    MEMORY_FIELDS,
    Simulation,
    epoch_seconds,
    simulate,
)
from adaptiveload.step_table import SP_DEGREE

REQUIRED_COLUMNS = ("sample_id", "bucket_frames", "bucket_height", "bucket_width", "tokens")
TABLE_COLUMNS = (
    "step", "rank", "sample_id", "frames", "height", "width", "tokens", "batch_id", "is_padding",
)
# summary fields that say what a plan was made from, in the order a mismatch is reported: two
# plans whose digests differ are told apart by the first of these that differs
PLAN_INPUTS = (
    "policy", "seed", "epoch", "world_size", "num_samples", "num_excluded",
    "m_tok", "m_mem", "m_comp", "p", "pack_tokens", "window_steps", "deal_cost",
    "steps_per_epoch",
)
# plan.steps_per_epoch: the policy's own step count, equal-token's, or an integer
FREE, MATCH = "free", "match"
STEP_MODES = (FREE, MATCH)
# a plan whose padding repeats exceed this share of its real batches is reported
HEAVY_PADDING = 0.1
SHOW_IDS = 5  # sample ids a message quotes (excluded, repeated)
PREDICTED = (
    "imbalance_rate", "idle_fraction", "samples_per_s", "tokens_per_s", "vs_lower_bound",
    "epoch_lower_bound_s", "vs_epoch_lower_bound",
    "padding_samples", "padding_fraction",
    "vram_utilization_mean", "vram_utilization_max",  # only with a capacity (a Calibration)
)


@dataclass
class Plan:
    """`table`: one row per (step, rank, sample), ordered by step, rank; `summary`: counts,
    checks and budgets (and predicted metrics when a cost model was given); `simulation`: the
    plan through that cost model, whose whole-epoch metrics the predictions are (None without
    one; `Simulation.timed` gives another window without simulating again)."""

    table: pd.DataFrame
    summary: dict[str, Any]
    simulation: Simulation | None = None




@dataclass(frozen=True)
class PlanConfig:
    """What an epoch's plan is made from, the samples aside: the policy (a name is looked up,
    and its budgets checked, once, here), its budgets, the ranks and seed, the epoch, the cost
    model (None: proxies, no predictions), the cost-aware deal's window (None: whole epoch),
    the step count (``free``: the policy's own, ``match``: equal-token's, or K) and the
    all-reduce bandwidth the predictions assume. ``adaptiveload plan``, ``compare`` (so the
    pipeline's plan and simulate jobs) and training (``sampler.PlanBuilder``) build one alike;
    ``config.plan(samples)`` is the plan, identical on every rank."""

    policy: Policy | str
    budgets: Budgets
    world_size: int
    seed: int
    epoch: int = 0
    cost_model: CostModel | Calibration | None = None
    window_steps: int | None = DEFAULT_WINDOW_STEPS
    steps_per_epoch: str | int = FREE
    allreduce_gbps: float = DEFAULT_ALLREDUCE_GBPS

    def __post_init__(self) -> None:
        policy = get_policy(self.policy)
        policy.check(self.budgets)
        object.__setattr__(self, "policy", policy)  # a frozen dataclass: set once, here
        _check_ints(
            world_size=(self.world_size, 1),
            seed=(self.seed, 0),
            epoch=(self.epoch, 0),
            window_steps=(self.window_steps, 1),
        )

    @property
    def max_degree(self) -> int:
        """The largest sequence-parallel degree the policy may plan on these ranks
        (`Policy.max_degree`): samples over the capacity at it are excluded."""
        return self.policy.max_degree(self.cost_model, self.world_size)

    def plan(
        self, samples: Any, num_excluded: int | None = None, num_over_capacity: int | None = None
    ) -> Plan:
        """This epoch's plan of `samples` (``build_plan``'s)."""
        return _plan(self, samples, num_excluded, num_over_capacity)


def build_plan(
    samples: Any,
    policy: str | Policy,
    budgets: Budgets,
    world_size: int,
    seed: int,
    epoch: int = 0,
    cost_model: CostModel | Calibration | None = None,
    window_steps: int | None = DEFAULT_WINDOW_STEPS,
    num_excluded: int | None = None,
    allreduce_gbps: float = DEFAULT_ALLREDUCE_GBPS,
    steps_per_epoch: str | int = FREE,
    num_over_capacity: int | None = None,
) -> Plan:
    """Plan one epoch of `samples` (a bucketed DataFrame, or a ``Bucketed`` with ``.samples``
    and ``.num_excluded``) for `world_size` ranks: ``PlanConfig(...).plan(samples)``.
    `num_over_capacity`: of `num_excluded`, the samples already taken out as over the device's
    capacity (``without_over_capacity``); any left in `samples` are taken out here. Balanced
    policies deal on ``cost_model.step_time`` when given, else on the proxy B * S^p;
    `window_steps` (None = whole epoch) bounds how far they move a batch; `steps_per_epoch`:
    ``free`` (the policy's own count), ``match`` (equal-token's) or K."""
    config = PlanConfig(
        policy,
        budgets,
        world_size,
        seed,
        epoch,
        cost_model,
        window_steps,
        steps_per_epoch,
        allreduce_gbps,
    )
    return config.plan(samples, num_excluded, num_over_capacity)


def _plan(
    config: PlanConfig, samples: Any, num_excluded: int | None, num_over_capacity: int | None
) -> Plan:
    """`config`'s plan of `samples` (build_plan's docstring). This plan's table, its
    baseline and its simulation are built one after another, each in its own function, so
    the arrays of one are gone before the next is built (at 10M samples each holds
    gigabytes); the plan's own refusals come first."""
    cost_model, world_size = config.cost_model, config.world_size
    table, summary = _table(config, samples, num_excluded, num_over_capacity)
    baseline = None
    if cost_model is not None and config.policy.baseline is not None:
        baseline = _baseline(config, samples, num_excluded, num_over_capacity)
    sim = None
    if cost_model is not None:
        sim = simulate(
            table, cost_model, allreduce_gbps=config.allreduce_gbps, world_size=world_size
        )
        summary.update({f"predicted_{k}": sim.summary[k] for k in PREDICTED if k in sim.summary})
        summary["predicted_source"] = "model"
        summary.update({k: sim.summary[k] for k in MEMORY_FIELDS})
        if baseline is not None and baseline[1] >= summary["num_planned"]:
            # where the baseline trains fewer of the samples (it excludes what this plan
            # trains) there is no like-for-like rate
            summary.update(baseline_policy=baseline[0],
                           baseline_predicted_samples_per_s=baseline[2])
    return Plan(table=table, summary=summary, simulation=sim)


def _table(
    config: PlanConfig, samples: Any, num_excluded: int | None, num_over_capacity: int | None
) -> tuple[pd.DataFrame, dict[str, Any]]:
    """`config`'s plan table of `samples` and its summary, the predictions aside."""
    pol, budgets, cost_model = config.policy, config.budgets, config.cost_model
    world_size, seed, epoch = config.world_size, config.seed, config.epoch
    window_steps, steps_per_epoch = config.window_steps, config.steps_per_epoch
    frame, excluded, over_capacity, buckets, target, formed = _form(
        config, samples, num_excluded, num_over_capacity
    )
    batches, slots, slot_pad = formed.batches, formed.slots, formed.slot_pad
    slot_size = _slot_sizes(formed)
    table, row_sample = _rows(frame, buckets, formed, slot_size, world_size)
    digests = _digests(frame, row_sample, slot_size, slot_pad, world_size, formed.slot_degree)
    real = ~table["is_padding"].to_numpy()
    seen = np.bincount(row_sample[real], minlength=len(frame))
    planned, duplicates = int((seen > 0).sum()), int((seen > 1).sum())
    del slot_size, row_sample, seen  # (80 MB each at 10M samples) before the summary's own
    tokens = buckets.tokens[buckets.of]
    max_degree = int(formed.summary.get("sp_max_degree", 1))
    summary: dict[str, Any] = {
        "policy": pol.name,
        "world_size": world_size,
        "num_samples": len(frame) + excluded,
        "num_planned": planned,
        "num_excluded": excluded,
        "num_oversize": int(formed.oversize.sum()),
        "num_over_capacity": over_capacity,
        "num_padding": int((~real).sum()),
        "num_padding_batches": int(slot_pad.sum()),
        "duplicates": duplicates,
        "steps": slots.size // world_size,
        "steps_asked": target,
        "min_steps_per_epoch": _min_steps(buckets, budgets, cost_model, world_size, max_degree),
        "batches": int(batches.size.size),
        "min_sample_tokens": int(buckets.tokens.min()),
        "max_tokens_per_batch": int(np.add.reduceat(tokens[batches.order], batches.start).max()),
        "constraint_violations": formed.violations,
        **budgets.as_dict(),
        "seed": seed,
        "epoch": epoch,
        "steps_per_epoch": steps_per_epoch,
        "window_steps": window_steps if formed.dealt_on else None,
        "deal_cost": formed.dealt_on,
        **digests,
        "composition_digest": composition_digest(tokens, batches),
    }
    summary.update(_batch_spread(table))
    summary.update(formed.summary)
    table.attrs["plan"] = dict(summary)
    return table, summary


def _form(
    config: PlanConfig, samples: Any, num_excluded: int | None, num_over_capacity: int | None
) -> tuple[pd.DataFrame, int, int, Buckets, int | None, MicroBatches]:
    """The samples `config` plans (`_unpack`), the excluded and over-capacity counts, their
    buckets, the steps asked for and the policy's micro-batches, formed and dealt."""
    frame, excluded, over_capacity = _unpack(
        samples, num_excluded, num_over_capacity, config.cost_model, config.max_degree
    )
    rng = np.random.default_rng([config.seed, config.epoch])
    tokens = frame["tokens"].to_numpy(np.int64)
    buckets = _buckets(frame, tokens)
    target = _target_steps(config.steps_per_epoch, buckets, config.budgets, config.world_size)
    formed = config.policy.micro_batches(
        EpochInputs(buckets, tokens, config.budgets, config.cost_model, config.world_size,
                    config.window_steps, rng, target)
    )
    return frame, excluded, over_capacity, buckets, target, formed


def _baseline(
    config: PlanConfig, samples: Any, num_excluded: int | None, num_over_capacity: int | None
) -> tuple[str, int, float]:
    """The policy's baseline (`Policy.baseline`) planning the same samples: its name, how many
    of them it trains, its predicted samples/s, for `plan_warnings` to flag a plan slower than
    it. Its epoch seconds come from its micro-batches (`simulate.epoch_seconds`, what
    `simulate` gives its plan), without the tables of a plan nobody keeps."""
    base = replace(config, policy=config.policy.baseline)
    _, _, _, buckets, _, formed = _form(base, samples, num_excluded, num_over_capacity)
    batches, n = formed.batches, config.world_size
    steps = formed.slots.size // n
    live = np.flatnonzero(formed.slots >= 0)  # a group's other ranks hold -1
    batch, real = formed.slots[live], ~formed.slot_pad[live]
    degree = np.ones(live.size, dtype=np.int64)
    if formed.slot_degree is not None:
        degree = np.maximum(formed.slot_degree[live], 1)
    del formed  # its rank slots (at 10M samples, hundreds of MB): gone before the sums
    planned = _trained(batches, batch[real], buckets.of.size)
    tokens = buckets.tokens[narrow(buckets.of, buckets.tokens.size)[batches.order]]
    del buckets
    sum_s = np.add.reduceat(tokens, batches.start)[batch]
    sum_sq = np.add.reduceat(tokens**2, batches.start)[batch]
    del tokens
    size = batches.size[batch]
    seconds = epoch_seconds(live // n, steps, size, sum_s, sum_sq, degree, config.cost_model, n,
                            config.allreduce_gbps)
    return base.policy.name, planned, float(size[real].sum()) / seconds


def _trained(batches: Batches, run: np.ndarray, samples: int) -> int:
    """How many of the `samples` the batches `run` (ids, repeats among them) hold, each
    sample once."""
    used = np.zeros(batches.size.size, dtype=bool)
    used[run] = True
    used = np.flatnonzero(used)
    at = np.repeat(batches.start[used] - starts(batches.size[used]), batches.size[used])
    seen = np.zeros(samples, dtype=bool)
    seen[batches.order[at + np.arange(at.size)]] = True
    return int(seen.sum())


def _buckets(frame: pd.DataFrame, tokens: np.ndarray) -> Buckets:
    shape = np.stack([frame[c].to_numpy(np.int64) for c in REQUIRED_COLUMNS[1:4]], axis=1)
    if shape.min() < 1 or shape.max() >= 1 << 20 or tokens.min() < 1:
        raise UserError("bucketed samples: bucket shapes and tokens must be positive (< 2^20)")
    key = (shape[:, 0] << 40) | (shape[:, 1] << 20) | shape[:, 2]
    bucket, keys = pd.factorize(key, sort=True)  # hashing: O(n), few distinct shapes
    bucket_tokens = np.zeros(len(keys), dtype=np.int64)
    bucket_tokens[bucket] = tokens
    if np.any(bucket_tokens[bucket] != tokens):
        raise UserError("bucketed samples: column tokens differs within one bucket shape")
    keys = np.asarray(keys, dtype=np.int64)
    bucket_shape = np.stack([keys >> 40, (keys >> 20) & MAX_TOKENS, keys & MAX_TOKENS], axis=1)
    return Buckets(of=bucket, shape=bucket_shape, tokens=bucket_tokens)


def _min_steps(
    buckets: Buckets, budgets: Budgets, cost_model: CostModel | Calibration | None, n: int,
    max_degree: int = 1,
) -> int | None:
    """K_min: the fewest steps any plan of these samples within the packed policy's limits
    takes (`EpochLimits.min_micro_batches` over N; in rank units where samples may run in
    sequence-parallel groups up to `max_degree`, `GroupBound.terms`); None without M_comp
    and p."""
    limits = epoch_limits(budgets, cost_model)
    if limits is None:
        return None
    values, count = buckets.token_counts()
    groups = group_bound(cost_model, max_degree)
    if groups is None:
        return -(-limits.min_micro_batches(values, count) // n)
    return -(-groups.terms(cost_model.cost, values, count, limits)[0] // n)


def _batch_spread(table: pd.DataFrame) -> dict[str, float]:
    """`metrics.batch_spread` of the epoch's optimizer steps: the real samples and tokens
    each step trains on, all ranks together (padding repeats left out)."""
    steps = int(table["step"].iat[-1]) + 1  # the table is ordered by step
    real = ~table["is_padding"].to_numpy()
    step = table["step"].to_numpy()[real]
    tokens = table["tokens"].to_numpy(np.float64)[real]
    return metrics.batch_spread(
        np.bincount(step, minlength=steps), np.bincount(step, weights=tokens, minlength=steps)
    )


def _target_steps(
    steps_per_epoch: str | int, buckets: Buckets, budgets: Budgets, world_size: int
) -> int | None:
    """The step count `steps_per_epoch` asks for: None for ``free``; for ``match``
    equal-token's, ⌈Σ_b ⌈n_b / B_tok(S_b)⌉ / N⌉ over the buckets (it needs M_tok)."""
    if steps_per_epoch == FREE:
        return None
    if steps_per_epoch == MATCH:
        if budgets.m_tok is None:
            raise UserError(
                "steps_per_epoch=match: equal-token's step count needs budget m_tok; give it "
                "or a calibration"
            )
        count = np.bincount(buckets.of, minlength=buckets.tokens.size)
        b_size = get_policy("equal-token").batch_size(buckets.tokens, budgets)
        return max(1, -(-int((-(-count // b_size)).sum()) // world_size))
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, (int, np.integer)):
        raise UserError(
            f"steps_per_epoch={steps_per_epoch!r}: expected {FREE}, {MATCH} or an integer >= 1"
        )
    _check_ints(steps_per_epoch=(steps_per_epoch, 1))
    return int(steps_per_epoch)








def _slot_sizes(formed: MicroBatches) -> np.ndarray:
    """How many samples each slot runs: its batch's size; 0 on a group's other ranks."""
    if formed.slot_degree is None:
        return formed.batches.size[formed.slots]
    live = formed.slots >= 0
    return np.where(live, formed.batches.size[np.where(live, formed.slots, 0)], 0)


def _rows(
    frame: pd.DataFrame, buckets: Buckets, formed: MicroBatches, slot_size: np.ndarray,
    world_size: int,
) -> tuple[pd.DataFrame, np.ndarray]:
    """The plan table (one row per sample of each slot; `slot_size`: each slot's samples,
    `_slot_sizes`) and each row's sample position.
    Built column by column into one integer block that the frame adopts without a copy: at
    10M rows the copies pandas would make cost seconds. A row's shape and tokens are its
    bucket's, looked up in the small bucket table: one gather over the samples, not four.
    With groups (`formed.slot_degree`), a group's rows sit on its first rank and carry its
    degree (`SP_DEGREE`)."""
    batches, slots, slot_pad = formed.batches, formed.slots, formed.slot_pad
    n = int(slot_size.sum())
    # each row's place in `batches.order`: its slot's batch start plus its place in the slot
    # (one expression per array, so the per-slot temporaries go at once)
    row_sample = batches.order[
        np.repeat(batches.start[slots] - starts(slot_size), slot_size) + np.arange(n)
    ]
    ints = np.empty((6, n), dtype=np.int64)
    np.divmod(np.repeat(np.arange(slots.size), slot_size), world_size, out=(ints[0], ints[1]))
    row_bucket = narrow(buckets.of, buckets.tokens.size)[row_sample]
    for i in range(3):
        np.take(buckets.shape[:, i], row_bucket, out=ints[2 + i])
    np.take(buckets.tokens, row_bucket, out=ints[5])
    int_cols = ["step", "rank", "frames", "height", "width", "tokens"]
    table = pd.DataFrame(ints.T, columns=int_cols, copy=False)
    table.insert(2, "sample_id", frame["sample_id"].array.take(row_sample))  # no Python objects
    table["batch_id"] = np.repeat(slots, slot_size)
    table["is_padding"] = np.repeat(slot_pad, slot_size)
    if formed.slot_degree is not None:
        table[SP_DEGREE] = np.repeat(formed.slot_degree, slot_size)
    return table, row_sample




MAX_TOKENS = (1 << 20) - 1  # bucket shapes and tokens are packed in 20 bits (_buckets)


def check_table(table: pd.DataFrame, origin: str) -> None:
    """UserError unless `table` is a plan table as `build_plan` writes it: the columns,
    integer step/rank/shape/tokens in range, each sample planned once (padding aside).
    A plan file from elsewhere passes only if it could have been planned."""
    missing = [c for c in TABLE_COLUMNS if c not in table.columns]
    if missing:
        raise UserError(
            f"{origin}: column(s) {', '.join(missing)} missing; write it with `adaptiveload plan`"
        )
    if table.empty:
        raise UserError(f"{origin}: plan table is empty")
    fix = "write the plan with `adaptiveload plan`"
    for col, least, most in (
        ("step", 0, None), ("rank", 0, None), ("frames", 1, MAX_TOKENS),
        ("height", 1, MAX_TOKENS), ("width", 1, MAX_TOKENS), ("tokens", 1, MAX_TOKENS),
    ):
        values = pd.to_numeric(table[col], errors="coerce").to_numpy(np.float64, na_value=np.nan)
        bad = ~np.isfinite(values) | (values != np.round(values)) | (values < least)
        if most is not None:
            bad |= values > most
        if bad.any():
            row = int(np.argmax(bad))
            limit = f"{least}..{most}" if most is not None else f">= {least}"
            raise UserError(
                f"{origin}: row {row}: column {col} is {table[col].iat[row]!r}; "
                f"expected an integer {limit}; {fix}"
            )
    if SP_DEGREE in table.columns:
        _check_degrees(table, origin, fix)
    real = table.loc[~table["is_padding"].astype(bool), "sample_id"]
    repeated = real[real.duplicated()]
    if len(repeated):
        raise UserError(
            f"{origin}: sample {repeated.iat[0]!r} is planned more than once outside padding "
            f"rows; {fix}"
        )


def _check_degrees(table: pd.DataFrame, origin: str, fix: str) -> None:
    """UserError unless every row's group is a power-of-two degree on an aligned block of
    ranks, ``rank`` a multiple of ``sp_degree`` (the ranks a group runs on)."""
    degree = pd.to_numeric(table[SP_DEGREE], errors="coerce").to_numpy(np.float64)
    rank = pd.to_numeric(table["rank"], errors="coerce").to_numpy(np.float64)
    whole = np.isfinite(degree) & (degree >= 1) & (degree == np.round(degree))
    d = np.where(whole, degree, 1).astype(np.int64)
    bad = ~whole | (d & (d - 1) != 0) | (rank % d != 0)
    if bad.any():
        row = int(np.argmax(bad))
        raise UserError(
            f"{origin}: row {row}: column {SP_DEGREE} is {table[SP_DEGREE].iat[row]!r} at rank "
            f"{table['rank'].iat[row]!r}; expected a power of two whose multiple the rank is "
            f"(an aligned group); {fix}"
        )


def _digest(*arrays: np.ndarray) -> str:
    """Short content hash of arrays (the plan's row positions, batch sizes, padding flags)."""
    h = hashlib.sha256()
    for arr in arrays:
        h.update(np.ascontiguousarray(arr))  # the array's buffer: no copy
    return h.hexdigest()[:16]


def composition_digest(tokens: np.ndarray, batches: Batches) -> str:
    """A digest of what the epoch's micro-batches are made of: the multiset of their
    compositions (each one's multiset of token counts), blind to which sample of a token count
    sits where and to the order of steps and ranks. Plans of two seeds with the same digest
    train the same mixes of lengths together (docs/packing.md, seeds that vary)."""
    per_sample = _mix64(tokens[batches.order].astype(np.uint64))
    per_batch = np.add.reduceat(per_sample, batches.start)  # wraps mod 2^64: a multiset hash
    return _digest(np.sort(_mix64(per_batch)))


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fixed bijection of uint64 that spreads every input bit, so a
    sum of mixed values hashes a multiset."""
    with np.errstate(over="ignore"):  # in place after the first copy: one array, not four
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
        return x


def table_digest(table: pd.DataFrame) -> str:
    """The digest of a plan table that carries no summary (one not written by `build_plan`):
    its steps, ranks, sample_ids and padding flags, row by row."""
    cols = ["step", "rank", "sample_id", "is_padding"]
    return _digest(pd.util.hash_pandas_object(table[cols], index=False).to_numpy())


# what a differing field says about two plans (plan_difference), beyond its name
_DIFFERENCE_MEANS = {"data_digest": "other samples, or the same ones in another row order"}


def plan_difference(a: Mapping[str, Any], b: Mapping[str, Any]) -> tuple[str, Any, Any]:
    """The first field in which plan summaries `a` and `b` differ, and its two values: an input
    (PLAN_INPUTS, in that order), then the data, then the plan digest itself. The data
    field's name says what it means ("data_digest (other samples, or ...)")."""
    keys = (*PLAN_INPUTS, "data_digest")
    for k in keys:
        if k in a and k in b and a[k] != b[k]:
            name = f"{k} ({_DIFFERENCE_MEANS[k]})" if k in _DIFFERENCE_MEANS else k
            return name, a[k], b[k]
    return "plan_digest", a.get("plan_digest"), b.get("plan_digest")


def _digests(
    frame: pd.DataFrame,
    row_sample: np.ndarray,
    slot_size: np.ndarray,
    slot_pad: np.ndarray,
    world_size: int,
    slot_degree: np.ndarray | None = None,
) -> dict[str, str]:
    """The plan's identity: `data_digest` (the samples planned: ids, bucket shapes and tokens,
    in row order) and `plan_digest` (which samples run where and when: the row positions,
    batch sizes and padding flags in slot order, the world size that turns a slot into its step
    and rank, with the data digest that says what a position means). Without the world size,
    plans of 2 and 4 ranks that deal the same slots had one digest.
    With sequence-parallel groups the slots' degrees join the plan digest (plans of one
    rank per micro-batch hash as they always have).
    Resumes (`PlanBatchSampler.load_state_dict`) and ranks (`PlanBatchSampler.check_ranks`)
    compare them; 1M samples digest in tens of milliseconds."""
    data = hashlib.sha256()
    _hash_strings(data, frame["sample_id"])
    for col in REQUIRED_COLUMNS[1:]:
        data.update(np.ascontiguousarray(frame[col].to_numpy(np.int64)))
    data_digest = data.hexdigest()[:16]
    data_bytes = np.frombuffer(data_digest.encode(), np.uint8)
    parts = [data_bytes, np.int64([world_size]), row_sample, slot_size, slot_pad]
    if slot_degree is not None:
        parts.append(slot_degree)
    return {"data_digest": data_digest, "plan_digest": _digest(*parts)}


def _hash_strings(h: Any, values: pd.Series) -> None:
    """Feed a column of strings (other values by their text) to hash `h` through its Arrow
    buffers (offsets and bytes): no Python object per row, zero-copy for pandas' Arrow-backed
    strings."""
    import pyarrow as pa

    try:
        arr = pa.array(values, type=pa.large_string(), from_pandas=True)
    except (pa.ArrowTypeError, pa.ArrowInvalid):  # ids that are not strings (integers)
        arr = pa.array(values.astype(str), type=pa.large_string(), from_pandas=True)
    if isinstance(arr, pa.ChunkedArray):  # a column read in chunks (Parquet, large CSVs)
        arr = arr.combine_chunks()
    offsets = np.frombuffer(arr.buffers()[1], np.int64)[arr.offset : arr.offset + len(arr) + 1]
    h.update((offsets - offsets[0]).tobytes())
    body = arr.buffers()[2]
    if body is not None:
        h.update(memoryview(body)[offsets[0] : offsets[-1]])


def plan_warnings(summary: dict[str, Any], excluded_ids: Sequence[str] = ()) -> list[str]:
    """What about a plan is unusual enough to tell the user, one clause each: samples never
    trained (excluded: no bucket, over the device's capacity; the first SHOW_IDS of
    `excluded_ids` named), samples over a budget on their own (they run alone, B = 1; all of
    them means a budget below every sample), heavy padding, micro-batches beyond the
    calibration's measured memory. The sampler joins them into one warning line; the CLI
    prints them, or refuses them with --strict."""
    found = []
    excluded, total = summary["num_excluded"], summary["num_samples"]
    if excluded:
        over = summary.get("num_over_capacity", 0)
        why = f", {over} of them over the device's capacity" if over else ""
        ids = list(excluded_ids[:SHOW_IDS])
        more = " ..." if len(excluded_ids) > SHOW_IDS else ""
        named = f", e.g. {', '.join(map(repr, ids))}{more}" if ids else ""
        found.append(f"{excluded} of {total} samples excluded (never trained{why}){named}")
    oversize, planned = summary["num_oversize"], total - excluded
    if oversize:
        pol = get_policy(summary["policy"])
        limits = ", ".join(f"{k}={summary[k]:.6g}" for k in pol.requires if k != "p")
        if oversize == planned:
            found.append(
                f"every sample exceeds the {pol.name} budget {limits} on its own (the smallest "
                f"has {summary['min_sample_tokens']} tokens): each batch is one sample; raise "
                "the budget or derive it for this data with `adaptiveload budgets`"
            )
        else:
            degree = summary.get("sp_max_degree", 1)
            where = f" (on one rank or a group of up to {degree} ranks)" if degree > 1 else ""
            found.append(
                f"{oversize} of {planned} samples exceed the {pol.name} budget {limits} on "
                f"their own and run alone (B = 1){where}"
            )
    asked, steps = summary.get("steps_asked"), summary["steps"]
    if asked is not None and steps != asked:
        found.append(
            f"steps_per_epoch={summary['steps_per_epoch']} asked for {asked} steps and the "
            f"plan has {steps} ({steps - asked:+d}): its micro-batches do not fit in {asked} "
            "steps within the limits, so its global batches differ from the steps asked for; "
            "give more steps or free"
        )
    pad, batches = summary["num_padding_batches"], summary["batches"]
    if pad > HEAVY_PADDING * batches:
        found.append(
            f"{pad} padding batches for {batches} real ones ({summary['world_size']} ranks): "
            "each repeats a batch of the epoch; fewer ranks or more data pad less"
        )
    base = summary.get("baseline_predicted_samples_per_s")
    if base is not None and summary["predicted_samples_per_s"] < base:
        found.append(
            f"{summary['policy']} predicts {summary['predicted_samples_per_s']:.4g} samples/s, "
            f"below the {base:.4g} of its baseline {summary['baseline_policy']} on the same "
            f"samples (model): plan with {summary['baseline_policy']}"
        )
    beyond = summary.get("micro_batches_beyond_measured_memory")
    if beyond:
        found.append(
            f"{beyond} micro-batches put more tokens on a rank than the calibration's largest "
            f"measured memory point (up to {summary['max_micro_batch_tokens']:,} tokens a rank "
            f"against {summary['memory_measured_tokens']:,}): "
            "their memory is the fit's extrapolation; calibrate up to the budgets "
            "(`adaptiveload calibrate measure` measures memory up to them on a GPU)"
        )
    return found




def _unpack(
    samples: Any,
    num_excluded: int | None,
    num_over_capacity: int | None,
    cost_model: CostModel | Calibration | None,
    max_degree: int = 1,
) -> tuple[pd.DataFrame, int, int]:
    """The samples to plan (those over the device's capacity at `max_degree` taken out), the
    excluded count and, of it, the over-capacity count."""
    frame = getattr(samples, "samples", samples)
    if not isinstance(frame, pd.DataFrame):
        raise TypeError("samples must be a bucketed DataFrame or a Bucketed")
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise UserError(
            f"bucketed samples: column(s) {', '.join(missing)} missing; bucketize the "
            "manifest first (adaptiveload.data.bucketing.bucketize)"
        )
    if len(frame) == 0:
        raise UserError("bucketed samples: no samples to plan (all excluded or empty manifest)")
    if num_excluded is None:
        num_excluded = int(getattr(samples, "num_excluded", 0))
    if num_over_capacity is None:
        num_over_capacity = int(getattr(samples, "num_over_capacity", 0))
    over = over_capacity(frame, cost_model, max_degree)
    if over.any():
        frame = frame[~over].reset_index(drop=True)
    dropped = int(over.sum())
    return frame, num_excluded + dropped, num_over_capacity + dropped


def over_capacity(
    frame: pd.DataFrame, cost_model: CostModel | Calibration | None, max_degree: int = 1
) -> np.ndarray:
    """Which samples a device cannot hold alone (a Calibration's m(1, S) above its capacity;
    per rank of a sequence-parallel group of `max_degree` ranks, m_static + m_tok S / d +
    m_seq, `CostModel.at_degree`): never planned. All False without a capacity; UserError
    when no sample fits."""
    if not isinstance(cost_model, Calibration) or not cost_model.capacity_bytes:
        return np.zeros(len(frame), dtype=bool)
    tokens = frame["tokens"].to_numpy(np.float64)
    per_rank = cost_model.cost.at_degree(max_degree)
    fits = per_rank.memory(1, tokens) <= cost_model.capacity_bytes
    if len(frame) and not fits.any():
        where = "one device" if max_degree == 1 else f"{max_degree} ranks"
        raise UserError(
            f"no sample fits on {where}: the smallest ({tokens.min():.0f} tokens) needs "
            f"{per_rank.memory(1, tokens.min()) / 1e9:.1f} GB > the calibration's "
            f"capacity {cost_model.capacity_bytes / 1e9:.1f} GB"
        )
    return ~fits


def without_over_capacity(
    bucketed: Bucketed, cost_model: CostModel | Calibration | None, max_degree: int = 1
) -> Bucketed:
    """`bucketed` without the samples a device (a group of `max_degree` ranks) cannot hold
    alone (``over_capacity``): they join its excluded samples, counted (also in
    ``num_over_capacity``) and named in ``excluded_ids``, so what a command reports as
    excluded is what its plan leaves out."""
    over = over_capacity(bucketed.samples, cost_model, max_degree)
    if not over.any():
        return bucketed
    ids = bucketed.samples.loc[over, "sample_id"]
    return replace(
        bucketed,
        samples=bucketed.samples[~over].reset_index(drop=True),
        num_excluded=bucketed.num_excluded + int(over.sum()),
        num_over_capacity=bucketed.num_over_capacity + int(over.sum()),
        excluded_ids=pd.concat([bucketed.excluded_ids, ids], ignore_index=True),
    )


def _check_ints(**values: tuple[int | None, int]) -> None:
    """Each value an integer >= its least (None: not set, nothing to check)."""
    for name, (value, least) in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise UserError(f"{name}={value!r}: must be an integer >= {least}")
