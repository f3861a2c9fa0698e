"""Packed token streams for the segment-layout tests of the ln_modulate op on CPU: the
offsets of a pack of segment lengths, a pack of random inputs, and the fp64 gradcheck both
lanes run (tests/ops/ on a small pack, tests/slow/ops/ on a longer one)."""

from __future__ import annotations

import torch

from adaptiveload.ops import ln_modulate as lm


def offsets(lengths) -> torch.Tensor:
    """cu_seqlens of segments of `lengths`: int32 [G + 1], starting at 0."""
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)


def pack(lengths, d, dtype=torch.float32, mod_dtype=torch.float32, seed=0):
    """(x [L, D], scale [G, D], shift [G, D], cu_seqlens) of random values, seeded."""
    gen = torch.Generator().manual_seed(seed)
    cu = offsets(lengths)
    x = (torch.randn(int(cu[-1]), d, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
    g = len(lengths)
    scale = (0.3 * torch.randn(g, d, generator=gen, dtype=torch.float64)).to(mod_dtype)
    shift = (0.3 * torch.randn(g, d, generator=gen, dtype=torch.float64)).to(mod_dtype)
    return x, scale, shift, cu


def gradcheck_fp64(lengths) -> bool:
    """torch.autograd.gradcheck of the segment op on an fp64 pack of `lengths` (D = 16)."""
    x, scale, shift, cu = pack(lengths, 16, torch.float64, torch.float64, seed=5)
    leaves = tuple(t.requires_grad_() for t in (x, scale, shift))
    return torch.autograd.gradcheck(lambda *a: lm.ln_modulate_segments(*a, cu), leaves)
