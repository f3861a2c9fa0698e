"""Our Wan 2.1 against diffusers' WanTransformer3DModel (the oracle): same weights, same output.

The oracle keeps the 1.3B layout (head dim 128, so RoPE splits 44/42/42; text width 4096;
freq dim 256; qk RMSNorm across heads; affine cross-attention norm) with 2 heads and 2 layers
so it runs on CPU in about a second.
"""

from __future__ import annotations

import pytest
import torch

from adaptiveload.model.architectures import WanConfig
from adaptiveload.model.wan import WanModel
from adaptiveload.model.weights import rename

diffusers_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")

CFG = WanConfig("fidelity", dim=256, ffn_dim=512, num_heads=2, num_layers=2, text_len=24)


def to_ours(key: str) -> str:
    """A diffusers key under our name, by the library's one map (`weights.DIFFUSERS_NAMES`)."""
    new = rename(key, "original")
    if new is None:
        raise KeyError(f"no mapping for diffusers key {key}")
    return new


def build_pair(seed: int = 0) -> tuple[torch.nn.Module, WanModel]:
    torch.manual_seed(seed)
    ref = diffusers_wan.WanTransformer3DModel(
        patch_size=CFG.patch_size,
        num_attention_heads=CFG.num_heads,
        attention_head_dim=CFG.head_dim,
        in_channels=CFG.in_dim,
        out_channels=CFG.out_dim,
        text_dim=CFG.text_dim,
        freq_dim=CFG.freq_dim,
        ffn_dim=CFG.ffn_dim,
        num_layers=CFG.num_layers,
        cross_attn_norm=CFG.cross_attn_norm,
        qk_norm="rms_norm_across_heads",
        eps=CFG.eps,
    ).eval()
    with torch.no_grad():  # move every weight off its init value (norm weights of 1 included)
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ours = WanModel(CFG).eval()
    state = {to_ours(k): v for k, v in ref.state_dict().items()}
    ours.load_state_dict(state, strict=True)  # every key of ours is covered, nothing extra
    return ref, ours


def test_key_mapping_is_a_bijection():
    ref, ours = build_pair()
    mapped = [to_ours(k) for k in ref.state_dict()]
    assert len(set(mapped)) == len(mapped)
    assert set(mapped) == set(ours.state_dict())


def test_matches_diffusers_fp32_cpu():
    torch.set_num_threads(2)
    ref, ours = build_pair()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, CFG.in_dim, 3, 8, 12, generator=gen)  # grid 3x4x6: h != w on purpose
    t = torch.tensor([37.0, 912.0])
    context = torch.randn(2, CFG.text_len, CFG.text_dim, generator=gen)
    with torch.no_grad():
        want = ref(x, t, context, return_dict=False)[0]
        got = ours(x, t, context)
    assert got.shape == want.shape == x.shape
    rel = ((got - want).norm() / want.norm()).item()
    assert rel <= 1e-4, f"relative error {rel:.2e}"
    # the test can fail: a wrong RoPE axis order is caught
    assert want.norm() > 0
