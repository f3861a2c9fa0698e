"""How long a micro-batch takes and how much memory it needs: one interface for the planner,
the simulator and the analysis.

The fitted form (per rank, one micro-batch of B samples of S tokens each, forward+backward):

    t(B, S) = c0 + B * (a*S + b*S^2)            seconds
    m(B, S) = m_static + B * (m_tok*S + m_seq)  bytes

`a` carries the linear layers (GEMMs grow with tokens), `b` self-attention (quadratic in S),
`c0` the per-step fixed cost (launches, optimizer-free overheads), `m_seq` the per-sample
constant (text context, modulation vectors).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from adaptiveload.errors import UserError


@dataclass(frozen=True)
class CostModel:
    """Fitted step-time and memory model of one model config on one device."""

    c0: float
    a: float
    b: float
    m_static: float = 0.0
    m_tok: float = 0.0
    m_seq: float = 0.0

    def step_time(self, batch: Any, tokens: Any) -> Any:
        """Predicted forward+backward seconds of micro-batches; broadcasts over arrays."""
        s = np.asarray(tokens, dtype=np.float64)
        return self.c0 + np.asarray(batch, dtype=np.float64) * (self.a * s + self.b * s * s)

    def memory(self, batch: Any, tokens: Any) -> Any:
        """Predicted peak bytes of micro-batches; broadcasts over arrays."""
        s = np.asarray(tokens, dtype=np.float64)
        return self.m_static + np.asarray(batch, dtype=np.float64) * (self.m_tok * s + self.m_seq)

    def effective_exponent(self, s_lo: float, s_hi: float) -> float:
        """p such that per-sample cost a*S + b*S^2 grows like S^p between s_lo and s_hi."""
        if not 0 < s_lo < s_hi:
            raise ValueError("need 0 < s_lo < s_hi")
        lo = self.a * s_lo + self.b * s_lo**2
        hi = self.a * s_hi + self.b * s_hi**2
        return float(np.log(hi / lo) / np.log(s_hi / s_lo))


@dataclass
class Calibration:
    """A calibration file: the cost model, the budgets derived from it, and its provenance.

    `source` is "measured" (timed on `device`) or "model" (derived analytically); every number
    built from it inherits that label.
    """

    model: str
    device: str
    source: str
    cost: CostModel
    p: float
    m_mem: float
    m_comp: float
    capacity_bytes: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """'measured (DEVICE)' or 'model (DEVICE)': how numbers derived from this are tagged."""
        return f"{self.source} ({self.device})"

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("cost", "extra")}
        out["cost"] = asdict(self.cost)
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "<dict>") -> Calibration:
        required = ("model", "device", "source", "cost", "p", "m_mem", "m_comp")
        missing = [k for k in required if k not in data]
        if missing:
            raise UserError(
                f"{origin}: calibration is missing field(s) {', '.join(missing)}; "
                "regenerate it with `adaptiveload calibrate`"
            )
        if data["source"] not in ("measured", "model"):
            raise UserError(f"{origin}: field 'source' must be 'measured' or 'model'")
        try:
            cost = CostModel(**data["cost"])
        except TypeError as exc:
            raise UserError(f"{origin}: field 'cost' is malformed ({exc})") from None
        known = set(required) | {"capacity_bytes"}
        return cls(
            model=data["model"],
            device=data["device"],
            source=data["source"],
            cost=cost,
            p=float(data["p"]),
            m_mem=float(data["m_mem"]),
            m_comp=float(data["m_comp"]),
            capacity_bytes=data.get("capacity_bytes"),
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"{path}: calibration file not found") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON ({exc})") from None
        return cls.from_dict(data, origin=str(path))
