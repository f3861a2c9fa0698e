"""Batch-size policies: how many samples of S tokens one micro-batch holds, how an epoch's
micro-batches are formed and how they are dealt to ranks (``Policy.micro_batches``).

- ``equal-token`` (the Open-Sora / VideoX-Fun baseline): ``B(S) = max(1, floor(M_tok / S))``.
- ``adaptiveload`` (the paper): ``B(S) = max(1, min(floor(M_mem / S), floor(M_comp / S^p)))``.
- ``adaptiveload-balanced`` (beyond the paper): the ``adaptiveload`` batches, dealt so that the
  ranks of one step hold near-equal predicted cost (see ``adaptiveload.planning.dealing``).
- ``adaptiveload-packed`` (beyond the paper): micro-batches of samples of any lengths (packs),
  formed under the memory and compute budgets so that every rank of a step holds near-equal
  predicted cost (see ``adaptiveload.planning.packing``); it needs a model that runs packed
  micro-batches.
- ``adaptiveload-sp`` (beyond the paper): the packed policy with a sequence-parallel degree
  per micro-batch: a sample beyond one device's memory (or over the compute budget alone)
  runs on an aligned group of ranks at the least degree that holds it, topped up with small
  samples, while packs of small samples fill the single ranks (``groups``); where no sample
  needs a group, the packed policy's plan.
- ``adaptiveload-sp-fixed`` (the baseline of trainers that run one SP degree throughout):
  every micro-batch on a group of ``groups.FIXED_DEGREE`` ranks (capped to what the model's
  heads and N allow).

The field's own methods, written here as baselines (``peer``; docs/baselines.md): what a user
would pick instead. Each holds its micro-batches to the memory limit the project's policies
hold theirs to, none to the compute budget M_comp (the paper's, not theirs):

- ``token-ffd``: token-count packing (NeMo DFM / Megatron-Energon), packs dealt blind to cost;
- ``token-kk``: verl's Karmarkar-Karp balancing of token counts over the ranks of each step;
- ``flop-greedy``: KnapFormer's greedy bags, balanced on estimated FLOPs per step;
- ``time-buckets``: Open-Sora's ``search_bs`` / musubi-tuner's bucket tables, one batch size
  per bucket equalising the predicted step time to a reference step.

Budgets (``budgets.Budgets``, imported from here too) are in tokens (``M_tok``, ``M_mem``,
``pack_tokens``) and tokens^p (``M_comp``). A calibration derives all but ``pack_tokens`` (a
user's cap on a pack's tokens) from one reference batch (``costmodel.BUDGET_RULES``):
equal-token equalises tokens to it, AdaptiveLoad compute. Adding a policy is one subclass of
``Policy`` (its B(S) rule, and ``micro_batches`` or ``deal`` where it forms or deals batches
its own way) and one entry in ``POLICIES``; ``plan.build_plan`` stays as it is.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from adaptiveload.costmodel import (
    CAP_TOLERANCE,
    Calibration,
    CostModel,
    SequenceParallel,
    within_cap,
)
from adaptiveload.errors import UserError
from adaptiveload.planning import baselines
from adaptiveload.planning.batches import Batches, EpochInputs, MicroBatches, bucket_cuts
from adaptiveload.planning.budgets import MAX_BUDGET, Budgets
from adaptiveload.planning.dealing import deal_balanced, rank_speeds
from adaptiveload.planning.groups import FIXED_DEGREE, make_groups, widen
from adaptiveload.planning.packing import make_packs


class MissingBudgetError(UserError):
    """A policy needs a budget that is not set; `missing` names them (m_tok, m_mem, ...)."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class Policy:
    """A batch-size rule B(S) and how an epoch's micro-batches are formed and dealt
    (``micro_batches``: by default the homogeneous bucket cuts, dealt as shuffled). Subclasses
    set `name` and `requires`."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]
    # its micro-batches mix lengths: the model runs them packed (what training's batch layout
    # and the calibration's checks read; planning asks the policy for its batches instead)
    packed: ClassVar[bool] = False
    # its micro-batches may run on sequence-parallel groups of several ranks (``groups``):
    # what the pipeline reads to draw its figure of groups (`analysis.figures.sp_groups`)
    groups: ClassVar[bool] = False
    # a method of the field written here as a baseline (docs/baselines.md): `compare` runs it,
    # an experiment only where it names it (the schema's default list leaves it out)
    peer: ClassVar[bool] = False
    # the policy whose predicted plan this one must not fall short of without a warning
    # (`plan.plan_warnings`): a generalisation measured against what it generalises
    baseline: ClassVar[str | None] = None

    def micro_batches(self, epoch: EpochInputs) -> MicroBatches:
        """Steps 1-5 of ``plan``: each bucket cut into B(S) batches (``batches.bucket_cuts``),
        shuffled, padded to whole steps and dealt (``deal``)."""
        budgets = epoch.budgets
        b_size = self.batch_size(epoch.buckets.tokens, budgets)
        batches, slots, slot_pad = bucket_cuts(epoch, b_size, self.name)
        order, dealt_on = self.deal(batches, slots, epoch)
        return MicroBatches(
            batches=batches,
            slots=slots[order],
            slot_pad=slot_pad[order],
            oversize=self.oversize(epoch.tokens, budgets),
            violations=int(self.violates(batches.size, batches.tokens, budgets).sum()),
            dealt_on=dealt_on,
        )

    def max_degree(self, cost_model: CostModel | Calibration | None, world_size: int) -> int:
        """The largest sequence-parallel degree this policy's micro-batches may have on
        `world_size` ranks: 1 (one rank each) but for the SP policies. The plan takes out
        samples over the device's capacity at this degree (`plan.over_capacity`)."""
        return 1

    def deal(
        self, batches: Batches, slots: np.ndarray, epoch: EpochInputs
    ) -> tuple[np.ndarray, str | None]:
        """Step 5: the order of `slots` that deals them (slot j: step j // N, rank j % N) and
        what it was ordered by. Open-Sora's: as shuffled."""
        return np.arange(slots.size), None

    def check(self, budgets: Budgets) -> None:
        """UserError naming the budget(s) this policy needs but `budgets` lacks."""
        missing = [k for k in self.requires if getattr(budgets, k) is None]
        if missing:
            raise MissingBudgetError(
                f"policy {self.name}: budget(s) {', '.join(missing)} not set; give them to "
                "Budgets(...) or take them from a calibration file with "
                "Budgets.resolve(calibration=Calibration.load(path))",
                missing,
            )

    def batch_size(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        """B(S) for each entry of `tokens` (int64, >= 1)."""
        raise NotImplementedError

    def oversize(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        """True where one sample alone already exceeds a budget (it then forms B = 1)."""
        raise NotImplementedError

    def violates(self, batch: np.ndarray, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        """True for batches of `batch` samples of `tokens` that break a budget (B > 1 only)."""
        return (np.asarray(batch) > 1) & self._over(np.asarray(batch), tokens, budgets)

    def _over(self, batch: np.ndarray, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        raise NotImplementedError


def _floor_within(budget: float, per_sample: np.ndarray) -> np.ndarray:
    """Largest integer b with b * per_sample within budget (`within_cap`: a batch may fill it
    exactly), exact in float (floor then fix-up)."""
    b = np.floor(budget * (1 + CAP_TOLERANCE) / per_sample)
    b -= ~within_cap(b * per_sample, budget)  # a quotient rounded up onto an integer
    # no sample is < 1 token and budgets are <= MAX_BUDGET, so this never clips real batches;
    # it keeps a huge quotient from wrapping around in the int64 cast
    return np.minimum(b, MAX_BUDGET).astype(np.int64)


class EqualToken(Policy):
    name = "equal-token"
    requires = ("m_tok",)

    def batch_size(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        return np.maximum(1, _floor_within(budgets.m_tok, s))

    def oversize(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        return ~within_cap(np.asarray(tokens, dtype=np.float64), budgets.m_tok)

    def _over(self, batch: np.ndarray, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        return ~within_cap(batch * np.asarray(tokens, dtype=np.float64), budgets.m_tok)


class AdaptiveLoad(Policy):
    name = "adaptiveload"
    requires = ("m_mem", "m_comp", "p")

    def batch_size(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        by_mem = _floor_within(budgets.m_mem, s)
        by_comp = _floor_within(budgets.m_comp, s**budgets.p)
        return np.maximum(1, np.minimum(by_mem, by_comp))

    def oversize(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        return self._over(1, tokens, budgets)

    def _over(self, batch: np.ndarray, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        return ~(within_cap(batch * s, budgets.m_mem) & within_cap(batch * s**budgets.p,
                                                                   budgets.m_comp))


class BalancedDeal:
    """A policy's batches dealt so that each step's ranks hold near-equal predicted cost:
    sort-and-chunk (``dealing.deal_balanced``) within windows of `window_steps`, on each
    slot's predicted time (``cost.step_time``), else on the proxy B * S^p. Mixed in before
    the policy whose batches it deals."""

    def deal(
        self, batches: Batches, slots: np.ndarray, epoch: EpochInputs
    ) -> tuple[np.ndarray, str | None]:
        size, tok, cost = batches.size[slots], batches.tokens[slots], epoch.cost
        if cost is not None:
            slot_cost, dealt_on = cost.step_time(size, tok), "cost_model"
        else:
            slot_cost, dealt_on = size * tok.astype(float) ** epoch.budgets.p, "B*S^p"
        speeds = rank_speeds(epoch.cost_model, epoch.world_size)
        dealt = deal_balanced(slot_cost, epoch.world_size, epoch.window_steps, epoch.rng, speeds)
        return dealt, dealt_on


class AdaptiveLoadBalanced(BalancedDeal, AdaptiveLoad):
    """The ``adaptiveload`` batches, dealt by predicted cost (``BalancedDeal``)."""

    name = "adaptiveload-balanced"


class AdaptiveLoadPacked(AdaptiveLoad):
    """Packs under M_mem (as predicted memory where a calibration knows its device), M_comp
    and `pack_tokens`, dealt by predicted cost: ``adaptiveload.planning.packing``. Its B(S)
    rule only says which samples are oversize under the homogeneous budgets."""

    name = "adaptiveload-packed"
    packed = True

    def micro_batches(self, epoch: EpochInputs) -> MicroBatches:
        """The epoch's packs (``packing.make_packs``), formed and dealt in one."""
        return self._packs(epoch)

    def _packs(
        self, epoch: EpochInputs, degree: int = 1, sp: SequenceParallel | None = None
    ) -> MicroBatches:
        """The epoch's packs, one per rank, or per group of `degree` ranks through `sp`
        (their slots then one per group: ``groups.widen`` makes them rank slots)."""
        e = epoch
        packs = make_packs(
            e.tokens, e.budgets, e.cost_model, e.world_size // degree, e.window_steps, e.rng,
            e.steps, degree, sp,
        )
        fill = zip(packs.limits.names, packs.fill.mean(axis=0), strict=True)
        return MicroBatches(
            batches=Batches(order=packs.order, start=packs.start, size=packs.size),
            slots=packs.slots,
            slot_pad=packs.slot_pad,
            oversize=packs.oversize,
            violations=int((~within_cap(packs.fill, 1.0).all(axis=1) & (packs.size > 1)).sum()),
            dealt_on="cost_model" if e.cost is not None else "sum S^p",
            summary={
                "pack_limits": packs.limits.as_dict(),
                "pack_fill_mean": {name: float(f) for name, f in fill},
            },
        )


def _sequence_parallel(cost_model: CostModel | Calibration | None) -> SequenceParallel | None:
    """What the cost of a set at a degree takes, from a Calibration that knows its device's
    capacity and its model's shape (recorded, or a registered config); None otherwise: no
    sample is then known to need more than one rank, and the SP policies plan as
    ``adaptiveload-packed`` does."""
    if not (isinstance(cost_model, Calibration) and cost_model.capacity_bytes):
        return None
    try:
        return SequenceParallel.of(cost_model)
    except UserError:  # a model of unknown shape: its heads, so its degrees, are unknown
        return None


class AdaptiveLoadSP(AdaptiveLoadPacked):
    """Packs with a sequence-parallel degree each (``groups.make_groups``): the packed
    policy where no sample needs more than one rank."""

    name = "adaptiveload-sp"
    groups = True
    baseline = "adaptiveload-sp-fixed"

    def max_degree(self, cost_model: CostModel | Calibration | None, world_size: int) -> int:
        sp = _sequence_parallel(cost_model)
        return sp.max_degree(world_size) if sp is not None else 1

    def micro_batches(self, epoch: EpochInputs) -> MicroBatches:
        degree = self.max_degree(epoch.cost_model, epoch.world_size)
        sp = _sequence_parallel(epoch.cost_model)
        formed = make_groups(epoch, sp, degree) if degree > 1 else None
        return formed if formed is not None else self._packs(epoch)


class AdaptiveLoadSPFixed(AdaptiveLoadPacked):
    """Every pack on a group of one degree, `groups.FIXED_DEGREE` capped to the largest the
    model's heads and the world size allow (4 for Wan 2.1 1.3B's 12 heads): the packed
    policy's packs on N / d groups (``groups.widen``)."""

    name = "adaptiveload-sp-fixed"
    groups = True

    def max_degree(self, cost_model: CostModel | Calibration | None, world_size: int) -> int:
        sp = _sequence_parallel(cost_model)
        return min(FIXED_DEGREE, sp.max_degree(world_size)) if sp is not None else 1

    def micro_batches(self, epoch: EpochInputs) -> MicroBatches:
        degree = self.max_degree(epoch.cost_model, epoch.world_size)
        if degree == 1:
            return self._packs(epoch)
        sp = _sequence_parallel(epoch.cost_model)
        return widen(self._packs(epoch, degree, sp), degree)


class TimeBuckets(Policy):
    """Per-bucket batch sizes equalised to a reference step time: Open-Sora's ``search_bs``
    (a batch size per bucket searched so that its step takes the reference's time) and the
    hand-written bucket-to-batch-size tables of Open-Sora and musubi-tuner. B(S) is the
    largest batch whose predicted step time (the cost model's; B S^p without one) is within
    the reference time and whose tokens are within M_mem, at least 1; batches of one bucket
    shape, dealt as shuffled. Simplified: the reference is equal-token's slowest batch of the
    epoch (its longest bucket within M_tok, at B = M_tok / S: the reference batch the
    budgets are derived from), raised where a step count is asked for until the batches fit
    it (a user's choice of reference sets the global batch), and the times are predicted,
    not measured per bucket."""

    name = "time-buckets"
    requires = ("m_tok", "m_mem", "p")
    peer = True

    def micro_batches(self, epoch: EpochInputs) -> MicroBatches:
        """The homogeneous steps of this epoch's time-equalised B(S) (``bucket_cuts``)."""
        budgets, s = epoch.budgets, epoch.buckets.tokens.astype(np.float64)
        step_time = _StepTime(s, budgets, epoch.cost)
        reference = step_time.of(EqualToken().batch_size(s, budgets))[s <= budgets.m_tok]
        reference = float(reference.max()) if reference.size else float(step_time.of(1).min())
        if epoch.steps is not None:
            reference = step_time.stretch(reference, epoch)
        b_size = step_time.batch_size(reference)
        batches, slots, slot_pad = bucket_cuts(epoch, b_size, self.name)
        over = (batches.size * batches.tokens > budgets.m_mem) | (
            _StepTime(batches.tokens.astype(np.float64), budgets, epoch.cost).of(batches.size)
            > reference * (1 + REFERENCE_SLACK)
        )
        alone = (s > budgets.m_mem) | (step_time.of(1) > reference * (1 + REFERENCE_SLACK))
        return MicroBatches(
            batches=batches, slots=slots, slot_pad=slot_pad,
            oversize=alone[epoch.buckets.of],
            violations=int(((batches.size > 1) & over).sum()),
            summary={"reference_step": reference},
        )


# a relative slack on the reference time: the reference batch itself (its time computed from
# its B) is never rounded down one sample, nor found over it
REFERENCE_SLACK = 1e-9


class _StepTime:
    """The predicted step time of batches of B samples of each of `tokens` (the cost model's
    ``step_time``, else the proxy B S^p), and the batch sizes it allows (``TimeBuckets``)."""

    def __init__(self, tokens: np.ndarray, budgets: Budgets, cost: CostModel | None) -> None:
        self.tokens, self.budgets, self.cost = tokens, budgets, cost
        self.per_sample = cost.per_sample_time(tokens) if cost else tokens**budgets.p
        self.fixed = cost.c0 if cost else 0.0

    def of(self, batch: Any) -> np.ndarray:
        """The predicted time of a batch of `batch` samples of each token count."""
        if self.cost is None:
            return np.asarray(batch) * self.per_sample
        return np.asarray(self.cost.step_time(batch, self.tokens))

    def batch_size(self, reference: float) -> np.ndarray:
        """B(S): the largest batch within `reference` seconds and M_mem tokens, at least 1."""
        within = max(reference * (1 + REFERENCE_SLACK) - self.fixed, 0.0)
        by_time = _floor_within(within, self.per_sample)
        return np.maximum(1, np.minimum(_floor_within(self.budgets.m_mem, self.tokens), by_time))

    def stretch(self, reference: float, epoch: EpochInputs) -> float:
        """The least reference time (from `reference` up) whose batches fill at most the
        epoch's steps asked for; the memory-bound batches' time where none does (the cuts
        then refuse the step count)."""
        count = np.bincount(epoch.buckets.of, minlength=self.tokens.size)

        def steps(ref: float) -> int:
            return -(-int((-(-count // self.batch_size(ref))).sum()) // epoch.world_size)

        low = reference
        high = max(low, float(self.of(_floor_within(self.budgets.m_mem, self.tokens)).max()))
        if steps(low) <= epoch.steps or steps(high) > epoch.steps:
            return low if steps(low) <= epoch.steps else high
        for _ in range(60):  # bisection: steps(ref) falls as ref grows
            mid = 0.5 * (low + high)
            low, high = (low, mid) if steps(mid) <= epoch.steps else (mid, high)
        return high


class PeerPacks(Policy):
    """The field's packing methods (``planning.baselines``): packs held to the memory limit of
    ``adaptiveload-packed`` (bytes where the calibration knows the device, else M_mem tokens;
    pack_tokens when set), not to M_comp."""

    requires = ("m_mem",)
    packed = True
    peer = True


class TokenFFD(PeerPacks):
    """Token-count packing as NVIDIA NeMo DFM trains Wan 2.1 on Megatron-Energon:
    first-fit-decreasing of samples into packs up to a sequence length, the packs shuffled
    and dealt to ranks without regard to cost (``baselines.ffd_packs``). Simplified: the
    sequence length is the memory limit, not a user's fixed number."""

    name = "token-ffd"

    def micro_batches(self, epoch: EpochInputs) -> MicroBatches:
        return baselines.ffd_packs(epoch)


class StepBalanced(PeerPacks):
    """Each step's global batch split over the ranks by `partition`
    (``baselines.step_partitions``). Simplified as both methods it serves: one micro-batch
    per rank per step (a step over the memory limit runs as two), global batches of equal
    sample counts, as many as the memory volume needs."""

    partition: ClassVar[baselines.Partition]

    def micro_batches(self, epoch: EpochInputs) -> MicroBatches:
        return baselines.step_partitions(epoch, self.partition, self.name)


class TokenKK(StepBalanced):
    """verl's sequence-length balancing (``get_seqlen_balanced_partitions``): Karmarkar-Karp
    on token counts over the data-parallel ranks, a rank's load being its tokens. Simplified:
    parts need not hold equal sample counts (verl's ``equal_size``)."""

    name = "token-kk"
    partition = staticmethod(baselines.kk_partition)


class FlopGreedy(StepBalanced):
    """KnapFormer's workload balancing: samples sorted by an estimated FLOP workload, each to
    the least-loaded bag of the fixed ranks that has room. Simplified: one bag per rank (no
    sequence-parallel bags), FLOPs from the model's shape (``baselines.flop_workload``)."""

    name = "flop-greedy"
    partition = staticmethod(baselines.greedy_partition)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        EqualToken, AdaptiveLoad, AdaptiveLoadBalanced, AdaptiveLoadPacked, AdaptiveLoadSP,
        AdaptiveLoadSPFixed, TokenFFD, TokenKK, FlopGreedy, TimeBuckets,
    )
}


def get_policy(name: str | Policy) -> Policy:
    """The policy object for `name`; UserError listing the known names otherwise."""
    if isinstance(name, Policy):
        return name
    try:
        return POLICIES[name]()
    except KeyError:
        raise UserError(
            f"policy {name!r}: unknown; expected one of {', '.join(POLICIES)}"
        ) from None


def batch_size(policy: str | Policy, tokens: Any, budgets: Budgets) -> np.ndarray:
    """B(S) of `policy` for an array of token counts (validates the budgets it needs)."""
    pol = get_policy(policy)
    pol.check(budgets)
    return pol.batch_size(np.asarray(tokens), budgets)
