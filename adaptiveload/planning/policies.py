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
from adaptiveload.planning.batches import Batches, EpochInputs, MicroBatches, bucket_cuts
from adaptiveload.planning.budgets import MAX_BUDGET, Budgets
from adaptiveload.planning.dealing import deal_balanced
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
        return deal_balanced(slot_cost, epoch.world_size, epoch.window_steps, epoch.rng), dealt_on


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


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        EqualToken, AdaptiveLoad, AdaptiveLoadBalanced, AdaptiveLoadPacked, AdaptiveLoadSP,
        AdaptiveLoadSPFixed,
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
