"""The cost of a set at a sequence-parallel degree: its one formula against a hand count,
degree 1 equal to today's cost exactly, the all-to-all model (the calibration's `comm` section
and the analytic prior) and the epoch bound over groups."""

from __future__ import annotations

import json

import numpy as np
import pytest

from adaptiveload.costmodel import (
    ALL_TO_ALLS_PER_PASS,
    INFINIBAND_BYTES_PER_S,
    NVLINK_BYTES_PER_S,
    Calibration,
    CommModel,
    CostModel,
    EpochLimits,
    SequenceParallel,
)
from adaptiveload.errors import UserError

COST = CostModel(c0=0.05, a=2e-5, b=1e-9, m_static=2e10, m_tok=2e5, m_seq=5e7, c_seq=1e-3,
                 t_floor=0.2)
MEASURED = {
    "source": "measured", "backend": "nccl", "device": "cuda:NVIDIA H200", "dtype_bytes": 2,
    "links": [{"degree": 2, "latency_s": 3e-5, "bytes_per_s": 3e11},
              {"degree": 8, "latency_s": 5e-5, "bytes_per_s": 2e11}],
    "points": [{"degree": 2, "bytes": 1048576, "seconds": 0.00041}],
}


def _calibration(**extra: object) -> Calibration:
    return Calibration("wan2.1-t2v-14b", "dev", "model", COST, p=1.3, m_mem=1e5, m_comp=1e7,
                       capacity_bytes=1e11, extra=dict(extra))


def test_degree_one_is_todays_cost_exactly():
    sp = SequenceParallel.of(_calibration())
    assert sp.cost_at(COST, 1) is COST and COST.at_degree(1) is COST
    n, s, sq = np.array([1, 3, 7]), np.array([900, 40_000, 150_000]), np.array([8.1e5, 9e8, 5e9])
    assert np.array_equal(sp.cost_at(COST, 1).pack_time(n, s, sq), COST.pack_time(n, s, sq))
    assert np.array_equal(sp.cost_at(COST, 1).pack_memory(n, s), COST.pack_memory(n, s))


def test_the_cost_of_a_set_at_degree_d_is_the_documented_formula():
    """Compute over d (c0, the floor and c_seq whole), per block and pass one all-to-all of
    q, k, v (3 tensors of ΣS/d * dim * e bytes) and one of the output, per-rank memory with
    m_tok over d and m_static, m_seq whole."""
    cal = _calibration(setup={"activation_checkpointing": True})
    sp = SequenceParallel.of(cal)
    assert (sp.num_layers, sp.dim, sp.num_heads, sp.passes) == (40, 5120, 40, 3)
    assert sp.exchanges == 40 * ALL_TO_ALLS_PER_PASS * 3 == 240 and sp.tensors == 480
    tokens = np.array([111_600.0, 3_600.0, 1_560.0])
    n, s, sq = tokens.size, tokens.sum(), float((tokens**2).sum())
    for d in (2, 4, 8, 16):
        one = s / d * 5120 * 2  # one [L_r, dim] bf16 tensor of the rank's tokens
        per_block_pass = float(sp.comm.all_to_all_s(d, 3 * one) + sp.comm.all_to_all_s(d, one))
        comm = 40 * 3 * per_block_pass
        compute = COST.c0 + COST.c_seq * n + (COST.a * s + COST.b * sq) / d
        at = sp.cost_at(COST, d)
        assert at.set_time(tokens) == pytest.approx(max(COST.t_floor, compute + comm), rel=1e-12)
        want = COST.m_static + COST.m_tok * s / d + COST.m_seq * n
        assert at.set_memory(tokens) == pytest.approx(want, rel=1e-12)
    # a larger degree holds a d-th of the tokens, pays the exchanges, and is faster here
    times = [sp.cost_at(COST, d).set_time(tokens) for d in (1, 2, 4, 8)]
    assert times == sorted(times, reverse=True)
    assert sp.cost_at(COST, 2).set_time(tokens) > COST.set_time(tokens) / 2  # comm and c0


def test_the_floor_hides_the_exchange_of_a_tiny_set():
    sp = SequenceParallel.of(_calibration())
    assert sp.cost_at(COST, 4).set_time([16]) == COST.t_floor


def test_comm_links_take_the_next_larger_measured_degree_and_the_largest_above():
    comm = CommModel.from_dict(MEASURED, "cal.json")
    n = 8e6
    assert comm.all_to_all_s(1, n) == 0.0
    assert comm.all_to_all_s(2, n) == pytest.approx(3e-5 + n * (1 / 2) / 3e11)
    assert comm.all_to_all_s(4, n) == pytest.approx(5e-5 + n * (3 / 4) / 2e11)  # the 8's link
    assert comm.all_to_all_s(16, n) == pytest.approx(5e-5 + n * (15 / 16) / 2e11)  # above: 8's
    grid = comm.all_to_all_s(np.array([1, 2, 8]), np.array([n, n, 2 * n]))
    assert grid.shape == (3,) and grid[0] == 0 and grid[2] > grid[1]
    assert CommModel.from_dict(comm.to_dict(), "again") == comm
    assert json.loads(json.dumps(comm.to_dict())) == MEASURED


