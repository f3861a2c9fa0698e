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
points); `derive_budgets` turns
them into the policies' budgets for a manifest (rules in BUDGET_RULES): p, M_mem and M_comp
for AdaptiveLoad and M_tok for the equal-token baseline, both calibrated to one reference batch
(the heaviest bucket that fits alone, at its memory-limited batch size);
`Calibration.m_comp_at` moves M_comp to another p or scale (the sweeps), `memory_budget` and
`capacity_for` turn a capacity into M_mem and back.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from adaptiveload.errors import UserError
from adaptiveload.experiment import schema_default
from adaptiveload.io import read_json
from adaptiveload.model.analytic import compute_bytes

# the fraction of a device's memory the budgets leave free (an experiment's
# calibration.headroom; files that do not record theirs were made with it)
DEFAULT_HEADROOM = schema_default("calibration.headroom")
# A micro-batch may fill a limit's cap exactly: a sum counts as within its cap up to this
# relative tolerance above it. M_comp is B_ref S_ref^p, so B_ref reference samples fill it
# exactly, and one sum taken in another order (by the epoch bound, the packer, a check of the
# plan) differs in its last bits; the bound, the planners and the checks all read the cap
# through `within_cap` / `EpochLimits.ceiling`, so they agree on what fits.
CAP_TOLERANCE = 1e-9


