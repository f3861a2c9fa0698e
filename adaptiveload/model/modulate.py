"""The single entry point of every LayerNorm+modulate site in the model.

`y = LayerNorm(x) * (1 + scale) + shift` runs twice per block and once in the head. Routing all
three through `ln_modulate` makes the implementation a runtime switch, so fused vs eager is an
experiment axis rather than a code fork:

- "eager": Wan 2.1's exact op sequence (`adaptiveload.ops.ln_modulate.wan_eager`);
- "fused": the custom op `adaptiveload.ops.ln_modulate.ln_modulate`: the CUDA kernel on CUDA
  tensors when the library is built, its fp32 reference math otherwise (so the switch works
  everywhere; `adaptiveload kernel status` says which runs).

On a packed stream (`Segments`) x is [L, D] and scale/shift hold one row per segment: the
segment forms of the same two, `wan_eager_segments` (Wan's ops after gathering each token's
row) and `ln_modulate_segments` (the kernel reads its segment's row itself, int32
`cu_seqlens`), one call for the whole stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from adaptiveload.model.segments import SegmentLayout
from adaptiveload.ops import ln_modulate as ops

LnModulateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

SegmentsFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor
]

# impl -> (dense form, segment form)
_FNS: dict[str, tuple[LnModulateFn, SegmentsFn]] = {
    "eager": (ops.wan_eager, ops.wan_eager_segments),
    "fused": (ops.ln_modulate, ops.ln_modulate_segments),
}
IMPLS = tuple(_FNS)


def resolve(impl: str) -> tuple[LnModulateFn, SegmentsFn]:
    """The (dense, segment) functions behind `impl`; ValueError naming the choices if unknown."""
    try:
        return _FNS[impl]
    except KeyError:
        raise ValueError(f"unknown ln_modulate_impl '{impl}'; expected one of {IMPLS}") from None


def ln_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    impl: str,
    segments: SegmentLayout | None = None,
) -> torch.Tensor:
    """LayerNorm (no affine, fp32 statistics) of x, modulated per sample; output fp32 like Wan.

    Dense: x [B, S, D], scale/shift [B, 1, D]. Packed: x [L, D], scale/shift [G, 1, D]."""
    dense, per_segment = resolve(impl)
    if segments is None:
        return dense(x, scale, shift, eps).float()
    return per_segment(x, scale[:, 0], shift[:, 0], segments.cu_seqlens, eps).float()


class LnModulate(torch.nn.Module):
    """A parameter-free LN+modulate site (Wan's `norm1`, `norm2`, `head.norm`) with a switch."""

    def __init__(self, eps: float, impl: str = "eager") -> None:
        super().__init__()
        self.eps = eps
        self.impl = impl
        resolve(impl)

    def forward(
        self,
        x: torch.Tensor,
        scale: torch.Tensor,
        shift: torch.Tensor,
        segments: SegmentLayout | None = None,
    ) -> torch.Tensor:
        return ln_modulate(x, scale, shift, self.eps, self.impl, segments)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, impl={self.impl}"
