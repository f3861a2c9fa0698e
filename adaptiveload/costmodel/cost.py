"""How long a micro-batch takes and how much memory it needs: one interface for the planner,
the simulator and the analysis.

The fitted form (per rank, one micro-batch of B samples of S tokens each, forward+backward):

    t(B, S) = max(t_floor, c0 + B * (c_seq + a*S + b*S^2))    seconds
    m(B, S) = m_static + B * (m_tok*S + m_seq)                  bytes

A packed micro-batch (samples of different lengths S_i in one token stream, varlen attention)
costs the sum of its samples' terms, since attention is per sample (sum S_i^2, not (sum S_i)^2):

    t(set) = max(t_floor, c0 + sum_i (c_seq + a*S_i + b*S_i^2))
    m(set) = m_static + sum_i (m_tok*S_i + m_seq)

so a set is described by three sufficient statistics (n, sum S_i, sum S_i^2): `pack_time` and
`pack_memory` take them (vectorised over many sets), `set_time` and `set_memory` take one set's
token counts. For B samples of one shape they are t(B, S) and m(B, S), so every calibration
fitted on homogeneous batches prices packs too; whether a device is additive on short
segments is what calibrating mixed packs measures (docs/calibration.md).

`a` carries the linear layers (GEMMs grow with tokens), `b` self-attention (quadratic in S),
`c0` the per-micro-batch fixed cost the device itself pays, `c_seq` the per-sample constant
(Wan's text embedding and cross-attention keys/values of the 512 text tokens: 2.2 TFLOP forward
per sample on the 14B, worth ~90 tokens of linear work), `m_seq` its memory counterpart.
`t_floor` is the small-batch floor: a GPU step cannot finish before the host has issued all of
its kernels (Python, autograd, launches), so below a few thousand tokens a micro-batch costs
about the same whatever its size (measured on an H200: ~0.28 s up to ~6k tokens for the 1.3B).
`c_seq` and `t_floor` default to 0 (the three-term form of the analytic priors; files written
before the floor existed load unchanged). docs/calibration.md describes the fit.

**A set at sequence-parallel degree d** (Ulysses: a group of d ranks runs one pack together,
every segment's tokens cut into d chunks, rank r holding chunk r of each; attention runs on
d-th of the heads after an all-to-all) costs each rank of the group

    t_d(set) = max(t_floor, c0 + c_seq n + (a ΣS + b ΣS²) / d
                             + L · passes · (t_a2a(d, 3 s) + t_a2a(d, s))),  s = ΣS/d · dim · e
    m_d(set) = m_static + m_tok ΣS / d + m_seq n

(`CostModel.at_degree`, with the all-to-all from `SequenceParallel.cost_at`): the token and
attention work divides over the d ranks; c0 and the floor do not (every rank pays its own
launches), nor does c_seq or m_seq (the text's cross-attention keys and values are computed
whole on every rank: the text is not split). Per block (L of them) and pass, two all-to-alls
(the model's `sequence_parallel`: q, k and v travel together to head shards, 3 s bytes per
rank, and the output back, s bytes; the backward moves their gradients the same way; passes =
2, forward and backward, 3 with activation checkpointing, whose recomputed forward exchanges
again), s = ΣS/d · dim · e the bytes of one [L_r, dim] tensor of the rank's tokens (e =
`CommModel.dtype_bytes`), each costing
`t_a2a(d, n) = latency(d) + n (d-1)/d / bytes_per_s(d)` (`CommModel`: the calibration's
measured `comm` section, or the analytic prior of NVLink inside a node of 8 and InfiniBand
across nodes). The all-to-all sits inside the floor's max: below the floor the host, not the
device, sets the time, and the exchange runs on the device meanwhile; no overlap with compute
is assumed otherwise (an upper bound on its cost). The static part stays whole: SP changes how
a pack's activations divide, not how the parameters and optimizer state are held; under FSDP
the calibration's m_static is already the sharded state (its `setup.shard_world_size`), which
SP groups, inside the same N ranks, leave as it is. At d = 1 both are `pack_time` and
`pack_memory` exactly (the same `CostModel`).

The coefficients are fitted by `adaptiveload.calibration.fit` (from measured or analytic
points) and refitted from a run's own micro-batches by `costmodel.refit`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from adaptiveload.costmodel.comm import GroupBound

# A micro-batch may fill a limit's cap exactly: a sum counts as within its cap up to this
# relative tolerance above it. M_comp is B_ref S_ref^p, so B_ref reference samples fill it
# exactly, and one sum taken in another order (by the epoch bound, the packer, a check of the
# plan) differs in its last bits; the bound, the planners and the checks all read the cap
# through `within_cap` / `EpochLimits.ceiling`, so they agree on what fits.
CAP_TOLERANCE = 1e-9


def within_cap(used: Any, cap: Any) -> np.ndarray:
    """True where a sum `used` is within `cap` (up to CAP_TOLERANCE above it)."""
    return np.asarray(used) <= np.asarray(cap, dtype=np.float64) * (1 + CAP_TOLERANCE)


# The time model is linear in its coefficients below the floor: work = features . coefficients,
# one row per micro-batch, one column per term. `features` is the one design matrix that
# prices a pack (`CostModel.pack_time`), fits a calibration (`calibration.fit`) and refits one
# from a run's rows (`costmodel.refit`).
TIME_TERMS = ("c0", "c_seq", "a", "b")
MEMORY_TERMS = ("m_static", "m_tok", "m_seq")


def feature_columns(count: Any, sum_tokens: Any, sum_tokens_sq: Any) -> list[np.ndarray]:
    """The columns of TIME_TERMS for sets of `count` samples whose token counts sum to
    `sum_tokens` and whose squares sum to `sum_tokens_sq`, broadcast to one shape: 1 (c0,
    once per micro-batch; a read-only view that holds no memory), n (c_seq, once per
    sample), ΣS (a, the linear layers) and ΣS² (b, attention per sample). B samples of S
    tokens are (B, B S, B S²). Pricing millions of packs column by column holds no design
    matrix beside them."""
    n, s, q = np.broadcast_arrays(
        *(np.asarray(v, dtype=np.float64) for v in (count, sum_tokens, sum_tokens_sq))
    )
    return [np.broadcast_to(1.0, n.shape), n, s, q]


def features(count: Any, sum_tokens: Any, sum_tokens_sq: Any) -> np.ndarray:
    """[..., 4]: `feature_columns` as one design matrix (the rows a fit solves for)."""
    return np.stack(feature_columns(count, sum_tokens, sum_tokens_sq), axis=-1)


def memory_feature_columns(count: Any, sum_tokens: Any) -> list[np.ndarray]:
    """The columns of MEMORY_TERMS, broadcast to one shape: 1 (m_static; a read-only view),
    ΣS (m_tok), n (m_seq)."""
    n, s = np.broadcast_arrays(
        *(np.asarray(v, dtype=np.float64) for v in (count, sum_tokens))
    )
    return [np.broadcast_to(1.0, n.shape), s, n]


def memory_features(count: Any, sum_tokens: Any) -> np.ndarray:
    """[..., 3]: `memory_feature_columns` as one design matrix."""
    return np.stack(memory_feature_columns(count, sum_tokens), axis=-1)


def combine(columns: Sequence[np.ndarray] | np.ndarray, coefficients: Any) -> np.ndarray:
    """Σ_k columns[k] coefficients[k], added in column order (`feature_columns`, or a design
    matrix's transpose ``x.T``): every caller that prices a set gets the same bits (a matrix
    product may add in another order)."""
    coef = np.asarray(coefficients, dtype=np.float64)
    out = columns[0] * coef[0]
    for k in range(1, coef.size):
        out = out + columns[k] * coef[k]
    return out


@dataclass(frozen=True)
class CostModel:
    """Fitted step-time and memory model of one model config on one device."""

    c0: float
    a: float
    b: float
    m_static: float = 0.0
    m_tok: float = 0.0
    m_seq: float = 0.0
    c_seq: float = 0.0
    t_floor: float = 0.0  # small-batch floor, seconds (0 = none)

    def per_sample_time(self, tokens: Any) -> Any:
        """c_seq + a*S + b*S^2: one sample's share of a micro-batch."""
        s = np.asarray(tokens, dtype=np.float64)
        return self.c_seq + self.a * s + self.b * s * s

    def step_time(self, batch: Any, tokens: Any) -> Any:
        """Predicted forward+backward seconds of micro-batches; broadcasts over arrays."""
        work = self.c0 + np.asarray(batch, dtype=np.float64) * self.per_sample_time(tokens)
        return np.maximum(self.t_floor, work)

    def memory(self, batch: Any, tokens: Any) -> Any:
        """Predicted peak bytes of micro-batches; broadcasts over arrays."""
        s = np.asarray(tokens, dtype=np.float64)
        return self.m_static + np.asarray(batch, dtype=np.float64) * (self.m_tok * s + self.m_seq)

    @property
    def time_coefficients(self) -> np.ndarray:
        """The coefficients of TIME_TERMS, in their order (the columns of `features`)."""
        return np.array([getattr(self, k) for k in TIME_TERMS])

    @property
    def memory_coefficients(self) -> np.ndarray:
        """The coefficients of MEMORY_TERMS, in their order (the columns of
        `memory_features`)."""
        return np.array([getattr(self, k) for k in MEMORY_TERMS])

    def pack_time(self, count: Any, sum_tokens: Any, sum_tokens_sq: Any) -> Any:
        """Predicted forward+backward seconds of packs of `count` samples whose token counts
        sum to `sum_tokens` and whose squares sum to `sum_tokens_sq`; broadcasts over arrays.
        An empty pack (count 0) costs nothing: no micro-batch runs."""
        columns = feature_columns(count, sum_tokens, sum_tokens_sq)
        work = combine(columns, self.time_coefficients)
        return np.where(columns[1] > 0, np.maximum(self.t_floor, work), 0.0)

    def pack_memory(self, count: Any, sum_tokens: Any) -> Any:
        """Predicted peak bytes of packs of `count` samples holding `sum_tokens` tokens in all;
        broadcasts over arrays."""
        return combine(memory_feature_columns(count, sum_tokens), self.memory_coefficients)

    def set_time(self, tokens: Any) -> float:
        """`pack_time` of one set of samples, given their token counts."""
        s = np.asarray(tokens, dtype=np.float64).ravel()
        return float(self.pack_time(s.size, s.sum(), (s * s).sum()))

    def set_memory(self, tokens: Any) -> float:
        """`pack_memory` of one set of samples, given their token counts."""
        s = np.asarray(tokens, dtype=np.float64).ravel()
        return float(self.pack_memory(s.size, s.sum()))

    def at_degree(
        self, degree: int, latency_s: float = 0.0, s_per_token: float = 0.0
    ) -> CostModel:
        """This cost model for one rank of a sequence-parallel group of `degree` ranks that runs
        a set together (module docstring): a, b and m_tok over `degree`; each of the step's
        all-to-alls adds `latency_s` in all (to c0) and `s_per_token` per token of the set (to
        a); c0, c_seq, the floor, m_static and m_seq stay whole. Degree 1 without
        communication is this very model. `SequenceParallel.cost_at` supplies the
        communication terms."""
        if degree == 1 and latency_s == 0 and s_per_token == 0:
            return self
        return replace(
            self, c0=self.c0 + latency_s, a=self.a / degree + s_per_token, b=self.b / degree,
            m_tok=self.m_tok / degree,
        )

    def step_lower_bound(self, work_sum: Any, work_max: Any, ranks: int) -> Any:
        """The least slowest-rank time any packing of one step's samples over `ranks` ranks
        can reach, given their per-sample costs' sum `work_sum` and maximum `work_max`
        (`per_sample_time`): some rank holds at least the average, one holds the costliest
        sample, and each pays c0 and the floor. Broadcasts over steps; memory is ignored, so a
        plan may sit above it for want of room, never below."""
        work = np.maximum(np.asarray(work_sum, dtype=np.float64) / ranks, work_max)
        return np.maximum(self.t_floor, self.c0 + work)

    def epoch_lower_bound(
        self, tokens: Any, count: Any, limits: EpochLimits, ranks: int, step_s: float = 0.0,
        groups: GroupBound | None = None,
    ) -> EpochBound:
        """The least epoch any plan of these samples on `ranks` ranks could take, each
        micro-batch within `limits` (docs/definitions.md derives it). `groups`: where samples
        may run in sequence-parallel groups, what each one costs at the degrees allowed
        (`SequenceParallel.bound`): a sample then occupies d ranks for its time at d, so the
        micro-batches count rank units, the spread is over rank-seconds and the pigeonhole
        term takes each sample's least time at any allowed degree. None: one rank each.

        `tokens` are the epoch's distinct token counts and `count` how many real samples have
        each (padding is no work: leave it out). K_min = ⌈P_min / N⌉ steps at least
        (`EpochLimits.min_micro_batches`); every step pays c0 on its slowest rank and `step_s`
        (the all-reduce) once; the slowest ranks together hold at least the work spread over
        N ranks, and at least ⌈M_t / N⌉ samples of cost >= w_t for every cost w_t (the M_t
        samples costing that much or more cannot split: some rank of some step holds
        ⌈M_t,k / N⌉ of a step's share, and those ceilings add up to at least ⌈M_t / N⌉); and
        no step is faster than the floor. More steps only add c0 and `step_s`, so K_min gives
        the least. Memory and compute limits enter through K_min only."""
        tok = np.asarray(tokens, dtype=np.float64).ravel()
        n = np.asarray(count, dtype=np.int64).ravel()
        keep = n > 0
        tok, n = tok[keep], n[keep]
        if tok.size == 0:
            return EpochBound(micro_batches=0, steps=0, seconds=0.0)
        if groups is None:
            packs = limits.min_micro_batches(tok, n)
            work = least = self.per_sample_time(tok)
        else:
            packs, work, least = groups.terms(self, tok, n, limits)
        steps = -(-packs // ranks)
        spread = float((work * n).sum()) / ranks
        by_cost = np.argsort(-least, kind="stable")
        at_least = np.cumsum(n[by_cost])  # samples costing w_t or more
        indivisible = float((least[by_cost] * -(-at_least // ranks)).max())
        compute = max(steps * self.t_floor, steps * self.c0 + max(spread, indivisible))
        return EpochBound(micro_batches=packs, steps=steps, seconds=compute + steps * step_s)

    def effective_exponent(self, s_lo: float, s_hi: float) -> float:
        """p such that the per-sample cost grows like S^p between s_lo and s_hi."""
        if not 0 < s_lo < s_hi:
            raise ValueError("need 0 < s_lo < s_hi")
        lo, hi = self.per_sample_time(s_lo), self.per_sample_time(s_hi)
        return float(np.log(hi / lo) / np.log(s_hi / s_lo))


def libm_power(base: np.ndarray, exponent: float) -> np.ndarray:
    """``base ** exponent`` element by element through the C library's pow, not numpy's
    vector loops: numpy on a CPU with AVX-512 computes powers, logarithms and exponentials
    with other kernels than elsewhere, whose last bits differ, and a plan each rank builds on
    its own must come out the same on every machine (a sum that fills a cap on one would
    break it on another). Python floats; meant for the few distinct token counts a plan
    prices."""
    if exponent == 1.0:
        return np.asarray(base, dtype=np.float64)
    return np.array([math.pow(x, exponent) for x in np.asarray(base, dtype=np.float64).tolist()],
                    dtype=np.float64)


@dataclass(frozen=True)
class EpochLimits:
    """Per-micro-batch limits as sums over its samples: limit d counts ``per_token[d] *
    S**power[d] + per_sample[d]`` for each sample of S tokens and caps the sum at
    ``caps[d]`` (the planner's are `planning.packing.PackLimits`: memory, compute S^p <=
    M_comp, tokens)."""

    per_token: tuple[float, ...]
    power: tuple[float, ...]
    per_sample: tuple[float, ...]
    caps: tuple[float, ...]
    # which limits a sample cannot break even alone (the device's memory): over one at a
    # sequence-parallel degree, it cannot run at that degree (`GroupBound`); () = none
    hard: tuple[bool, ...] = ()

    def use(self, tokens: Any) -> np.ndarray:
        """[len(tokens), limits]: what one sample of each token count counts against each
        (for the distinct token counts a plan prices: powers by `libm_power`)."""
        s = np.asarray(tokens, dtype=np.float64).ravel()
        return np.stack(
            [k * libm_power(s, p) + c
             for k, p, c in zip(self.per_token, self.power, self.per_sample, strict=True)],
            axis=1,
        )

    @property
    def ceiling(self) -> np.ndarray:
        """The largest sum each limit holds: its cap, up to CAP_TOLERANCE above it."""
        return np.asarray(self.caps, dtype=np.float64) * (1 + CAP_TOLERANCE)

    def at_degree(self, degree: int) -> EpochLimits:
        """These limits as one rank of a sequence-parallel group of `degree` ranks counts them:
        a sample's per-token part over `degree` (each rank holds a d-th of its tokens), its
        per-sample part whole (`CostModel.at_degree`). Degree 1: these limits."""
        if degree == 1:
            return self
        return replace(self, per_token=tuple(p / degree for p in self.per_token))

    def min_micro_batches(self, tokens: Any, count: Any) -> int:
        """P_min, the volume bound: a sample over a limit on its own runs alone (one
        micro-batch each), and the others need at least max over limits of their summed use
        over the cap, rounded up. No plan within the limits has fewer micro-batches."""
        n = np.asarray(count, dtype=np.float64).ravel()
        use = self.use(np.asarray(tokens, dtype=np.float64).ravel())
        alone = (use > self.ceiling).any(axis=1)
        volume = (use * n[:, None])[~alone].sum(axis=0) / self.ceiling
        return int(n[alone].sum()) + math.ceil(float(volume.max(initial=0.0)))


@dataclass(frozen=True)
class EpochBound:
    """`CostModel.epoch_lower_bound`: P_min micro-batches, K_min steps and the least epoch
    seconds (compute plus each step's fixed cost)."""

    micro_batches: int
    steps: int
    seconds: float



def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)

