"""Packed micro-batches: samples of different shapes as one token stream give exactly what each
sample gives alone (outputs and every parameter gradient, fp32, <= 1e-5 relative), with and
without activation checkpointing, eager and fused (the op's CPU reference) modulation; and a
pack of one shape equals the dense path."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from adaptiveload.data.packed import collate
from adaptiveload.model import attention as attn
from adaptiveload.model.architectures import get_config
from adaptiveload.model.segments import Segments
from adaptiveload.model.wan import WanModel
from adaptiveload.training.objective import per_sample_loss, step_generator
from adaptiveload.training.settings import ObjectiveConfig

torch.set_num_threads(2)
CFG = get_config("wan2.1-micro")
RTOL = 1e-5
# latent [C, T', H', W'] shapes: images and clips; (1, 8, 12) and (1, 12, 8) both give 24
# tokens on different grids (one attention run of two shape groups), 48, 30 and 20 others
MIX = [(1, 8, 12), (3, 8, 8), (1, 12, 8), (1, 8, 12), (2, 6, 10), (3, 8, 8), (5, 4, 4)]


def _model(impl: str = "eager", checkpointing: bool = False, seed: int = 0) -> WanModel:
    torch.manual_seed(seed)
    model = WanModel(CFG, ln_modulate_impl=impl, activation_checkpointing=checkpointing)
    with torch.no_grad():  # Wan zero-inits the head, which would hide every upstream gradient
        model.head.head.weight.normal_(std=0.02)
    return model


def _items(shapes: list[tuple[int, int, int]], seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "sample_id": f"s{i}",
            "latent": torch.randn(CFG.in_dim, *shape, generator=gen),
            "context": torch.randn(CFG.text_len, CFG.text_dim, generator=gen),
        }
        for i, shape in enumerate(shapes)
    ]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().norm() / want.detach().norm())


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _packed_and_alone(impl: str, checkpointing: bool):
    """(outputs, grads) of the packed batch and of every sample run alone (dense, B = 1),
    each under the loss sum_i <out_i, w_i> with fixed random weights w_i."""
    batch = collate(_items(MIX))
    g = batch.num_samples
    t = torch.linspace(3.0, 990.0, g)
    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(grp.shape, generator=gen) for grp in batch.latents]

    model = _model(impl, checkpointing)
    packed = model(list(batch.latents), t, batch.context)
    sum((out * w).sum() for out, w in zip(packed, weights, strict=True)).backward()
    packed_grads = _grads(model)

    model.zero_grad(set_to_none=True)
    alone, i = [], 0
    for grp, w in zip(batch.latents, weights, strict=True):
        outs = []
        for j in range(grp.shape[0]):
            out = model(grp[j : j + 1], t[i : i + 1], batch.context[i : i + 1])
            (out * w[j : j + 1]).sum().backward()  # gradients accumulate over samples
            outs.append(out)
            i += 1
        alone.append(torch.cat(outs))
    return packed, packed_grads, alone, _grads(model)


@pytest.mark.parametrize(
    "checkpointing",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # the fast lane: without checkpointing
    ids=["plain", "checkpointed"],
)
@pytest.mark.parametrize("impl", ["eager", "fused"])
def test_packed_forward_and_backward_equal_each_sample_alone(impl, checkpointing):
    packed, packed_grads, alone, alone_grads = _packed_and_alone(impl, checkpointing)
    assert [tuple(p.shape) for p in packed] == [tuple(a.shape) for a in alone]
    assert len(packed) == 5  # shape groups: 48, 30, 24 (two grids), 20 tokens
    for got, want in zip(packed, alone, strict=True):
        assert got.dtype == torch.float32 and _rel(got, want) <= RTOL
    assert set(packed_grads) == set(alone_grads)
    worst = max(_rel(packed_grads[n], alone_grads[n]) for n in alone_grads)
    assert worst <= RTOL, worst
    assert all(g.any() for g in alone_grads.values())  # every parameter takes part


def test_the_oracle_can_fail():
    """One segment's modulation on another's tokens, or attention across segments, moves the
    outputs by over 100 times the tolerance."""
    batch = collate(_items(MIX))
    model = _model().eval()
    t = torch.linspace(3.0, 990.0, batch.num_samples)
    with torch.no_grad():
        right = model(list(batch.latents), t, batch.context)
        shifted = model(list(batch.latents), t.roll(1), batch.context)
    assert all(_rel(a, b) > 100 * RTOL for a, b in zip(right, shifted, strict=True))
    q = torch.randn(96, 2, 16, generator=torch.Generator().manual_seed(0))
    per_segment = attn.attention(q, q, q, Segments.of([(1, 4, 6), (3, 4, 4)], [2, 1], "cpu"))
    whole = attn.attention(q, q, q, Segments.of([(1, 8, 12)], [1], "cpu"))
    assert _rel(per_segment, whole) > 100 * RTOL


@pytest.mark.parametrize(
    "checkpointing",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # the fast lane: without checkpointing
    ids=["plain", "checkpointed"],
)
def test_a_pack_of_one_shape_equals_the_dense_batch(checkpointing):
    batch = collate(_items([(3, 8, 12)] * 3))
    assert batch.is_dense
    t = torch.tensor([11.0, 500.0, 977.0])
    results = []
    for packed in (False, True):
        model = _model(checkpointing=checkpointing)
        x = list(batch.latents) if packed else batch.dense()
        out = model(x, t, batch.context)
        out = out[0] if packed else out
        out.square().mean().backward()
        results.append((out, _grads(model)))
    (dense, dense_grads), (packed, packed_grads) = results
    assert _rel(packed, dense) <= RTOL
    assert max(_rel(packed_grads[n], dense_grads[n]) for n in dense_grads) <= RTOL


def test_objective_draws_the_same_noise_for_a_dense_and_a_packed_batch():
    """One shape, same generator: identical sigmas and noise, so equal per-sample losses; a
    mixed pack gets one loss per sample, in segment order."""
    model = _model().eval()
    batch = collate(_items([(2, 8, 8)] * 3))
    cfg = ObjectiveConfig()
    with torch.no_grad():
        dense = per_sample_loss(model, batch.dense(), batch.context, cfg, step_generator(0, 1, 2))
        packed = per_sample_loss(
            model, list(batch.latents), batch.context, cfg, step_generator(0, 1, 2)
        )
        mixed = collate(_items(MIX))
        losses = per_sample_loss(
            model, list(mixed.latents), mixed.context, cfg, step_generator(0, 1, 2)
        )
    torch.testing.assert_close(packed, dense, rtol=RTOL, atol=0)
    assert losses.shape == (len(MIX),) and torch.isfinite(losses).all()


def test_collate_groups_by_shape_longest_first_and_keeps_item_order():
    batch = collate(_items(MIX))
    assert [tuple(g.shape[1:]) for g in batch.latents] == [
        (16, 3, 8, 8), (16, 2, 6, 10), (16, 1, 8, 12), (16, 1, 12, 8), (16, 5, 4, 4),
    ]
    assert [g.shape[0] for g in batch.latents] == [2, 1, 2, 1, 1]
    assert batch.sample_ids == ("s1", "s5", "s4", "s0", "s3", "s2", "s6")
    items = _items(MIX)
    position = {it["sample_id"]: i for i, it in enumerate(items)}
    i = 0
    for grp in batch.latents:  # every sample's latent and context sit at its segment
        for j in range(grp.shape[0]):
            item = items[position[batch.sample_ids[i]]]
            assert torch.equal(grp[j], item["latent"])
            assert torch.equal(batch.context[i], item["context"])
            i += 1
    assert not batch.is_dense
    with pytest.raises(ValueError, match="5 latent shapes"):
        batch.dense()
    with pytest.raises(ValueError, match="at least one sample"):
        collate([])
    bad = _items([(1, 8, 8), (1, 8, 8)])
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
    assert _rel(got, _block_diagonal_reference(q, k, v, lengths)) <= RTOL

    ck, cv = (torch.randn(seg.num_segments, 5, 2, 16, generator=gen) for _ in range(2))
    cross = attn.attention(q, ck, cv, seg)
    starts = seg.cu_seqlens.tolist()
    want = torch.cat([
        attn.attention(q[None, a:b], ck[i : i + 1], cv[i : i + 1])[0]
        for i, (a, b) in enumerate(pairwise(starts))
    ])
    assert _rel(cross, want) <= RTOL


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
        assert _rel(got, want) <= 1e-2
