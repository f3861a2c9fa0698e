"""Wan 2.1 T2V DiT configurations: the one place that states their shapes.

The two released configs are copied from `wan/configs/wan_t2v_{1_3B,14B}.py` plus the HF
`config.json` fields (in/out dim, text length and width). The tiny ones run the *same* code at
CPU scale; they keep Wan's proportions where it matters for the cost model: the token count
at which attention FLOPs equal the linear FLOPs, S* = 3*dim + ffn_dim (14.1k for 1.3B), sits
inside the tiny token range (448 for `wan2.1-tiny`, whose tiny-grid buckets span 16..4096).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from adaptiveload.errors import UserError
from adaptiveload.tokens import LATENT_CHANNELS, PATCH_SIZE


@dataclass(frozen=True)
class WanConfig:
    """Shape of one Wan 2.1 T2V DiT (field names as in the official `WanModel.__init__`)."""

    name: str
    dim: int
    ffn_dim: int
    num_heads: int
    num_layers: int
    freq_dim: int = 256
    in_dim: int = LATENT_CHANNELS
    out_dim: int = LATENT_CHANNELS
    text_len: int = 512
    text_dim: int = 4096
    patch_size: tuple[int, int, int] = PATCH_SIZE
    eps: float = 1e-6
    qk_norm: bool = True
    cross_attn_norm: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"{self.name}: dim {self.dim} not divisible by {self.num_heads} heads")
        if self.head_dim % 2 or self.head_dim < 6:
            raise ValueError(f"{self.name}: head dim {self.head_dim} must be even and >= 6 (RoPE)")
        if self.freq_dim % 2:
            raise ValueError(f"{self.name}: freq_dim must be even")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Real channels of each head given to the (time, height, width) RoPE axes.

        Wan's rule: d - 4*(d//6), 2*(d//6), 2*(d//6); 44/42/42 for head dim 128.
        """
        d = self.head_dim
        return d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["patch_size"] = list(self.patch_size)
        return out


CONFIGS: dict[str, WanConfig] = {
    c.name: c
    for c in (
        WanConfig("wan2.1-t2v-1.3b", dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
        WanConfig("wan2.1-t2v-14b", dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
        # CPU default: 2 heads of 32 (RoPE 12/10/10), S* = 3*64 + 256 = 448 tokens
        WanConfig(
            "wan2.1-tiny", dim=64, ffn_dim=256, num_heads=2, num_layers=2, text_len=16, text_dim=64
        ),
        # unit tests: 2 heads of 16 (RoPE 8/4/4)
        WanConfig(
            "wan2.1-micro",
            dim=32,
            ffn_dim=64,
            num_heads=2,
            num_layers=1,
            freq_dim=32,
            text_len=8,
            text_dim=32,
        ),
    )
}


def get_config(name: str) -> WanConfig:
    """The registered config `name`; UserError listing the known names otherwise."""
    try:
        return CONFIGS[name]
    except KeyError:
        raise UserError(
            f"unknown model config '{name}'; expected one of: {', '.join(CONFIGS)}"
        ) from None
