"""LayerNorm-Modulate: ``y = LayerNorm(x) * (1 + scale) + shift`` (no affine, eps 1e-6, fp32 stats).

Three implementations of one op:
- `wan_eager`: Wan 2.1's exact eager op sequence (the unfused baseline of benchmarks and the
  model's `eager` switch);
- `reference`: fp32 math in plain PyTorch ops, the CPU fallback and the tests' oracle;
- the fused CUDA kernel (`kernels/`), registered as a torch.library custom op when built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-6


def wan_eager(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """As `wan/modules/model.py` does it: fp32 LayerNorm, cast back, upcast, modulate (fp32 out)."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)
    return normed.float() * (1 + scale) + shift


def reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """fp32 statistics and math, output in x's dtype: the semantics the fused kernel matches."""
    y = F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale.float()) + shift.float()
    return y.to(x.dtype)