def test_the_prior_is_nvlink_in_a_node_and_the_boundary_share_across():
    prior = CommModel.prior()
    assert prior.source == "model" and prior.backend == "prior"
    by = {k.degree: k for k in prior.links}
    assert by[8].bytes_per_s == NVLINK_BYTES_PER_S
    # d = 16 over two nodes of 8: half of each rank's bytes cross at the NIC's rate
    assert by[16].bytes_per_s == pytest.approx(INFINIBAND_BYTES_PER_S * 15 / 8)
    n = 1e9
    crossing = n * 8 / 16 / INFINIBAND_BYTES_PER_S
    assert prior.all_to_all_s(16, n) == pytest.approx(by[16].latency_s + crossing)
    slower = CommModel.prior(inter_node_bytes_per_s=INFINIBAND_BYTES_PER_S / 2)
    assert slower.all_to_all_s(16, n) > prior.all_to_all_s(16, n)
    assert slower.all_to_all_s(8, n) == prior.all_to_all_s(8, n)


@pytest.mark.parametrize(("field", "value"), [
    ("source", "guessed"), ("backend", "mpi"), ("device", 3), ("dtype_bytes", 0),
    ("links", []), ("links", [{"degree": 1, "latency_s": 0, "bytes_per_s": 1}]),
    ("links", [{"degree": 2, "latency_s": -1, "bytes_per_s": 1}]),
    ("links", [{"degree": 2, "latency_s": 0, "bytes_per_s": float("nan")}]),
    ("links", [{"degree": 2, "latency_s": 0, "bytes_per_s": 1}] * 2),
    ("points", {"degree": 2}),
])
def test_a_bad_comm_section_is_refused_naming_its_field(field, value):
    with pytest.raises(UserError) as info:
        CommModel.from_dict({**MEASURED, field: value}, "cal.json")
    message = str(info.value)
    assert message.startswith(f"cal.json: field 'comm.{field}") and "\n" not in message
    with pytest.raises(UserError, match="field 'comm"):  # on load, named by the file
        Calibration.from_dict({**_calibration().to_dict(), "comm": {**MEASURED, field: value}},
                              origin="cal.json")


def test_a_calibration_carries_its_comm_section_or_none():
    assert _calibration().comm is None
    assert SequenceParallel.of(_calibration()).comm == CommModel.prior()
    cal = Calibration.from_dict({**_calibration().to_dict(), "comm": MEASURED})
    assert cal.comm == CommModel.from_dict(MEASURED) and SequenceParallel.of(cal).comm == cal.comm


@pytest.mark.parametrize(("model", "world_size", "largest"), [
    ("wan2.1-t2v-14b", 16, 8), ("wan2.1-t2v-14b", 4, 4), ("wan2.1-t2v-14b", 12, 4),
    ("wan2.1-t2v-1.3b", 256, 4), ("wan2.1-t2v-1.3b", 6, 2), ("wan2.1-tiny", 64, 2),
    ("wan2.1-t2v-14b", 1, 1),
])
def test_the_largest_degree_divides_the_heads_and_the_world_size(model, world_size, largest):
    cal = Calibration(model, "dev", "model", COST, p=1.3, m_mem=1e5, m_comp=1e7)
    assert SequenceParallel.of(cal).max_degree(world_size) == largest


def _limits() -> EpochLimits:
    """Memory (hard: 2e5 bytes a token, 5e7 a sample, 6e10 usable) and compute (S^1.3)."""
    return EpochLimits(per_token=(2e5, 1.0), power=(1.0, 1.3), per_sample=(5e7, 0.0),
                       caps=(6e10, 1e7), hard=(True, False))


def test_the_group_bound_at_degree_one_is_todays_bound():
    sp = SequenceParallel.of(_calibration())
    rng = np.random.default_rng(3)
    tokens = np.unique(rng.integers(500, 250_000, 40))
    count = rng.integers(1, 50, tokens.size)
    today = COST.epoch_lower_bound(tokens, count, _limits(), 16, 0.5)
    one = COST.epoch_lower_bound(tokens, count, _limits(), 16, 0.5, sp.bound(1))
    assert one.steps == today.steps and one.seconds == pytest.approx(today.seconds, rel=1e-12)


def test_the_group_bound_counts_rank_units_and_the_least_time():
    """Samples of 1.5M tokens fit no fewer than 8 ranks (memory: 3e11 / d + 5e7 <= 6e10):
    the bound counts 8 rank units each and the time at the fastest allowed degree."""
    sp = SequenceParallel.of(_calibration())
    limits, big = _limits(), np.array([1_500_000.0])
    work, least, d_min, _ = sp.bound(8).sample_terms(COST, big, limits)
    assert d_min[0] == 8
    assert least[0] == pytest.approx(sp.cost_at(COST, 8).per_sample_time(big)[0])
    assert work[0] == pytest.approx(8 * least[0])
    bound = COST.epoch_lower_bound(big, [32], limits, 16, 0.0, sp.bound(8))
    assert bound.steps == 16  # 32 samples x 8 ranks over 16 ranks a step
    # a plan that runs them 2 a step at degree 8 reaches it within the per-step fixed cost
    plan_s = 16 * sp.cost_at(COST, 8).set_time(big)
    assert bound.seconds <= plan_s <= bound.seconds * 1.01
