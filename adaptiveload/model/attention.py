"""Attention over a dense micro-batch or a packed token stream, on a backend chosen once.

Dense (one bucket shape, no padding, no masks): q/k/v [B, L, heads, head_dim], FlashAttention
(`flash_attn_func`) on CUDA when installed, else PyTorch SDPA.

Packed (a `SegmentLayout`: `Segments`, or a rank's `Chunks` under sequence parallelism): q
[L, heads, head_dim] holds every segment's queries; keys and values are either per token,
[L, heads, head_dim] (self-attention: each segment attends to itself), or per segment,
[G, L_k, heads, head_dim] (cross-attention: each segment attends to its own text context).
Backends, the first that applies (`choose_backend`; a training run chooses once, in its
`Execution`, which the model runs and the run's tags record):

- ``flash-attn-varlen``: flash-attn's `flash_attn_varlen_func`, when installed, on CUDA;
- ``torch-varlen``: torch's own `torch.nn.attention.varlen.varlen_attn` (its flash/cuDNN
  kernels), on CUDA, where this torch has it (2.14 does);
- ``sdpa-runs``: SDPA once per run of equal-length segments, batched as a dense [n, S] call
  (a call per segment only where lengths differ). Everywhere, CPU included. A dense block
  mask over the stream, or FlexAttention, would compute the masked-out L^2 scores (slower
  on CPU) and FlexAttention has no CPU backward.

The CUDA kernels take fp16/bf16: like Wan, q and k are cast to v's dtype (bf16 under
autocast) and anything else to bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaptiveload.model.segments import SegmentLayout

try:  # optional: `pip install adaptiveload[flash]`
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = flash_attn_varlen_func = None

try:  # torch's own varlen attention (CUDA flash kernels); absent in older torch
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch version
    varlen_attn = None

HALF = (torch.float16, torch.bfloat16)
# dense: one bucket shape per micro-batch, a [B, C, T', H', W'] tensor; packed: any shapes as
# one token stream (docs/packing.md)
LAYOUTS = ("dense", "packed")


def choose_backend(layout: str, device: torch.device) -> str:
    """The attention backend for micro-batches of `layout` on `device` (module docstring):
    the one home of the choice."""
    if layout == "dense":
        return "flash-attn" if flash_attn_func is not None and device.type == "cuda" else "sdpa"
    if device.type == "cuda":
        if flash_attn_varlen_func is not None:
            return "flash-attn-varlen"
        if varlen_attn is not None:
            return "torch-varlen"
    return "sdpa-runs"


@dataclass(frozen=True)
class Execution:
    """How a run feeds and computes its micro-batches, decided once from its config and
    device: the layout of the model's input and the attention backend it runs on. The model
    runs exactly this backend and the run's tags record it, so the two cannot disagree."""

    layout: str
    attention: str

    @classmethod
    def on(cls, layout: str, device: torch.device) -> Execution:
        if layout not in LAYOUTS:
            raise ValueError(f"layout '{layout}': expected one of {LAYOUTS}")
        return cls(layout, choose_backend(layout, device))

    @property
    def packed(self) -> bool:
        return self.layout == "packed"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: SegmentLayout | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v per sample; returns q's layout.

    Dense (`segments` None): q/k/v [B, L, heads, head_dim]. Packed: q [L, heads, head_dim];
    k/v per token (self-attention within each segment) or per segment [G, L_k, heads,
    head_dim] (cross-attention to each segment's own keys). q and k arrive in fp32 (after
    RMSNorm and RoPE); like Wan they are cast to v's dtype. `backend`: the run's choice
    (`Execution.attention`); None chooses for this call's layout and device.
    """
    q, k = q.to(v.dtype), k.to(v.dtype)
    layout, table = ("dense", DENSE) if segments is None else ("packed", PACKED)
    backend = backend or choose_backend(layout, q.device)
    if backend not in table:
        raise ValueError(f"attention backend '{backend}' does not run a {layout} micro-batch")
    return table[backend](q, k, v) if segments is None else table[backend](q, k, v, segments)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on [B, L, heads, head_dim] (it wants heads before length)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def _half(fn: Callable[..., torch.Tensor], q, k, v, *args) -> torch.Tensor:
    """`fn` on fp16/bf16 copies (the CUDA kernels' dtypes), the result back in v's dtype."""
    dtype = v.dtype if v.dtype in HALF else torch.bfloat16
    return fn(q.to(dtype), k.to(dtype), v.to(dtype), *args).to(v.dtype)


def _varlen_args(k: torch.Tensor, segments: SegmentLayout) -> tuple:
    """Keys flattened to one stream, and (cu_q, cu_k, max_q, max_k) for a varlen kernel."""
    if k.dim() == 4:  # per segment: G contexts of L_k keys each
        cu_k, max_k = segments.cu_rows(k.shape[1]), k.shape[1]
        return k.flatten(0, 1), (segments.cu_seqlens, cu_k, segments.max_seqlen, max_k)
    cu, m = segments.cu_seqlens, segments.max_seqlen
    return k, (cu, cu, m, m)


def _flash_attn_varlen(q, k, v, segments: SegmentLayout) -> torch.Tensor:
    k_flat, args = _varlen_args(k, segments)
    v_flat, _ = _varlen_args(v, segments)
    return _half(flash_attn_varlen_func, q, k_flat, v_flat, *args)


def _torch_varlen(q, k, v, segments: SegmentLayout) -> torch.Tensor:
    k_flat, args = _varlen_args(k, segments)
    v_flat, _ = _varlen_args(v, segments)
    return _half(varlen_attn, q, k_flat, v_flat, *args)


def _sdpa_runs(q, k, v, segments: SegmentLayout) -> torch.Tensor:
    if k.dim() == 4:  # cross-attention: the run's queries against its segments' own keys
        return segments.per_run(_sdpa, [q], [k, v])
    return segments.per_run(_sdpa, [q, k, v])


def _flash_attn(q, k, v) -> torch.Tensor:
    return _half(flash_attn_func, q, k, v)


DENSE: dict[str, Callable[..., torch.Tensor]] = {"flash-attn": _flash_attn, "sdpa": _sdpa}
PACKED: dict[str, Callable[..., torch.Tensor]] = {
    "flash-attn-varlen": _flash_attn_varlen,
    "torch-varlen": _torch_varlen,
    "sdpa-runs": _sdpa_runs,
}
