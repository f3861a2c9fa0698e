"""Fitting step times to the cost model's form (`costmodel.CostModel`): non-negative least
squares on relative error (`fit`, the analytic priors), and for measured points the floored
form with leave-one-out and degeneracy checks that say which points to add (`fit_measured`).
docs/calibration.md describes the forms and the checks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from adaptiveload.costmodel import TIME_TERMS, CostModel, features, memory_features
from adaptiveload.errors import UserError
from adaptiveload.model import analytic
from adaptiveload.model.architectures import WanConfig


@dataclass(frozen=True)
class FitStats:
    """How well the fitted form explains the points it was fitted to."""

    r2: float  # coefficient of determination of the times
    max_rel_err: float  # worst |predicted - measured| / measured over the points
    num_points: int
    mem_r2: float | None = None
    mem_max_rel_err: float | None = None
    form: str | None = None  # fit_measured: which FORMS entry was kept
    loo_median: float | None = None  # leave-one-out |pred - meas| / meas over the points
    loo_max: float | None = None
    loo_rel_err: list[float] | None = None  # per point, in the order of the points
    checks: list[dict[str, Any]] | None = None  # every form tried and what it failed

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _nnls_relative(columns: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the *relative* squared error.

    Points span orders of magnitude (16 to 16k tokens): an unweighted fit would ignore the
    small ones, yet the planner needs every bucket's cost right in ratio, so each row is
    divided by its target. Columns are rescaled to unit norm for conditioning.
    """
    from scipy.optimize import nnls

    weighted = columns / target[:, None]
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    coef, _ = nnls(weighted / norms, np.ones_like(target))
    return coef / norms


