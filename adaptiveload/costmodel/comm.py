"""Sequence-parallel communication: the Ulysses all-to-all model of a device (`CommModel`),
what a set costs one rank of a group of d ranks (`SequenceParallel.cost_at`, the form in
`costmodel.cost`'s docstring) and the epoch bound's terms where samples may run in groups
(`GroupBound`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from adaptiveload.costmodel.cost import CostModel, EpochLimits, _finite_number
from adaptiveload.errors import UserError
from adaptiveload.model.analytic import compute_bytes

if TYPE_CHECKING:
    from adaptiveload.costmodel.calibration import Calibration


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

