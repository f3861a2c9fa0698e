"""A calibration file (`Calibration`: the cost model, the budgets derived from it, its
provenance), the shipped ones, and the budgets file `adaptiveload budgets` writes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from adaptiveload.costmodel.budgets import DEFAULT_HEADROOM, BudgetDerivation, derive_budgets
from adaptiveload.costmodel.comm import CommModel, GroupBound, SequenceParallel
from adaptiveload.costmodel.cost import CostModel, _finite_number
from adaptiveload.errors import UserError
from adaptiveload.io import read_json


@dataclass
class Calibration:
    """A calibration file: the cost model, the budgets derived from it, and its provenance.

    `source` is "measured" (timed on `device`) or "model" (derived analytically); every number
    built from it inherits that label. `m_tok` is the equal-token baseline's budget derived with
    the others (BUDGET_RULES); files written before it existed lack it, and planning then gives
    the baseline M_mem (`planning.policies.Budgets.resolve`).
    """

    model: str
    device: str
    source: str
    cost: CostModel
    p: float
    m_mem: float
    m_comp: float
    m_tok: float | None = None  # equal-token budget; None in files older than the rule
    capacity_bytes: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def usable_bytes(self) -> float | None:
        """capacity x (1 - headroom): the memory every budget of this file is derived to stay
        under (BUDGET_RULES["m_mem"]); None without a capacity. Files without a headroom field
        were derived with the default."""
        if not self.capacity_bytes:
            return None
        headroom = float(self.extra.get("headroom", DEFAULT_HEADROOM))
        return float(self.capacity_bytes) * (1 - headroom)

    @property
    def label(self) -> str:
        """'measured (DEVICE)' or 'model (DEVICE)': how numbers derived from this are tagged."""
        return f"{self.source} ({self.device})"

    @property
    def measured_memory_tokens(self) -> int | None:
        """The most tokens of one micro-batch whose peak memory this file measured: B x S of
        its grid points (`points`, `memory_points`) and Σ S of its timed packs
        (`additivity.packs`) that ran with a measured `peak_bytes`. Beyond it the memory
        model is the fit's extrapolation. None when no memory was measured (`memory_source`
        other than "measured": an analytic or CPU calibration, whose memory is the model
        throughout)."""
        if self.extra.get("memory_source") != "measured":
            return None
        points = [*(self.extra.get("points") or []), *(self.extra.get("memory_points") or [])]
        sizes = [
            int(p["batch"]) * int(p["tokens"])
            for p in points
            if p.get("peak_bytes") and p.get("status", "ok") == "ok"
        ]
        sizes += [
            int(p["sum_tokens"])
            for p in (self.extra.get("additivity") or {}).get("packs") or []
            if p.get("peak_bytes") and p.get("status") == "ok"
        ]
        return max(sizes) if sizes else None

    @property
    def comm(self) -> CommModel | None:
        """The file's ``comm`` section (`CommModel`), None where it has none (then the cost of
        a set at a degree takes `CommModel.prior`)."""
        section = self.extra.get("comm")
        origin = f"calibration of {self.model}"
        return None if section is None else CommModel.from_dict(section, origin)

    @property
    def rank_speeds(self) -> tuple[float, ...] | None:
        """Per-rank speed factors a refit measured (`costmodel.refit`): rank r runs a
        micro-batch in its predicted time / factor, so < 1 is a slower rank; the median rank
        is 1. None where the file has none (every rank alike)."""
        speeds = self.extra.get("rank_speeds")
        return None if speeds is None else tuple(float(v) for v in speeds)

    @property
    def headroom(self) -> float:
        """The fraction of the capacity its budgets left free."""
        return float(self.extra.get("headroom", DEFAULT_HEADROOM))

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("cost", "extra")}
        out["cost"] = asdict(self.cost)
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "<dict>") -> Calibration:
        if not isinstance(data, dict):
            raise UserError(
                f"{origin}: a calibration is a JSON object; write it with `adaptiveload calibrate`"
            )
        required = ("model", "device", "source", "cost", "p", "m_mem", "m_comp")
        missing = [k for k in required if k not in data]
        if missing:
            raise UserError(
                f"{origin}: calibration is missing field(s) {', '.join(missing)}; "
                "regenerate it with `adaptiveload calibrate`"
            )
        if data["source"] not in ("measured", "model"):
            raise UserError(f"{origin}: field 'source' must be 'measured' or 'model'")
        for name in ("p", "m_mem", "m_comp"):
            if not _finite_number(data[name]):
                raise UserError(f"{origin}: field '{name}' must be a finite number")
        fix = "regenerate it with `adaptiveload calibrate`"
        if data["p"] < 1:
            raise UserError(f"{origin}: field 'p' is {data['p']}; must be >= 1 (a sample's "
                            f"compute grows at least with its tokens); {fix}")
        for name in ("m_mem", "m_comp", "capacity_bytes"):
            if data.get(name) is not None and not (_finite_number(data[name]) and data[name] > 0):
                raise UserError(f"{origin}: field '{name}' is {data[name]}; must be a positive "
                                f"number; {fix}")
        cost_fields = data["cost"] if isinstance(data["cost"], dict) else {}
        try:
            cost = CostModel(**cost_fields)
        except TypeError as exc:
            raise UserError(f"{origin}: field 'cost' is malformed ({exc})") from None
        bad = [k for k, v in cost_fields.items() if not _finite_number(v)]
        if bad:
            raise UserError(f"{origin}: field 'cost.{bad[0]}' must be a finite number")
        # every term is a time or memory the fit keeps non-negative: a negative one predicts
        # negative memory or a sample that speeds the step up, and plans on it are wrong
        negative = [k for k, v in cost_fields.items() if v < 0]
        if negative:
            raise UserError(f"{origin}: field 'cost.{negative[0]}' is {cost_fields[negative[0]]}; "
                            f"must be >= 0 (seconds or bytes); {fix}")
        if not cost.step_time(1, 1) > 0:
            raise UserError(f"{origin}: field 'cost' predicts no time for any micro-batch "
                            f"(c0, a, b, c_seq and t_floor all 0); {fix}")
        m_tok = data.get("m_tok")
        if m_tok is not None and not (isinstance(m_tok, (int, float)) and m_tok > 0):
            raise UserError(f"{origin}: field 'm_tok' must be a positive number (or absent)")
        known = set(required) | {"capacity_bytes", "m_tok"}
        if data.get("comm") is not None:
            CommModel.from_dict(data["comm"], origin)  # a bad section fails on load, named
        return cls(
            model=data["model"],
            device=data["device"],
            source=data["source"],
            cost=cost,
            p=float(data["p"]),
            m_mem=float(data["m_mem"]),
            m_comp=float(data["m_comp"]),
            m_tok=None if m_tok is None else float(m_tok),
            capacity_bytes=data.get("capacity_bytes"),
            extra={k: v for k, v in data.items() if k not in known},
        )

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        """A calibration file, or a shipped calibration by name (`shipped_calibrations`: the
        H200 files, package data, so an installed package has them without a checkout)."""
        shipped = shipped_calibrations()
        if not Path(path).exists() and str(path) in shipped:
            path = shipped[str(path)]
        elif not Path(path).exists():
            raise UserError(
                f"{path}: calibration file not found; write one with `adaptiveload calibrate` "
                f"or name a shipped one: {', '.join(shipped)}"
            )
        return cls.from_dict(read_json(path, "calibration file"), origin=str(path))

    def for_tokens(
        self, tokens: Any, capacity_bytes: float | None = None, headroom: float | None = None
    ) -> Calibration:
        """This cost model with its budgets derived for another token mix (`derive_budgets`:
        p over these tokens' range, the reference batch among them), at `capacity_bytes`
        (None: the file's) and `headroom` (None: the file's). The what-if of a user's own
        data: a calibration keeps the p and budgets of the mix it was made for."""
        capacity = self.capacity_bytes if capacity_bytes is None else capacity_bytes
        if not capacity:
            raise UserError(
                f"calibration of {self.model} ({self.label}) records no capacity_bytes; "
                "give the device's memory (--capacity-gb)"
            )
        if headroom is None:
            headroom = self.headroom
        derived = derive_budgets(self.cost, tokens, float(capacity), headroom)
        extra = {**self.extra, "budgets": derived.to_dict(), "headroom": headroom}
        return replace(
            self, p=derived.p, m_mem=derived.m_mem, m_comp=derived.m_comp, m_tok=derived.m_tok,
            capacity_bytes=float(capacity), extra=extra,
        )

    def require_model(self, model: str, origin: str | Path) -> None:
        """UserError unless this calibration was made for `model`: the same name and, where
        the file records it (`model_config`), the same shape. Budgets of another model
        would silently plan wrong batch sizes."""
        fix = f"calibrate {model} (`adaptiveload calibrate`) or pass its calibration file"
        if self.model != model:
            raise UserError(
                f"{origin}: calibration is for model {self.model!r}, not {model!r}; {fix}"
            )
        recorded = self.extra.get("model_config")
        if not isinstance(recorded, dict):
            return
        from adaptiveload.model.architectures import get_config

        expected = json.loads(json.dumps(get_config(model).to_dict()))
        differ = [k for k, v in expected.items() if k != "name" and recorded.get(k) != v]
        if differ:
            k = differ[0]
            raise UserError(
                f"{origin}: calibration of {model!r} has another shape ({k} {recorded.get(k)!r} "
                f"in the file, {expected[k]!r} in the model); {fix}"
            )

    def m_comp_at(self, p: float | None = None, scale: float = 1.0) -> float:
        """M_comp at exponent `p` (None: the calibration's own), times `scale`.

        M_comp is B_ref * S_ref^p of the reference batch the budgets were derived from
        (BUDGET_RULES["m_comp"]), a budget in tokens^p: at another p the reference batch keeps
        its batch size and M_comp follows p, M_mem and M_tok stay. `scale` multiplies the
        result (the M_comp sweep). Needs the reference batch the file records (`budgets`) when
        p is not the calibration's own.
        """
        if p is None or p == self.p:
            return scale * self.m_comp
        ref = self.extra.get("budgets")
        ref = ref if isinstance(ref, dict) else {}
        s_ref, b_ref = ref.get("ref_tokens"), ref.get("ref_batch")
        if not (_finite_number(s_ref) and _finite_number(b_ref) and s_ref >= 1 and b_ref >= 1):
            raise UserError(
                f"calibration of {self.model} ({self.label}) records no reference batch "
                f"(fields budgets.ref_tokens, budgets.ref_batch), so M_comp cannot follow p={p}; "
                "regenerate it with `adaptiveload calibrate` or give M_comp explicitly"
            )
        return scale * (b_ref * s_ref**p)


def group_bound(cost_model: CostModel | Calibration | None, max_degree: int) -> GroupBound | None:
    """The epoch bound's terms where samples may run in sequence-parallel groups up to
    `max_degree` (a plan summary's ``sp_max_degree``): None at degree 1 or without a
    Calibration (one rank each, `CostModel.epoch_lower_bound`'s own terms)."""
    if max_degree <= 1 or not isinstance(cost_model, Calibration):
        return None
    return SequenceParallel.of(cost_model).bound(max_degree)


def shipped_calibrations() -> dict[str, Path]:
    """The calibrations that come with the package (package data), by name: the analytic H200
    priors of Wan 2.1 1.3B and 14B, and the 1.3B measured on an H200 (docs/calibration.md).
    `Calibration.load` takes these names wherever it takes a path."""
    folder = Path(__file__).parent.parent / "calibration" / "shipped"
    return {p.stem: p for p in sorted(folder.glob("*.json"))}



# The budgets file: what `adaptiveload budgets ... > budgets.json` writes (`budgets_record`)
# and `plan --budgets` / `compare --budgets` read back (`read_budgets`); one home for both.
# The fields a reader needs (the record has more: the calibration's label, the token mix):
BUDGETS_FILE_FIELDS = ("calibration", "p", "m_mem", "m_comp", "m_tok", "capacity_gb", "headroom")


def budgets_record(
    calibration: str | Path,
    cal: Calibration,
    mix: dict[str, Any],
    capacity_bytes: float,
    headroom: float,
    derived: BudgetDerivation,
) -> dict[str, Any]:
    """The budgets file's content: the budgets `derived` from calibration `cal` (loaded from
    `calibration`, a path or a shipped name) for a token `mix` (``TokenMix.to_dict()``) at
    that capacity and headroom."""
    return {
        "calibration": str(calibration),
        "label": cal.label,
        "model": cal.model,
        "manifest": mix,
        "capacity_gb": capacity_bytes / 1e9,
        "headroom": headroom,
        **derived.to_dict(),
    }


def read_budgets(path: Path, cal: Calibration | None) -> Calibration:
    """The calibration a budgets file was derived from (`cal`, else the one the file names),
    carrying the file's p, budgets, reference batch and capacity: so a plan uses the p
    `budgets` derived for the user's data, and predicts at that capacity."""
    data = read_json(path, "budgets file")
    missing = [k for k in BUDGETS_FILE_FIELDS if not isinstance(data, dict) or k not in data]
    if missing:
        raise UserError(
            f"{path}: field(s) {', '.join(missing)} missing; write it with `adaptiveload "
            "budgets --calibration CAL --manifest M > budgets.json`"
        )
    if cal is None:
        named = data["calibration"]
        if not (Path(named).exists() or named in shipped_calibrations()):
            raise UserError(
                f"{path}: its calibration {named!r} is not found from here; "
                "give it with --calibration"
            )
        cal = Calibration.load(named)
    elif data.get("model", cal.model) != cal.model:
        raise UserError(
            f"{path}: budgets derived for model {data['model']!r}, the calibration is of "
            f"{cal.model!r}; derive them with this calibration (`adaptiveload budgets`)"
        )
    derivation = {k: data[k] for k in ("ref_tokens", "ref_batch", "s_lo", "s_hi") if k in data}
    return replace(
        cal,
        p=float(data["p"]),
        m_mem=float(data["m_mem"]),
        m_comp=float(data["m_comp"]),
        m_tok=float(data["m_tok"]),
        capacity_bytes=float(data["capacity_gb"]) * 1e9,
        extra={**cal.extra, "budgets": derivation, "headroom": data["headroom"]},
    )
