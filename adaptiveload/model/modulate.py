"""The single entry point of every LayerNorm+modulate site in the model.

`y = LayerNorm(x) * (1 + scale) + shift` runs twice per block and once in the head. Routing all
three through `ln_modulate` makes the implementation a runtime switch, so fused vs eager is an
experiment axis rather than a code fork:

- "eager": Wan 2.1's exact op sequence (`adaptiveload.ops.ln_modulate.wan_eager`);
- "fused": the CUDA kernel (`adaptiveload.ops.ln_modulate.ln_modulate`), imported lazily so
  the model works where the kernel was never built.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from adaptiveload.ops import ln_modulate as ops

IMPLS = ("eager", "fused")

LnModulateFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def resolve(impl: str) -> LnModulateFn:
    """The function behind `impl`; a clear error if it is unknown or the kernel is unavailable."""
    if impl == "eager":
        return ops.wan_eager
    if impl == "fused":
        fused = getattr(ops, "ln_modulate", None)
        if fused is None:
            raise RuntimeError(
                "ln_modulate_impl='fused' requested but adaptiveload.ops.ln_modulate.ln_modulate "
                "is not available; build the kernel (`adaptiveload kernel build`) or use 'eager'"
            )
        return fused
    raise ValueError(f"unknown ln_modulate_impl '{impl}'; expected one of {IMPLS}")


def ln_modulate(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float, impl: str
) -> torch.Tensor:
    """LayerNorm (no affine, fp32 statistics) of x, modulated per sample; output fp32 like Wan."""
    return resolve(impl)(x, scale, shift, eps).float()


class LnModulate(torch.nn.Module):
    """A parameter-free LN+modulate site (Wan's `norm1`, `norm2`, `head.norm`) with a switch."""

    def __init__(self, eps: float, impl: str = "eager") -> None:
        super().__init__()
        self.eps = eps
        self.impl = impl
        resolve(impl)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        return ln_modulate(x, scale, shift, self.eps, self.impl)

    def extra_repr(self) -> str:
        return f"eps={self.eps}, impl={self.impl}"