def _r2_and_worst(pred: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    ss_res = float(np.sum((pred - target) ** 2))
    ss_tot = float(np.sum((target - target.mean()) ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0)
    return r2, float(np.max(np.abs(pred - target) / target))


def fit(
    batch: Any, tokens: Any, times: Any, mem: Any | None = None, per_sample: bool = True
) -> tuple[CostModel, FitStats]:
    """Fit t(B,S) = c0 + B(c_seq + aS + bS^2) (and m(B,S) if `mem` is given) by non-negative
    least squares on relative error. Needs >= 3 points with >= 2 distinct S; times > 0.

    With `per_sample=False` c_seq is pinned to 0 (the three-term form), which small grids and
    models whose text is negligible (the tiny CPU configs) are better fitted with.
    """
    B = np.asarray(batch, dtype=np.float64).ravel()
    S = np.asarray(tokens, dtype=np.float64).ravel()
    t = np.asarray(times, dtype=np.float64).ravel()
    if not (B.size == S.size == t.size):
        raise ValueError("batch, tokens and times must have the same length")
    if B.size < 3 or np.unique(S).size < 2:
        raise ValueError("need at least 3 points with at least 2 distinct token counts")
    if np.any(t <= 0) or np.any(B < 1) or np.any(S < 1):
        raise ValueError("times must be positive, batch sizes and token counts >= 1")
    names = TIME_TERMS if per_sample else tuple(k for k in TIME_TERMS if k != "c_seq")
    columns = features(B, B * S, B * S * S)[:, [TIME_TERMS.index(k) for k in names]]
    fitted = dict(zip(names, _nnls_relative(columns, t), strict=True))
    coef = dict.fromkeys(TIME_TERMS, 0.0) | fitted
    c0, c_seq, a, b = (coef[k] for k in TIME_TERMS)
    r2, worst = _r2_and_worst(c0 + B * (c_seq + a * S + b * S * S), t)
    mem_fit, mem_r2, mem_worst = fit_memory(B, S, mem)
    cost = CostModel(c0=float(c0), a=float(a), b=float(b), c_seq=float(c_seq), **mem_fit)
    return cost, FitStats(r2, worst, int(B.size), mem_r2, mem_worst)


def fit_memory(
    B: np.ndarray, S: np.ndarray, mem: Any | None
) -> tuple[dict[str, float], float | None, float | None]:
    """m(B,S) = m_static + B(m_tok*S + m_seq) by relative NNLS (zeros without `mem`)."""
    if mem is None:
        return {"m_static": 0.0, "m_tok": 0.0, "m_seq": 0.0}, None, None
    m = np.asarray(mem, dtype=np.float64).ravel()
    if m.size != B.size or np.any(m <= 0):
        raise ValueError("mem must have one positive value per point")
    m_static, m_tok, m_seq = _nnls_relative(memory_features(B, B * S), m)
    r2, worst = _r2_and_worst(m_static + B * (m_tok * S + m_seq), m)
    return {"m_static": float(m_static), "m_tok": float(m_tok), "m_seq": float(m_seq)}, r2, worst


# --- measured fits: the floored form, leave-one-out, degeneracy checks ----------------------

# The forms fit_measured tries, preferred first; each is non-negative in every coefficient.
FORMS = {
    "floored": ("t_floor", "c0", "a", "b"),  # max(t_floor, c0 + B(aS + bS^2))
    "three-term": ("c0", "a", "b"),  # c0 + B(aS + bS^2): no floor, linear in its coefficients
}
# a term whose share of the per-sample cost stays below this over the grid is "pinned at 0"
PINNED_SHARE = 0.01
# refuse a fit that mispredicts a left-out point by more than this, per device type: a GPU's
# points repeat within ~1% (measured H200 leave-one-out max 6%); a shared CPU's fast points
# (the tiny models' ~10 ms steps) vary by 10-15% between passes even in CPU time
DEFAULT_MAX_LOO = {"cuda": 0.25, "cpu": 0.5}


def _fit_form(form: str, B: np.ndarray, S: np.ndarray, t: np.ndarray) -> CostModel:
    """Least relative error coefficients (all >= 0) of one of FORMS.

    The three-term form is linear in its coefficients: exact NNLS. The floored form is not
    (the max): least squares on log(pred/meas) from two starts, the three-term fit under a
    floor at the fastest point and the same fit of only the points clearly above it; the
    better end point wins. Deterministic for given points.
    """
    from scipy.optimize import least_squares

    three = features(B, B * S, B * S * S)[:, [TIME_TERMS.index(k) for k in FORMS["three-term"]]]
    c0, a, b = _nnls_relative(three, t)
    if form == "three-term":
        return CostModel(c0=float(c0), a=float(a), b=float(b))
    starts = [np.array([0.9 * t.min(), c0, a, b])]
    above = t > 1.5 * t.min()
    if above.sum() >= 3 and np.unique(S[above]).size >= 2:
        c0_up, a_up, b_up = _nnls_relative(three[above], t[above])
        starts.append(np.array([t.min(), c0_up, a_up, b_up]))
    scale = np.array([t.min(), t.min(), t.max() / (B * S).max(), t.max() / (B * S * S).max()])

    def residual(x: np.ndarray) -> np.ndarray:
        floor, c0_, a_, b_ = x * scale
        return np.log(np.maximum(floor, c0_ + B * (a_ * S + b_ * S * S)) / t)

    best = None
    for x0 in starts:
        x0 = np.maximum(x0 / scale, 1e-12)  # least_squares wants a start inside the bounds
        res = least_squares(residual, x0, bounds=(0.0, np.inf), method="trf", xtol=1e-12)
        if best is None or res.cost < best.cost:
            best = res
    floor, c0, a, b = (float(v) for v in best.x * scale)
    return CostModel(c0=c0, a=a, b=b, t_floor=floor)


def leave_one_out(form: str, batch: Any, tokens: Any, times: Any) -> np.ndarray:
    """|predicted - measured| / measured of each point, predicted by `form` fitted without it.

    A fit that only explains the points it has seen (a collapsed or over-flexible form) shows
    up here: the left-out point is predicted from its neighbours, as a planned micro-batch of
    a shape between the grid points would be.
    """
    B, S, t = (np.asarray(v, dtype=np.float64).ravel() for v in (batch, tokens, times))
    errors = np.empty(t.size)
    for i in range(t.size):
        keep = np.arange(t.size) != i
        cost = _fit_form(form, B[keep], S[keep], t[keep])
        errors[i] = abs(float(cost.step_time(B[i], S[i])) / t[i] - 1.0)
    return errors


def _point(B: np.ndarray, S: np.ndarray, i: int) -> str:
    return f"(B={int(B[i])}, S={int(S[i])})"


def _problems(
    cost: CostModel, form: str, B: np.ndarray, S: np.ndarray, loo: np.ndarray | None,
    required: Sequence[str], max_loo: float,
) -> list[str]:
    """What is wrong with a fitted form, each with the points that would fix it."""
    out = []
    s_lo, s_hi = float(S.min()), float(S.max())
    sizes = sorted({int(s) for s in S})
    if loo is None:
        out.append(
            f"{len(B)} points cannot cross-check {len(FORMS[form])} coefficients (leave-one-out "
            f"needs >= {len(FORMS[form]) + 2}): add B = 1 points at more token sizes"
        )
    share_a = cost.a * s_lo / max(cost.per_sample_time(s_lo), 1e-300)
    share_b = cost.b * s_hi * s_hi / max(cost.per_sample_time(s_hi), 1e-300)
    between = ", ".join(f"{np.sqrt(lo * hi):.0f}" for lo, hi in itertools.pairwise(sizes))
    if "a" in required and share_a < PINNED_SHARE:
        out.append(
            f"linear term a pinned at 0 ({100 * share_a:.2g}% of the per-sample cost at "
            f"S={s_lo:.0f}): add B = 1 points between the measured sizes ({between}) or more "
            "passes (on a busy CPU: --timer cpu --threads 1)"
        )
    if "b" in required and share_b < PINNED_SHARE:
        out.append(
            f"attention term b pinned at 0 ({100 * share_b:.2g}% of the per-sample cost at "
            f"S={s_hi:.0f}): add B = 1 points above {s_hi:.0f} tokens (the largest bucket)"
        )
    if s_hi > s_lo:
        p = cost.effective_exponent(s_lo, s_hi) if cost.per_sample_time(s_lo) > 0 else 0.0
        if not 1.0 < p < 2.0:
            out.append(
                f"effective exponent {p:.3f} over the grid ({s_lo:.0f}..{s_hi:.0f} tokens) at or "
                "beyond the clamp [1, 2]: add B = 1 points across the whole token range"
            )
    if loo is not None and loo.max() > max_loo:
        i = int(np.argmax(loo))
        near = [v for v in sizes if v != int(S[i])]
        lower = [v for v in near if v < S[i]]
        upper = [v for v in near if v > S[i]]
        near_i = ", ".join(f"{np.sqrt(S[i] * v):.0f}" for v in (lower[-1:] + upper[:1]))
        out.append(
            f"leave-one-out error {100 * loo.max():.0f}% > {100 * max_loo:.0f}% at point "
            f"{_point(B, S, i)}: its neighbours do not predict it; add token sizes near it "
            f"({near_i}) or more passes"
        )
    return out


def fit_measured(
    batch: Any, tokens: Any, times: Any, mem: Any | None = None,
    required: Sequence[str] = ("a", "b"), max_loo: float = DEFAULT_MAX_LOO["cuda"],
) -> tuple[CostModel, FitStats]:
    """Fit measured step times with the first of FORMS that passes every check; refuse if none.

    Checks (each failure says which points to add): enough points for leave-one-out
    (>= coefficients + 2); no `required` term pinned at 0 (a: GEMMs always grow with tokens;
    b: attention, required when the model's FLOPs say it matters over the grid); the effective
    exponent over the grid strictly inside the clamp [1, 2]; the leave-one-out error of every
    point <= `max_loo`. The floored form is preferred (it is what a device does); the
    three-term form is the fallback for grids without small batches. Memory, if given, is
    fitted as in `fit`. UserError when no form passes.
    """
    B = np.asarray(batch, dtype=np.float64).ravel()
    S = np.asarray(tokens, dtype=np.float64).ravel()
    t = np.asarray(times, dtype=np.float64).ravel()
    if not (B.size == S.size == t.size):
        raise ValueError("batch, tokens and times must have the same length")
    if np.any(t <= 0) or np.any(B < 1) or np.any(S < 1):
        raise ValueError("times must be positive, batch sizes and token counts >= 1")
    if B.size < 3 or np.unique(S).size < 2:
        raise UserError(
            f"{B.size} measured point(s) with {np.unique(S).size} token size(s): the fit needs "
            ">= 3 points with >= 2 token sizes; add B = 1 points at more token sizes"
        )
    checks = []
    for form, names in FORMS.items():
        cost = _fit_form(form, B, S, t)
        loo = leave_one_out(form, B, S, t) if B.size >= len(names) + 2 else None
        problems = _problems(cost, form, B, S, loo, required, max_loo)
        checks.append({"form": form, "problems": problems})
        if not problems:
            break
    else:
        lines = "; ".join(f"{c['form']}: {' / '.join(c['problems'])}" for c in checks)
        raise UserError(f"calibration fit is degenerate, refusing it ({lines})")
    r2, worst = _r2_and_worst(cost.step_time(B, S), t)
    mem_fit, mem_r2, mem_worst = fit_memory(B, S, mem)
    cost = replace(cost, **mem_fit)
    return cost, FitStats(
        r2, worst, int(B.size), mem_r2, mem_worst, form=form,
        loo_median=float(np.median(loo)), loo_max=float(loo.max()),
        loo_rel_err=[float(v) for v in loo], checks=checks,
    )


ATTENTION_REQUIRED_SHARE = 0.1  # attention FLOPs share at the largest S that makes b required


def required_terms(cfg: WanConfig, s_max: float) -> tuple[str, ...]:
    """Which per-sample terms the model's FLOPs say a fit must not pin at 0 over the grid.

    The linear term always (every token goes through the GEMMs); attention when its FLOPs
    are at least ATTENTION_REQUIRED_SHARE of a sample's at the largest measured S.
    """
    flops = analytic.flop_terms(cfg)
    share = flops.attention * s_max / (flops.linear + flops.attention * s_max)
    return ("a", "b") if share >= ATTENTION_REQUIRED_SHARE else ("a",)
