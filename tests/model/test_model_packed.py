"""Packed micro-batches: samples of different shapes as one token stream give exactly what each
sample gives alone (outputs and every parameter gradient, fp32, <= 1e-5 relative), eager and
fused (the op's CPU reference) modulation; and a pack of one shape equals the dense path
(with activation checkpointing: tests/slow/model/test_model_packed_slow.py)."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from packed_cases import (
    MIX,
    RTOL,
    check_one_shape_pack_equals_dense,
    check_packed_equals_alone,
    items,
    micro_wan,
    rel,
)

from adaptiveload.data.packed import collate
from adaptiveload.model import attention as attn
from adaptiveload.model.segments import Segments
from adaptiveload.training.objective import per_sample_loss, step_generator
from adaptiveload.training.settings import ObjectiveConfig

torch.set_num_threads(2)
@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_packed_forward_and_backward_equal_each_sample_alone(impl):
    """Without activation checkpointing (with it: tests/slow/model/)."""
    check_packed_equals_alone(impl, checkpointing=False)


def test_the_oracle_can_fail():
    """One segment's modulation on another's tokens, or attention across segments, moves the
    outputs by over 100 times the tolerance."""
    batch = collate(items(MIX))
    model = micro_wan().eval()
    t = torch.linspace(3.0, 990.0, batch.num_samples)
    with torch.no_grad():
        right = model(list(batch.latents), t, batch.context)
        shifted = model(list(batch.latents), t.roll(1), batch.context)
    assert all(rel(a, b) > 100 * RTOL for a, b in zip(right, shifted, strict=True))
    q = torch.randn(96, 2, 16, generator=torch.Generator().manual_seed(0))
    per_segment = attn.attention(q, q, q, Segments.of([(1, 4, 6), (3, 4, 4)], [2, 1], "cpu"))
    whole = attn.attention(q, q, q, Segments.of([(1, 8, 12)], [1], "cpu"))
    assert rel(per_segment, whole) > 100 * RTOL


def test_a_pack_of_one_shape_equals_the_dense_batch():
    check_one_shape_pack_equals_dense(checkpointing=False)


def test_objective_draws_the_same_noise_for_a_dense_and_a_packed_batch():
    """One shape, same generator: identical sigmas and noise, so equal per-sample losses; a
    mixed pack gets one loss per sample, in segment order."""
    model = micro_wan().eval()
    batch = collate(items([(2, 8, 8)] * 3))
    cfg = ObjectiveConfig()
    with torch.no_grad():
        dense = per_sample_loss(model, batch.dense(), batch.context, cfg, step_generator(0, 1, 2))
        packed = per_sample_loss(
            model, list(batch.latents), batch.context, cfg, step_generator(0, 1, 2)
        )
        mixed = collate(items(MIX))
        losses = per_sample_loss(
            model, list(mixed.latents), mixed.context, cfg, step_generator(0, 1, 2)
        )
    torch.testing.assert_close(packed, dense, rtol=RTOL, atol=0)
    assert losses.shape == (len(MIX),) and torch.isfinite(losses).all()


def test_collate_groups_by_shape_longest_first_and_keeps_item_order():
    batch = collate(items(MIX))
    assert [tuple(g.shape[1:]) for g in batch.latents] == [
        (16, 3, 8, 8), (16, 2, 6, 10), (16, 1, 8, 12), (16, 1, 12, 8), (16, 5, 4, 4),
    ]
    assert [g.shape[0] for g in batch.latents] == [2, 1, 2, 1, 1]
    assert batch.sample_ids == ("s1", "s5", "s4", "s0", "s3", "s2", "s6")
    given = items(MIX)
    position = {it["sample_id"]: i for i, it in enumerate(given)}
    i = 0
    for grp in batch.latents:  # every sample's latent and context sit at its segment
        for j in range(grp.shape[0]):
            item = given[position[batch.sample_ids[i]]]
            assert torch.equal(grp[j], item["latent"])
            assert torch.equal(batch.context[i], item["context"])
            i += 1
    assert not batch.is_dense
    with pytest.raises(ValueError, match="5 latent shapes"):
        batch.dense()
    with pytest.raises(ValueError, match="at least one sample"):
        collate([])
    bad = items([(1, 8, 8), (1, 8, 8)])
    bad[1]["context"] = bad[1]["context"][:3]
    with pytest.raises(ValueError, match="text contexts differ"):
        collate(bad)


def test_segments_layout_and_runs():
    seg = Segments.of([(3, 4, 4), (1, 4, 6), (1, 6, 4), (2, 2, 2)], [2, 1, 3, 1], "cpu")
    assert seg.cu_seqlens.dtype == torch.int32
    assert seg.cu_seqlens.tolist() == [0, 48, 96, 120, 144, 168, 192, 200]
    assert (seg.num_segments, seg.num_tokens, seg.max_seqlen) == (7, 200, 48)
    assert seg.runs == ((2, 48), (4, 24), (1, 8))  # the two 24-token groups merge
    assert seg.cu_rows(5).tolist() == [0, 5, 10, 15, 20, 25, 30, 35]
    parts = seg.split_groups(torch.arange(200))
    assert [tuple(p.shape) for p in parts] == [(2, 48), (1, 24), (3, 24), (1, 8)]
    with pytest.raises(ValueError, match="counts"):
        Segments.of([(1, 2, 2)], [0], "cpu")


def _block_diagonal_reference(q, k, v, lengths):
    """SDPA over the whole stream with a block-diagonal mask: the textbook varlen oracle."""
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seg[:, None] == seg[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
    )
    return out.transpose(0, 1)


def test_sdpa_runs_equal_a_block_diagonal_mask_and_per_segment_cross_attention():
    seg = Segments.of([(3, 4, 4), (1, 4, 6), (1, 6, 4), (1, 2, 3)], [2, 1, 2, 1], "cpu")
    lengths = [48, 48, 24, 24, 24, 6]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(seg.num_tokens, 2, 16, generator=gen) for _ in range(3))
    assert attn.choose_backend("packed", torch.device("cpu")) == "sdpa-runs"
    got = attn.attention(q, k, v, seg)
    assert rel(got, _block_diagonal_reference(q, k, v, lengths)) <= RTOL

    ck, cv = (torch.randn(seg.num_segments, 5, 2, 16, generator=gen) for _ in range(2))
    cross = attn.attention(q, ck, cv, seg)
    starts = seg.cu_seqlens.tolist()
    want = torch.cat([
        attn.attention(q[None, a:b], ck[i : i + 1], cv[i : i + 1])[0]
        for i, (a, b) in enumerate(pairwise(starts))
    ])
    assert rel(cross, want) <= RTOL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
@pytest.mark.parametrize("backend", ["flash-attn-varlen", "torch-varlen"])
def test_cuda_varlen_backends_equal_sdpa_runs(backend):
    """bf16 on a GPU: each varlen kernel against SDPA per run, self- and cross-attention."""
    if backend == "flash-attn-varlen" and attn.flash_attn_varlen_func is None:
        pytest.skip("flash-attn is not installed")
    if backend == "torch-varlen" and attn.varlen_attn is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    device = torch.device("cuda")
    seg = Segments.of([(3, 16, 16), (1, 16, 24), (1, 24, 16), (5, 4, 8)], [2, 1, 3, 1], device)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(seg.num_tokens, 4, 64, generator=gen, device=device,
                           dtype=torch.bfloat16) for _ in range(3))
    ck, cv = (torch.randn(seg.num_segments, 40, 4, 64, generator=gen, device=device,
                          dtype=torch.bfloat16) for _ in range(2))
    for keys, values in ((k, v), (ck, cv)):
        want = attn.PACKED["sdpa-runs"](q, keys, values, seg).float()
        got = attn.PACKED[backend](q, keys, values, seg).float()
        assert rel(got, want) <= 1e-2
