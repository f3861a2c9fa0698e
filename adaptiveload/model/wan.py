"""Wan 2.1 text-to-video DiT, written to be read top to bottom (after nanoGPT).

Faithful to `wan/modules/model.py` of Wan-Video/Wan2.1: module names, block order, dtypes and
initialisation follow it, so its state dict keys are the original checkpoints' (diffusers' map
1:1 onto them: `weights.DIFFUSERS_NAMES`). Differences, all systems-level:

- a micro-batch comes in one of two layouts. Dense: ONE bucket shape, x a dense
  [B, C, T', H', W'] tensor, no padding, no per-sample loops, no `seq_len` argument. Packed:
  a list of such tensors of different shapes, whose samples run as one token stream
  [L, dim] (`segments.Segments`): patch embedding and unpatchify per shape group, RoPE per
  grid, per-sample modulation per segment, varlen self-attention, each segment's queries
  against its own text context. Text contexts arrive dense [B (or G), L, text_dim]. A packed
  micro-batch may run over a sequence-parallel group (`sp_group`, `sequence_parallel.py`):
  each rank computes the blocks on its chunk of every segment, self-attention head-sharded;
- every LayerNorm+modulate goes through `LnModulate` (eager or fused kernel, a runtime switch);
- attention is flash-attn on CUDA when installed, else torch's own (varlen for a packed
  batch on CUDA, SDPA otherwise), chosen at run time (`attention.py`);
- optional activation checkpointing per block.

Dtypes as in Wan under bf16 autocast: time embedding, modulation, LayerNorm statistics, the
gated residual updates and the head run in fp32, so the residual stream is fp32; the Linears,
the patch embedding and attention run in the autocast dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from adaptiveload.model.architectures import WanConfig
from adaptiveload.model.attention import Execution, attention, choose_backend
from adaptiveload.model.modulate import LnModulate, resolve
from adaptiveload.model.rope import apply_rope, rope_angles
from adaptiveload.model.segments import Grid, SegmentLayout, Segments
from adaptiveload.model.sequence_parallel import SequenceShard, degree_of, shard_over

Latents = torch.Tensor | Sequence[torch.Tensor]  # dense [B, C, T', H', W'], or packed groups


def fp32_region(x: torch.Tensor) -> torch.autocast:
    """Wan's `amp.autocast(dtype=float32)` regions: no down-casting inside."""
    return torch.autocast(x.device.type, enabled=False)


def gated(y: torch.Tensor, gate: torch.Tensor, segments: SegmentLayout | None) -> torch.Tensor:
    """y * gate, each sample's tokens by its own gate row ([B or G, 1, dim])."""
    return y * gate if segments is None else segments.per_run(torch.mul, [y], [gate])


def sinusoidal_embedding(dim: int, t: torch.Tensor) -> torch.Tensor:
    """[cos, sin] of t * 10000^(-i/half), computed in float64 as Wan does; returns fp32 [B, dim]."""
    half = dim // 2
    pos = t.to(torch.float64)
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=t.device) / half)
    angles = torch.outer(pos, freqs)
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


class RMSNorm(nn.Module):
    """Wan's RMSNorm: statistics in fp32, cast back, then the (fp32) weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    """Wan's LayerNorm: computed in fp32, cast back to the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type_as(x)


class Attention(nn.Module):
    """Self- (with 3D RoPE) or cross-attention; q and k RMS-normed across the full dim."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.norm_q = RMSNorm(cfg.dim, cfg.eps) if cfg.qk_norm else nn.Identity()
        self.norm_k = RMSNorm(cfg.dim, cfg.eps) if cfg.qk_norm else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        segments: SegmentLayout | None = None,
        backend: str | None = None,
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        """`segments`: the layout of x's tokens; with a `shard` (self-attention under
        sequence parallelism) x holds this rank's tokens and attention runs head-sharded over
        the shard's whole segments."""
        kv = x if context is None else context
        heads = (self.num_heads, -1)
        q = self.norm_q(self.q(x)).unflatten(-1, heads)
        k = self.norm_k(self.k(kv)).unflatten(-1, heads)
        v = self.v(kv).unflatten(-1, heads)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if shard is not None:
            return self.o(shard.attention(q, k, v, backend).flatten(-2))
        return self.o(attention(q, k, v, segments, backend).flatten(-2))


