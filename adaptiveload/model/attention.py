"""Dense attention over [B, L, heads, head_dim]: FlashAttention on CUDA when installed, else SDPA.

One bucket shape per micro-batch means no padding, so no masks or varlen bookkeeping.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # optional: `pip install adaptiveload[flash]`
    from flash_attn import flash_attn_func
except ImportError:  # pragma: no cover - depends on the environment
    flash_attn_func = None

HALF = (torch.float16, torch.bfloat16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v, q/k/v [B, L, heads, head_dim] -> [B, Lq, heads, head_dim].

    q and k arrive in fp32 (after RMSNorm and RoPE); like Wan they are cast to v's dtype (bf16
    under autocast) and FlashAttention gets bf16 whatever the inputs.
    """
    q, k = q.to(v.dtype), k.to(v.dtype)
    if flash_attn_func is not None and q.is_cuda:
        dtype = v.dtype if v.dtype in HALF else torch.bfloat16
        out = flash_attn_func(q.to(dtype), k.to(dtype), v.to(dtype))
        return out.to(v.dtype)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)
