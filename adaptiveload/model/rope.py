"""Wan 2.1's 3D rotary position embedding.

Each head's channels are split into (time, height, width) parts (`WanConfig.rope_split`), each
with its own frequency ladder theta^(-2i/d_axis); positions start at 0 on every axis of the
sample's own latent grid (F', H', W'). Channel pairs (2i, 2i+1) rotate together, as in Wan's
`view_as_complex`. Wan multiplies in float64 and casts to fp32; we build the angles in float64
and rotate in fp32 (the difference is ~1e-7 relative).
"""

from __future__ import annotations

import torch

THETA = 10000.0


def rope_angles(
    grid: tuple[int, int, int], split: tuple[int, int, int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, head_dim/2] (fp32) for the tokens of a (F', H', W') grid in f,h,w order."""
    axes = []
    for n, d, shape in zip(grid, split, _broadcast_shapes(grid), strict=True):
        freqs = THETA ** (-torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
        pos = torch.arange(n, dtype=torch.float64, device=device)
        axes.append(torch.outer(pos, freqs).view(*shape, d // 2).expand(*grid, d // 2))
    angles = torch.cat(axes, dim=-1).reshape(-1, sum(split) // 2)
    return angles.cos().float(), angles.sin().float()


def _broadcast_shapes(grid: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    f, h, w = grid
    return [(f, 1, 1), (1, h, 1), (1, 1, w)]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, S, heads, head_dim] by the angles [S, head_dim/2]; returns fp32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
