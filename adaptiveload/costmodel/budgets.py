"""The policies' budgets from a cost model (rules in BUDGET_RULES): p, M_mem and M_comp for
AdaptiveLoad and M_tok for the equal-token baseline, both calibrated to one reference batch
(the heaviest bucket that fits alone, at its memory-limited batch size); `memory_budget` and
`capacity_for` turn a capacity into M_mem and back (`Calibration.m_comp_at` moves M_comp to
another p or scale, the sweeps)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from adaptiveload.costmodel.cost import CostModel
from adaptiveload.errors import UserError
from adaptiveload.experiment import schema_default

# the fraction of a device's memory the budgets leave free (an experiment's
# calibration.headroom; files that do not record theirs were made with it)
DEFAULT_HEADROOM = schema_default("calibration.headroom")


# how derive_budgets chooses its numbers; written into every calibration file
BUDGET_RULES = {
    "p": "effective exponent of the per-sample cost c_seq + a*S + b*S^2 between the 5th and 95th "
    "percentile of the manifest's sample tokens (local exponent if they coincide), clamped to "
    "[1, 2]: attention bounds the growth at 2, and below 1 (a per-sample constant or timing "
    "noise dominating) the compute bound would hand long samples more tokens than short ones",
    "m_mem": "largest B*S with m(B,S) <= capacity*(1-headroom) for every S >= the manifest's "
    "smallest token count (m_seq is per sample, so the smallest S is the binding one)",
    "reference": "the reference batch both policies are calibrated to: S_ref = the heaviest "
    "bucket of the manifest that fits on its own, i.e. the largest sample token count with "
    "S <= m_mem (so m(1,S_ref) <= capacity*(1-headroom) too); buckets above it are oversize "
    "(B = 1) under both policies. B_ref = max(1, floor(m_mem/S_ref)), its memory-limited "
    "batch. --ref-tokens/--ref-batch override S_ref/B_ref and are taken as given",
    "m_tok": "B_ref * S_ref: the equal-token baseline equalises TOKENS to the reference batch "
    "(as Open-Sora/VideoX-Fun practitioners set the token budget: so that the longest bucket "
    "fits)",
    "m_comp": "B_ref * S_ref^p: AdaptiveLoad equalises COMPUTE to the same reference batch; "
    "shorter buckets then grow up to the memory bound m_mem, none exceeds the reference's cost",
}


@dataclass(frozen=True)
class BudgetDerivation:
    """How p, M_mem, M_comp and M_tok were derived from a cost model (recorded in calibration
    files). The planner reads the resulting numbers as `planning.policies.Budgets`.
    """

    p: float
    m_mem: float
    m_comp: float
    m_tok: float
    p_unclamped: float
    s_lo: float  # token range p was measured over
    s_hi: float
    ref_tokens: float
    ref_batch: int
    max_fits: bool  # one sample of the largest token count fits under the capacity

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rules": BUDGET_RULES}


def local_exponent(cost: CostModel, s: float) -> float:
    """d log(c_seq + aS + bS^2) / d log S at s."""
    return float((cost.a * s + 2 * cost.b * s * s) / cost.per_sample_time(s))


# Which bucket S_ref is, among the samples that fit on their own. "heaviest" is our rule
# (BUDGET_RULES["reference"]); the paper does not say, so the others are alternatives that the
# paper-map sweep compares: the bucket most samples fall in, and the median sample's bucket.
REFERENCE_RULES = ("heaviest", "most-common", "median")


def reference_tokens(sample_tokens: np.ndarray, m_mem: float, rule: str = "heaviest") -> float:
    """S_ref by `rule` (REFERENCE_RULES) over the samples that fit on their own (<= m_mem).

    A relative 1e-9 of slack keeps a bucket that M_mem was sized to exactly (M_mem = its
    tokens, round-tripped through a capacity) from being lost to rounding.
    """
    if rule not in REFERENCE_RULES:
        raise UserError(f"reference rule {rule!r}: expected one of {', '.join(REFERENCE_RULES)}")
    fitting = sample_tokens[sample_tokens <= m_mem * (1 + 1e-9)]
    if fitting.size == 0:
        raise UserError(
            f"no sample fits the memory budget on its own (smallest {sample_tokens.min():.0f} "
            f"tokens > M_mem {m_mem:.0f}); raise the capacity or give --ref-tokens"
        )
    if rule == "most-common":  # ties go to the heavier bucket
        values, counts = np.unique(fitting, return_counts=True)
        return float(values[np.flatnonzero(counts == counts.max())[-1]])
    if rule == "median":  # a real bucket: the lower median
        return float(np.sort(fitting)[(fitting.size - 1) // 2])
    return float(fitting.max())


def derive_budgets(
    cost: CostModel,
    sample_tokens: Any,
    capacity_bytes: float,
    headroom: float = DEFAULT_HEADROOM,
    ref_tokens: float | None = None,
    ref_batch: int | None = None,
) -> BudgetDerivation:
    """p, M_mem, M_comp and M_tok of `cost` for a manifest's per-sample token counts.

    Both policies are calibrated to one reference batch (BUDGET_RULES["reference"]) so that the
    comparison is fair: equal-token gets M_tok = B_ref*S_ref, AdaptiveLoad M_comp = B_ref*S_ref^p
    under the same M_mem. Since (S_ref/S)^p >= S_ref/S for S <= S_ref, AdaptiveLoad's batches
    are never smaller than equal-token's below the reference bucket and grow up to M_mem.
    """
    tok = np.asarray(sample_tokens, dtype=np.float64).ravel()
    if tok.size == 0:
        raise UserError("manifest has no samples: cannot derive the token range of p and M_comp")
    if np.any(tok < 1):
        raise UserError("manifest tokens must be >= 1")
    if not 0 <= headroom < 1:
        raise UserError(f"headroom {headroom}: expected 0 <= headroom < 1")
    if cost.a <= 0 and cost.b <= 0:
        raise UserError("cost model has a = b = 0: per-sample cost does not grow with S")
    if cost.m_tok <= 0 and cost.m_seq <= 0:
        raise UserError("memory model has m_tok = m_seq = 0: fit or model memory first")

    s_lo, s_hi = (float(v) for v in np.percentile(tok, [5, 95]))
    p_raw = cost.effective_exponent(s_lo, s_hi) if s_hi > s_lo else local_exponent(cost, s_lo)
    p = min(2.0, max(1.0, p_raw))

    s_min = float(tok.min())
    m_mem = memory_budget(cost, capacity_bytes, headroom, s_min)
    max_fits = bool(cost.memory(1, tok.max()) <= capacity_bytes * (1 - headroom))

    if ref_tokens is None:
        ref_tokens = reference_tokens(tok, m_mem)
    if ref_batch is None:
        ref_batch = max(1, int(m_mem // ref_tokens))
    m_tok = ref_batch * ref_tokens
    m_comp = ref_batch * ref_tokens**p
    return BudgetDerivation(
        p=float(p), m_mem=float(m_mem), m_comp=float(m_comp), m_tok=float(m_tok),
        p_unclamped=float(p_raw),
        s_lo=s_lo, s_hi=s_hi,
        ref_tokens=float(ref_tokens), ref_batch=int(ref_batch), max_fits=max_fits,
    )


def memory_budget(cost: CostModel, capacity_bytes: float, headroom: float, s_min: float) -> float:
    """M_mem (BUDGET_RULES["m_mem"]): the largest B*S with m(B,S) <= capacity*(1-headroom) for
    every S >= s_min, the manifest's smallest token count (m_seq is per sample, so the smallest
    S binds). `capacity_for` is its inverse."""
    usable = capacity_bytes * (1 - headroom) - cost.m_static
    if usable <= 0:
        raise UserError(
            f"static memory {cost.m_static / 1e9:.2f} GB exceeds the usable capacity "
            f"{capacity_bytes * (1 - headroom) / 1e9:.2f} GB; raise the capacity or shard the model"
        )
    return usable / (cost.m_tok + cost.m_seq / s_min)


def capacity_for(cost: CostModel, m_mem: float, headroom: float, s_min: float) -> float:
    """The capacity in bytes at which `memory_budget` is `m_mem`: a pretend device sized so
    that a short run's budgets fit a chosen micro-batch (experiments/gpu/train_budgets.py).
    Round-tripped through `memory_budget` it gives `m_mem` back up to rounding, which
    `reference_tokens` allows for."""
    if not 0 <= headroom < 1:
        raise UserError(f"headroom {headroom}: expected 0 <= headroom < 1")
    return (cost.m_static + m_mem * (cost.m_tok + cost.m_seq / s_min)) / (1 - headroom)

