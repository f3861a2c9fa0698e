"""The per-micro-batch budgets every policy reads (``Budgets``), and how they are resolved
from explicit numbers or a calibration (``Budgets.resolve``).

Budgets are in tokens (``M_tok``, ``M_mem``, ``pack_tokens``) and tokens^p (``M_comp``). A
calibration derives all but ``pack_tokens`` (a user's cap on a pack's tokens) from one
reference batch (``costmodel.BUDGET_RULES``). They sit below the policies (``policies``) and
the ways of forming micro-batches (``batches``, ``packing``), which all read them; users
import ``Budgets`` from ``adaptiveload.planning.policies``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

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
        )


def _check_exponent(p: float | None) -> None:
    if p is not None and not (P_RANGE[0] <= p <= P_RANGE[1]):
        raise UserError(f"budget p={p}: must lie in [{P_RANGE[0]:g}, {P_RANGE[1]:g}]")