def within_cap(used: Any, cap: Any) -> np.ndarray:
    """True where a sum `used` is within `cap` (up to CAP_TOLERANCE above it)."""
    return np.asarray(used) <= np.asarray(cap, dtype=np.float64) * (1 + CAP_TOLERANCE)


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

    def pack_time(self, count: Any, sum_tokens: Any, sum_tokens_sq: Any) -> Any:
        """Predicted forward+backward seconds of packs of `count` samples whose token counts
        sum to `sum_tokens` and whose squares sum to `sum_tokens_sq`; broadcasts over arrays.
        An empty pack (count 0) costs nothing: no micro-batch runs."""
        n = np.asarray(count, dtype=np.float64)
        work = (
            self.c0
            + self.c_seq * n
            + self.a * np.asarray(sum_tokens, dtype=np.float64)
            + self.b * np.asarray(sum_tokens_sq, dtype=np.float64)
        )
        return np.where(n > 0, np.maximum(self.t_floor, work), 0.0)

    def pack_memory(self, count: Any, sum_tokens: Any) -> Any:
        """Predicted peak bytes of packs of `count` samples holding `sum_tokens` tokens in all;
        broadcasts over arrays."""
        n = np.asarray(count, dtype=np.float64)
        return self.m_static + self.m_tok * np.asarray(sum_tokens, dtype=np.float64) + (
            self.m_seq * n
        )

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
        """[len(tokens), limits]: what one sample of each token count counts against each."""
        s = np.asarray(tokens, dtype=np.float64)[:, None]
        return np.asarray(self.per_token) * s ** np.asarray(self.power) + np.asarray(
            self.per_sample
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


# Ulysses exchanges of one block per pass (model.sequence_parallel): two all-to-alls, q, k and
# v together to head shards and the output back (forward; their gradients the same way in
# backward), moving four tensors of the rank's tokens in all
ALL_TO_ALLS_PER_PASS = 2
TENSORS_PER_PASS = 4
COMM_SOURCES = ("measured", "model")
COMM_BACKENDS = ("gloo", "nccl", "prior")
# The analytic prior of one all-to-all (`CommModel.prior`), per GPU, as the bus bandwidth
# nccl-tests reports for it (the bytes each rank sends over the seconds the exchange takes):
# - inside a node: NVLink 4 (H100/H200 SXM) carries 450 GB/s each way (900 GB/s
#   bidirectional); NCCL's developers put what NCCL gets of it, protocol overhead taken off,
#   at about 370 GB/s, the bus bandwidth nccl-tests shows for collectives other than
#   all-reduce on 8 GPUs (a few hundred GB/s for all-to-all on 8x H100/H200);
# - across nodes: one 400 Gb/s InfiniBand NIC per GPU (8 x 400 Gb/s a node) carries 48-49
#   GB/s, and an all-to-all cannot spread one rank's traffic over several NICs (nccl-tests'
#   maintainers), so the (d - node)/d of each rank's bytes that leave its node set the time;
# - latency, 20 us inside a node and 50 us across: our assumption (tens of microseconds for a
#   small all-to-all of NCCL on 8 GPUs).
NVLINK_BYTES_PER_S = 3.7e11
NVLINK_LATENCY_S = 2e-5
INFINIBAND_BYTES_PER_S = 4.8e10
INFINIBAND_LATENCY_S = 5e-5
NODE_SIZE = 8
PRIOR_DEVICE = "NVIDIA H200 nodes of 8, NVLink 4 + 400 Gb/s InfiniBand (analytic prior)"
PRIOR_MAX_DEGREE = 1024  # links of the prior up to this degree; above it the largest's


@dataclass(frozen=True)
class CommLink:
    """One all-to-all link of a `CommModel`: at `degree` ranks, n bytes per rank take
    ``latency_s + n (degree - 1) / degree / bytes_per_s`` seconds."""

    degree: int
    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class CommModel:
    """How long one Ulysses all-to-all takes on a device, per sequence-parallel degree d: a
    calibration's ``comm`` section (measured: fitted per measured degree by least squares of
    seconds on n (d-1)/d) or the analytic prior (`prior`).

    ``t(d, n) = latency_s(d) + n (d-1)/d / bytes_per_s(d)`` for n bytes each rank holds before
    the exchange (it keeps n/d and sends the rest). A degree between measured ones takes the
    next larger measured degree's link (conservative), one above them the largest's; d = 1
    costs 0. `dtype_bytes` is the activation element size the cost of a set assumes;
    `points` the measured (degree, bytes, seconds) the links were fitted to (none for a prior).
    """

    links: tuple[CommLink, ...]
    source: str = "model"
    backend: str = "prior"
    device: str = PRIOR_DEVICE
    dtype_bytes: int = compute_bytes("cuda")  # the prior's: bf16 autocast, as on an H200
    points: tuple[dict[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not self.links:
            raise ValueError("a CommModel needs at least one link")
        object.__setattr__(self, "links", tuple(sorted(self.links, key=lambda k: k.degree)))

    def terms(self, degree: Any) -> tuple[np.ndarray, np.ndarray]:
        """(latency_s, seconds per byte held) of one all-to-all at each `degree`: t(d, n) =
        latency + n * per_byte, the one home of the formula (0 and 0 at d = 1)."""
        d = np.asarray(degree, dtype=np.float64)
        known = np.array([k.degree for k in self.links], dtype=np.float64)
        at = np.minimum(np.searchsorted(known, d, side="left"), known.size - 1)
        latency = np.array([k.latency_s for k in self.links])[at]
        bandwidth = np.array([k.bytes_per_s for k in self.links])[at]
        single = d <= 1
        return np.where(single, 0.0, latency), np.where(single, 0.0, (d - 1) / d / bandwidth)

    def all_to_all_s(self, degree: Any, bytes_per_rank: Any) -> Any:
        """Seconds of one all-to-all of `bytes_per_rank` bytes per rank at `degree` ranks;
        broadcasts over arrays."""
        latency, per_byte = self.terms(degree)
        return latency + np.asarray(bytes_per_rank, dtype=np.float64) * per_byte

    @classmethod
    def prior(
        cls,
        bytes_per_s: float = NVLINK_BYTES_PER_S,
        latency_s: float = NVLINK_LATENCY_S,
        node_size: int = NODE_SIZE,
        inter_node_bytes_per_s: float = INFINIBAND_BYTES_PER_S,
        inter_node_latency_s: float = INFINIBAND_LATENCY_S,
        max_degree: int = PRIOR_MAX_DEGREE,
    ) -> CommModel:
        """The analytic prior (sources beside NVLINK_BYTES_PER_S): groups of up to `node_size`
        ranks inside one node at `bytes_per_s`; a larger group spans nodes, and the share
        (d - node_size)/d of each rank's bytes that crosses the boundary, at
        `inter_node_bytes_per_s`, sets the time: an effective rate of
        ``inter_node_bytes_per_s (d - 1) / (d - node_size)`` over the bytes sent. Links at
        every power of two from 2 to `max_degree`."""
        links, d = [], 2
        while d <= max_degree:
            if d <= node_size:
                links.append(CommLink(d, latency_s, bytes_per_s))
            else:
                rate = inter_node_bytes_per_s * (d - 1) / (d - node_size)
                links.append(CommLink(d, inter_node_latency_s, rate))
            d *= 2
        return cls(links=tuple(links))

    @classmethod
    def from_dict(cls, section: Any, origin: str = "<dict>") -> CommModel:
        """A calibration's ``comm`` section; UserError naming the field for anything else."""
        where = f"{origin}: field 'comm"
        fix = "write it with the comm calibration or leave it out (the analytic prior is used)"
        if not isinstance(section, dict):
            raise UserError(f"{where}' must be an object; {fix}")
        for name, allowed in (("source", COMM_SOURCES), ("backend", COMM_BACKENDS)):
            if section.get(name) not in allowed:
                raise UserError(f"{where}.{name}' must be one of {', '.join(allowed)}; {fix}")
        if not isinstance(section.get("device"), str):
            raise UserError(f"{where}.device' must be the device's name; {fix}")
        e = section.get("dtype_bytes")
        if isinstance(e, bool) or not isinstance(e, int) or e < 1:
            raise UserError(f"{where}.dtype_bytes' must be an integer >= 1 (2 for bf16); {fix}")
        links = section.get("links")
        if not isinstance(links, list) or not links:
            raise UserError(f"{where}.links' must be a non-empty list; {fix}")
        made = [_comm_link(link, f"{where}.links[{i}]", fix) for i, link in enumerate(links)]
        if len({k.degree for k in made}) < len(made):
            raise UserError(f"{where}.links' lists a degree twice; {fix}")
        points = section.get("points", [])
        if not isinstance(points, list) or not all(isinstance(q, dict) for q in points):
            raise UserError(f"{where}.points' must be a list of objects; {fix}")
        return cls(links=tuple(made), source=section["source"], backend=section["backend"],
                   device=section["device"], dtype_bytes=e, points=tuple(points))

    def to_dict(self) -> dict[str, Any]:
        """The ``comm`` section of a calibration file (`from_dict` reads it back)."""
        out = {"source": self.source, "backend": self.backend, "device": self.device,
               "dtype_bytes": self.dtype_bytes, "links": [asdict(k) for k in self.links]}
        if self.points:
            out["points"] = [dict(q) for q in self.points]
        return out


def _comm_link(link: Any, where: str, fix: str) -> CommLink:
    """One entry of a ``comm.links`` list, checked (`where` names it in an error)."""
    if not isinstance(link, dict):
        raise UserError(f"{where}' must be an object; {fix}")
    d = link.get("degree")
    if isinstance(d, bool) or not isinstance(d, int) or d < 2:
        raise UserError(f"{where}.degree' must be an integer >= 2; {fix}")
    if not (_finite_number(link.get("latency_s")) and link["latency_s"] >= 0):
        raise UserError(f"{where}.latency_s' must be a number >= 0; {fix}")
    if not (_finite_number(link.get("bytes_per_s")) and link["bytes_per_s"] > 0):
        raise UserError(f"{where}.bytes_per_s' must be a positive number; {fix}")
    return CommLink(int(d), float(link["latency_s"]), float(link["bytes_per_s"]))


@dataclass(frozen=True)
class SequenceParallel:
    """What the cost of a set at a sequence-parallel degree takes beside the cost model
    (module docstring): the all-to-all model and the model's shape (blocks, width, heads),
    and how many passes exchange (2, forward and backward; 3 with activation
    checkpointing)."""

    comm: CommModel
    num_layers: int
    dim: int
    num_heads: int
    passes: int = 2

    @classmethod
    def of(cls, calibration: Calibration) -> SequenceParallel:
        """A calibration's: its ``comm`` section (else `CommModel.prior`), the shape it
        records (``model_config``, else the registered config of its model) and its
        ``setup.activation_checkpointing``."""
        shape = calibration.extra.get("model_config")
        if not (isinstance(shape, dict) and {"num_layers", "dim", "num_heads"} <= set(shape)):
            from adaptiveload.model.architectures import get_config

            shape = get_config(calibration.model).to_dict()
        setup = calibration.extra.get("setup")
        checkpointing = isinstance(setup, dict) and bool(setup.get("activation_checkpointing"))
        return cls(
            comm=calibration.comm or CommModel.prior(), num_layers=int(shape["num_layers"]),
            dim=int(shape["dim"]), num_heads=int(shape["num_heads"]),
            passes=3 if checkpointing else 2,
        )

    @property
    def exchanges(self) -> int:
        """The all-to-alls of one step, each paying the latency: blocks x 2 x passes."""
        return self.num_layers * ALL_TO_ALLS_PER_PASS * self.passes

    @property
    def tensors(self) -> int:
        """The [L_r, dim] tensors those exchanges move in all: blocks x 4 x passes."""
        return self.num_layers * TENSORS_PER_PASS * self.passes

    def max_degree(self, world_size: int) -> int:
        """The largest degree a group may have on `world_size` ranks: a power of two that
        divides the head count (Ulysses gives every rank whole heads) and the world size
        (groups are aligned blocks of ranks, [k d, (k+1) d))."""
        d = 1
        while self.num_heads % (2 * d) == 0 and world_size % (2 * d) == 0:
            d *= 2
        return d

    def cost_at(self, cost: CostModel, degree: int) -> CostModel:
        """`cost` for one rank of a group of `degree` ranks (module docstring): `exchanges`
        all-to-alls, each a latency, moving `tensors` tensors of ΣS/d * dim * dtype_bytes
        bytes per rank in all."""
        if degree == 1:
            return cost
        latency, per_byte = (float(v) for v in self.comm.terms(degree))
        bytes_per_token = self.dim * self.comm.dtype_bytes / degree
        return cost.at_degree(degree, self.exchanges * latency,
                              self.tensors * per_byte * bytes_per_token)

    def bound(self, max_degree: int) -> GroupBound:
        """The epoch bound's terms where samples may run at degrees 1, 2, ..., `max_degree`."""
        return GroupBound(self, max_degree)


@dataclass(frozen=True)
class GroupBound:
    """What `CostModel.epoch_lower_bound` counts when samples may run in sequence-parallel
    groups of the powers of two up to `max_degree` (docs/definitions.md): each sample's
    least degree `d_min` (the first within the hard limits; 1 where none is: then it runs
    alone somewhere, and one rank keeps the bound a bound), the rank-seconds it takes at
    least (min over d >= d_min of d * w_d, w_d its per-sample time at d) and its least
    time (min of w_d)."""

    sp: SequenceParallel
    max_degree: int

    @property
    def degrees(self) -> list[int]:
        return [1 << k for k in range(self.max_degree.bit_length()) if 1 << k <= self.max_degree]

    def sample_terms(
        self, cost: CostModel, tokens: Any, limits: EpochLimits
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per token count: (rank-seconds at least, least time, d_min, rank units per limit).
        A sample within every limit at some d >= d_min counts, per limit, the least of d_min
        (it may run alone at d_min) and d_fit * use / cap at the first such d_fit; one within
        none counts NaN (it runs alone: d_min rank units, `terms`)."""
        tok = np.asarray(tokens, dtype=np.float64).ravel()
        caps = limits.ceiling
        hard = np.asarray(limits.hard or (False,) * caps.size, dtype=bool)
        uses = {d: limits.at_degree(d).use(tok) for d in self.degrees}
        d_min = np.zeros(tok.size, dtype=np.int64)
        for d in reversed(self.degrees):  # the first degree within the hard limits
            d_min[~((uses[d] > caps) & hard).any(axis=1)] = d
        d_min[d_min == 0] = 1
        work, least = np.full(tok.size, np.inf), np.full(tok.size, np.inf)
        units = np.full((tok.size, caps.size), np.nan)
        for d in self.degrees:
            runs = d >= d_min
            w = self.sp.cost_at(cost, d).per_sample_time(tok)
            work = np.where(runs, np.minimum(work, d * w), work)
            least = np.where(runs, np.minimum(least, w), least)
            fits = runs & np.isnan(units[:, 0]) & ~(uses[d] > caps).any(axis=1)
            units[fits] = np.minimum(d_min[fits, None], d * uses[d][fits] / caps)
        return work, least, d_min, units

    def terms(
        self, cost: CostModel, tokens: np.ndarray, count: np.ndarray, limits: EpochLimits
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """(P_min in rank units, rank-seconds per sample, least time per sample) of the epoch's
        distinct token counts `tokens`, `count` real samples each."""
        work, least, d_min, units = self.sample_terms(cost, tokens, limits)
        n = np.asarray(count, dtype=np.float64)
        alone = np.isnan(units[:, 0])
        volume = (units[~alone] * n[~alone, None]).sum(axis=0)
        packs = int((d_min[alone] * n[alone]).sum()) + math.ceil(float(volume.max(initial=0.0)))
        return packs, work, least


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
    folder = Path(__file__).parent / "calibration" / "shipped"
    return {p.stem: p for p in sorted(folder.glob("*.json"))}


def _finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


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