class Block(nn.Module):
    """WanAttentionBlock: modulated self-attention, cross-attention, modulated FFN."""

    def __init__(self, cfg: WanConfig, ln_modulate_impl: str) -> None:
        super().__init__()
        self.norm1 = LnModulate(cfg.eps, ln_modulate_impl)
        self.self_attn = Attention(cfg)
        self.norm3 = LayerNorm(cfg.dim, cfg.eps) if cfg.cross_attn_norm else nn.Identity()
        self.cross_attn = Attention(cfg)
        self.norm2 = LnModulate(cfg.eps, ln_modulate_impl)
        self.ffn = nn.Sequential(
            nn.Linear(cfg.dim, cfg.ffn_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(cfg.ffn_dim, cfg.dim),
        )
        self.modulation = nn.Parameter(torch.randn(1, 6, cfg.dim) / cfg.dim**0.5)

    def forward(
        self,
        x: torch.Tensor,
        e0: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        segments: SegmentLayout | None = None,
        backend: str | None = None,
        shard: SequenceShard | None = None,
    ) -> torch.Tensor:
        with fp32_region(x):
            shift_msa, scale_msa, gate_msa, shift_ffn, scale_ffn, gate_ffn = (
                self.modulation + e0
            ).chunk(6, dim=1)
        y = self.self_attn(self.norm1(x, scale_msa, shift_msa, segments), rope=rope,
                           segments=segments, backend=backend, shard=shard)
        with fp32_region(x):
            x = x + gated(y, gate_msa, segments)
        x = x + self.cross_attn(
            self.norm3(x), context=context, segments=segments, backend=backend
        )
        y = self.ffn(self.norm2(x, scale_ffn, shift_ffn, segments))
        with fp32_region(x):
            x = x + gated(y, gate_ffn, segments)
        return x


class Head(nn.Module):
    """Final modulated LayerNorm (its own (1,2,dim) table, driven by e, not e0) + projection."""

    def __init__(self, cfg: WanConfig, ln_modulate_impl: str) -> None:
        super().__init__()
        self.norm = LnModulate(cfg.eps, ln_modulate_impl)
        self.head = nn.Linear(cfg.dim, cfg.out_dim * cfg.patch_volume)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(
        self, x: torch.Tensor, e: torch.Tensor, segments: SegmentLayout | None = None
    ) -> torch.Tensor:
        with fp32_region(x):
            shift, scale = (self.modulation + e.unsqueeze(1)).chunk(2, dim=1)
            return self.head(self.norm(x, scale, shift, segments))


class WanModel(nn.Module):
    """Wan 2.1 T2V DiT: latent [B, C, T', H', W'] + timesteps [B] + text [B, L, text_dim]
    -> predicted velocity [B, C_out, T', H', W'] (fp32); or a packed micro-batch: a list of
    such latents of different shapes, with timesteps and text of all their samples.

    `execution` (a training run's, chosen once from its config and device) fixes the layout
    the model accepts and the attention backend it runs; without it each call takes either
    layout and chooses the backend for its device. `attention_ran` records the backend of the
    last forward, what a run's tag must name."""

    def __init__(
        self,
        cfg: WanConfig,
        ln_modulate_impl: str = "eager",
        activation_checkpointing: bool = False,
        execution: Execution | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.execution = execution
        self.attention_ran: str | None = None
        self.activation_checkpointing = activation_checkpointing
        dim = cfg.dim
        self.patch_embedding = nn.Conv3d(
            cfg.in_dim, dim, kernel_size=cfg.patch_size, stride=cfg.patch_size
        )
        self.text_embedding = nn.Sequential(
            nn.Linear(cfg.text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim)
        )
        self.time_embedding = nn.Sequential(
            nn.Linear(cfg.freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim)
        )
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList(Block(cfg, ln_modulate_impl) for _ in range(cfg.num_layers))
        self.head = Head(cfg, ln_modulate_impl)
        # RoPE angles per (grid, device); a plain dict, not buffers, so `.to(dtype)` leaves
        # them fp32 (Wan keeps its table out of the state dict for the same reason)
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.init_weights()

    @property
    def ln_modulate_impl(self) -> str:
        return self.head.norm.impl

    def set_ln_modulate_impl(self, impl: str) -> None:
        """Switch every LayerNorm+modulate site to `impl` ("eager" or "fused")."""
        resolve(impl)  # fail here, not in the middle of a forward
        for module in self.modules():
            if isinstance(module, LnModulate):
                module.impl = impl

    def init_weights(self) -> None:
        """Wan's scheme: Xavier-uniform Linears with zero bias, N(0, 0.02) embeddings, zero head."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        for module in (*self.text_embedding, *self.time_embedding):
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        nn.init.zeros_(self.head.head.weight)

    def forward(
        self,
        x: Latents,
        t: torch.Tensor,
        context: torch.Tensor,
        sp_group: dist.ProcessGroup | None = None,
    ) -> Latents:
        """Dense: x [B, C, T', H', W'] -> [B, C_out, T', H', W']. Packed: x a list of dense
        latents of different bucket shapes, t [G] and context [G, L, text_dim] for their G
        samples in list order -> the list of their predictions; inside, one token stream.

        `sp_group`: the sequence-parallel group a packed micro-batch runs over
        (docs/sequence_parallel.md): every rank of it passes the same samples and gets the
        same predictions; the blocks run on its share of the tokens. None, or a group of
        one, is the unsharded path."""
        backend = self._attention_backend(x)
        groups = [x] if isinstance(x, torch.Tensor) else list(x)
        grids = [self._grid(g) for g in groups]
        tokens = [self.patch_embedding(g).flatten(2).transpose(1, 2) for g in groups]  # f-h-w
        if isinstance(x, torch.Tensor):
            if degree_of(sp_group) > 1:
                raise ValueError("sequence parallelism shards packed micro-batches only; give "
                                 "the latents as a list (model.batch_layout: packed)")
            segments, shard, layout = None, None, None
            x, rope = tokens[0], self._rope(grids[0], x.device)  # [B, S, dim]
        else:
            segments = self._segments(grids, groups, t, context)
            shard = shard_over(segments, sp_group, self.cfg.num_heads)
            x = torch.cat([part.flatten(0, 1) for part in tokens])  # [L, dim]
            rope, layout = self._stream_rope(segments), segments
            if shard is not None:  # this rank's tokens, their angles, its chunks' layout
                x, rope, layout = shard.take(x), tuple(map(shard.take, rope)), shard.local

        with fp32_region(x):
            e = self.time_embedding(sinusoidal_embedding(self.cfg.freq_dim, t))  # [B, dim]
            e0 = self.time_projection(e).unflatten(1, (6, self.cfg.dim))  # [B, 6, dim]
        context = self.text_embedding(context)

        for block in self.blocks:
            args = (x, e0, context, rope, layout, backend, shard)
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, *args, use_reentrant=False)
            else:
                x = block(*args)
        self.attention_ran = backend

        x = self.head(x, e, layout)
        if segments is None:
            return self.unpatchify(x, grids[0]).float()
        if shard is not None:
            x = shard.gather(x)  # [L, C_out * patch]: every sample whole, on every rank
        parts = segments.split_groups(x)
        return [self.unpatchify(p, g).float() for p, g in zip(parts, grids, strict=True)]

    def _attention_backend(self, x: Latents) -> str:
        """The run's backend (`execution`), refusing input of the other layout; without an
        execution, the backend for this input's layout on its device."""
        layout = "dense" if isinstance(x, torch.Tensor) else "packed"
        if self.execution is None:
            device = x.device if isinstance(x, torch.Tensor) else x[0].device
            return choose_backend(layout, device)
        if layout != self.execution.layout:
            raise ValueError(
                f"a {layout} micro-batch given to a model that runs {self.execution.layout} ones"
            )
        return self.execution.attention

    def _grid(self, x: torch.Tensor) -> Grid:
        if x.ndim != 5 or x.shape[1] != self.cfg.in_dim:
            want = f"[B, {self.cfg.in_dim}, T, H, W]"
            raise ValueError(f"expected latents {want}, got {tuple(x.shape)}")
        dims = x.shape[2:]
        if any(n % p for n, p in zip(dims, self.cfg.patch_size, strict=True)):
            patch = self.cfg.patch_size
            raise ValueError(f"latent grid {tuple(dims)} not divisible by patch {patch}")
        return tuple(n // p for n, p in zip(dims, self.cfg.patch_size, strict=True))

    def _segments(
        self, grids: list[Grid], groups: list[torch.Tensor], t: torch.Tensor, ctx: torch.Tensor
    ) -> Segments:
        segments = Segments.of(grids, [g.shape[0] for g in groups], groups[0].device)
        if t.shape[:1] != (segments.num_segments,) or ctx.shape[0] != segments.num_segments:
            raise ValueError(
                f"packed batch of {segments.num_segments} samples got timesteps "
                f"{tuple(t.shape)} and context {tuple(ctx.shape)}; give one per sample"
            )
        return segments

    def _stream_rope(self, segments: Segments) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [L, head_dim/2]: each segment rotated by its own grid's angles."""
        device = segments.cu_seqlens.device
        tables = [self._rope(g, device) for g in segments.grids]
        counts = segments.counts
        return tuple(
            torch.cat([table[i].repeat(n, 1) for table, n in zip(tables, counts, strict=True)])
            for i in (0, 1)
        )

    def _rope(self, grid: Grid, device: torch.device) -> tuple:
        key = (grid, str(device))
        if key not in self._rope_cache:
            if len(self._rope_cache) >= 64:  # bucket grids are few; bound it anyway
                self._rope_cache.clear()
            self._rope_cache[key] = rope_angles(grid, self.cfg.rope_split, device)
        return self._rope_cache[key]

    def unpatchify(self, x: torch.Tensor, grid: Grid) -> torch.Tensor:
        """[B, S, C*prod(patch)] -> [B, C, T', H', W'] (Wan's 'fhwpqrc->cfphqwr' layout)."""
        pt, ph, pw = self.cfg.patch_size
        f, h, w = grid
        x = x.view(x.shape[0], f, h, w, pt, ph, pw, self.cfg.out_dim)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(x.shape[0], self.cfg.out_dim, f * pt, h * ph, w * pw)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_on_meta(cfg: WanConfig) -> WanModel:
    """The model without allocating weights (parameter counts, FLOP bookkeeping)."""
    with torch.device("meta"):
        return WanModel(cfg)
