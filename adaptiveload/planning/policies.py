"""Batch-size policies: how many samples of S tokens one micro-batch holds, and how batches
are dealt to ranks.

- ``equal-token`` (the Open-Sora / VideoX-Fun baseline): ``B(S) = max(1, floor(M_tok / S))``.
- ``adaptiveload`` (the paper): ``B(S) = max(1, min(floor(M_mem / S), floor(M_comp / S^p)))``.
- ``adaptiveload-balanced`` (beyond the paper): the ``adaptiveload`` batches, dealt so that the
  ranks of one step hold near-equal predicted cost (see ``adaptiveload.planning.dealing``).
- ``adaptiveload-packed`` (beyond the paper): micro-batches of samples of any lengths (packs),
  formed under the memory and compute budgets so that every rank of a step holds near-equal
  predicted cost (see ``adaptiveload.planning.packing``); it needs a model that runs packed
  micro-batches.

Budgets are in tokens (``M_tok``, ``M_mem``, ``pack_tokens``) and tokens^p (``M_comp``). A
calibration derives all but ``pack_tokens`` (a user's cap on a pack's tokens) from one
reference batch (``costmodel.BUDGET_RULES``): equal-token equalises tokens to it, AdaptiveLoad
compute. Adding a policy is one subclass of ``Policy`` and one entry in
``POLICIES``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numpy as np

from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError

AUTO = "auto"
P_RANGE = (1.0, 3.0)
# a sanity bound on M_tok, M_mem, M_comp (the schema's budget maximum is the same): far above
# any real budget (a 14B model's M_comp at p = 3 is ~1e14), far below where B = M / S^p
# overflows an int64 batch size
MAX_BUDGET = 1e18


@dataclass(frozen=True)
class Budgets:
    """The per-micro-batch budgets a policy reads. Unused ones may be None."""

    m_tok: float | None = None
    m_mem: float | None = None
    m_comp: float | None = None
    p: float | None = None
    # the packed policy's cap on tokens per pack (None: packs fill toward the memory budget);
    # a user holds it lower to keep the global batch an optimizer recipe was tuned for
    pack_tokens: float | None = None

    def __post_init__(self) -> None:
        for name in ("p", "m_mem", "m_comp", "m_tok", "pack_tokens"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float, np.number))
            ):
                example = 1.2 if name == "p" else 6144
                raise UserError(
                    f"budget {name}={value!r}: must be a number, not {type(value).__name__} "
                    f"(e.g. Budgets({name}={example}))"
                )
        _check_exponent(self.p)
        # m_tok may be m_mem's value: name m_mem
        for name in ("m_mem", "m_comp", "m_tok", "pack_tokens"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and 0 < value <= MAX_BUDGET):
                raise UserError(
                    f"budget {name}={value}: must be a positive number up to {MAX_BUDGET:g}"
                )

    def as_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @classmethod
    def resolve(
        cls,
        m_tok: float | str | None = AUTO,
        m_mem: float | str | None = AUTO,
        m_comp: float | str | None = AUTO,
        p: float | str | None = AUTO,
        calibration: Calibration | None = None,
        m_comp_scale: float = 1.0,
        pack_tokens: float | str | None = None,
    ) -> Budgets:
        """Budgets from explicit numbers, with ``"auto"``/None taken from `calibration`.

        All four come from the calibration file, ``m_tok`` being the equal-token budget it
        derived from the same reference batch as ``m_comp``. Where there is none (calibration
        files older than that rule, or no calibration but an explicit ``m_mem``), ``m_tok``
        falls back to the resolved ``m_mem``: the baseline then gets AdaptiveLoad's memory
        budget. An ``"auto"`` ``m_comp`` is the calibration's at the resolved ``p``, times
        `m_comp_scale` (``Calibration.m_comp_at``: an explicit ``p`` keeps the reference
        batch, as the p sweep does). Without a calibration, other ``"auto"`` values stay unset
        and the policy reports which one it needs. `pack_tokens` is never derived: None (or
        ``"auto"``) leaves packs uncapped in tokens.
        """

        def pick(name: str, value: Any, from_calibration: float | None) -> float | None:
            if value is None or value == AUTO:
                return from_calibration
            try:
                return float(value)
            except (TypeError, ValueError):
                raise UserError(f"budget {name}={value!r}: expected a number or 'auto'") from None

        cal = calibration
        mem = pick("m_mem", m_mem, cal.m_mem if cal else None)
        tok = cal.m_tok if cal and cal.m_tok is not None else mem
        exponent = pick("p", p, cal.p if cal else None)
        comp_auto = m_comp is None or m_comp == AUTO
        if m_comp_scale != 1.0 and not (cal and comp_auto):
            raise UserError(
                f"m_comp_scale={m_comp_scale} scales the calibration's M_comp: it needs a "
                "calibration and m_comp 'auto'"
            )
        if cal and comp_auto:
            _check_exponent(exponent)
            comp = cal.m_comp_at(exponent, m_comp_scale)
        else:
            comp = pick("m_comp", m_comp, None)
        return cls(
            m_tok=pick("m_tok", m_tok, tok), m_mem=mem, m_comp=comp, p=exponent,
            pack_tokens=pick("pack_tokens", pack_tokens, None),
        )  # fmt: skip


def _check_exponent(p: float | None) -> None:
    if p is not None and not (P_RANGE[0] <= p <= P_RANGE[1]):
        raise UserError(f"budget p={p}: must lie in [{P_RANGE[0]:g}, {P_RANGE[1]:g}]")


class MissingBudgetError(UserError):
    """A policy needs a budget that is not set; `missing` names them (m_tok, m_mem, ...)."""

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class Policy:
    """A batch-size rule plus a dealing mode. Subclasses set `name`, `requires`, `balanced`
    and `packed`."""

    name: ClassVar[str]
    requires: ClassVar[tuple[str, ...]]
    balanced: ClassVar[bool] = False  # deal batches by predicted cost (dealing.deal_balanced)
    # micro-batches mix lengths (planning.packing); the B(S) rule then only says which samples
    # are oversize under the homogeneous budgets
    packed: ClassVar[bool] = False

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
    """Largest integer b with b * per_sample <= budget, exact in float (floor then fix-up)."""
    b = np.floor(budget / per_sample)
    b -= b * per_sample > budget  # a quotient rounded up onto an integer
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
        return np.asarray(tokens, dtype=np.float64) > budgets.m_tok

    def _over(self, batch: np.ndarray, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        return batch * np.asarray(tokens, dtype=np.float64) > budgets.m_tok


class AdaptiveLoad(Policy):
    name = "adaptiveload"
    requires = ("m_mem", "m_comp", "p")

    def batch_size(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        by_mem = _floor_within(budgets.m_mem, s)
        by_comp = _floor_within(budgets.m_comp, s**budgets.p)
        return np.maximum(1, np.minimum(by_mem, by_comp))

    def oversize(self, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        return (s > budgets.m_mem) | (s**budgets.p > budgets.m_comp)

    def _over(self, batch: np.ndarray, tokens: np.ndarray, budgets: Budgets) -> np.ndarray:
        s = np.asarray(tokens, dtype=np.float64)
        return (batch * s > budgets.m_mem) | (batch * s**budgets.p > budgets.m_comp)


class AdaptiveLoadBalanced(AdaptiveLoad):
    name = "adaptiveload-balanced"
    balanced = True


class AdaptiveLoadPacked(AdaptiveLoad):
    """Packs under M_mem (as predicted memory where a calibration knows its device), M_comp
    and `pack_tokens`, dealt by predicted cost: ``adaptiveload.planning.packing``."""

    name = "adaptiveload-packed"
    packed = True


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (EqualToken, AdaptiveLoad, AdaptiveLoadBalanced, AdaptiveLoadPacked)
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
