"""Packed micro-batches through diffusers' own, unmodified `WanTransformer3DModel`.

Most Wan 2.1 trainers (diffusers, finetrainers, DiffSynth-Studio, VideoX-Fun) train diffusers'
model. `PackedWan(transformer)` runs a packed micro-batch (`data.packed.PackedBatch`: latents
of several shapes, one timestep and one text context per sample) through it as ONE token stream
[1, L, dim], with the same call as `WanModel`: `PackedWan(m)(list(batch.latents), t, context)`.
Nothing of the model is replaced but its attention processors (diffusers' own extension point);
the adapter's forward is the model's forward with each per-sample step made per segment:

- patchify: the model's `patch_embedding` per shape group, tokens concatenated in group order;
- RoPE: the model's `rope` table of each group's grid, repeated for its samples;
- timestep modulation: `condition_embedder` on the G timesteps, each token then given its
  sample's rows, [1, L, dim] and [1, L, 6, dim]: the per-token form diffusers' blocks take
  (Wan 2.2 TI2V's), so blocks and head modulate every token by its own sample;
- attention (`PackedWanAttnProcessor`): varlen self-attention within each segment, and each
  segment's queries against its own text context, by `model.attention` (flash-attn varlen or
  torch varlen on CUDA, SDPA per run of equal-length segments elsewhere);
- unpatchify: per shape group, as diffusers does.

Sequence parallelism (`sp_group`) is the project model's (`sequence_parallel.py`,
docs/sequence_parallel.md), applied at the same points: after patchify each rank keeps its
chunk of every segment (tokens, RoPE rows and modulation rows alike), self-attention runs
head-sharded over whole segments (`SequenceShard.attention`), cross-attention and the FFN on
the rank's own tokens, and the head's output is gathered so that every rank of the group
returns every sample's prediction.

A dense tensor runs the model's own forward (the processor then computes dense SDPA, as
diffusers' default processor does). Numerics are diffusers': its fp32 timestep sinusoid, its
RoPE in the input dtype (docs/models.md). Memory: the per-token modulation rows cost 28·dim
bytes per token (fp32), and each block adds its table to them: what diffusers' TI2V path pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from adaptiveload.errors import UserError
from adaptiveload.extras import require
from adaptiveload.model.attention import attention
from adaptiveload.model.segments import SegmentLayout, Segments
from adaptiveload.model.sequence_parallel import SequenceShard, degree_of, shard_over

Latents = torch.Tensor | Sequence[torch.Tensor]


class PackedWanAttnProcessor:
    """diffusers' `WanAttnProcessor` (T2V) with the attention call made per segment when the
    adapter has set `segments` (the layout of the packed stream, or of this rank's chunks of
    it), dense otherwise; self-attention through `shard` when the stream is sharded."""

    def __init__(self) -> None:
        self.segments: SegmentLayout | None = None
        self.shard: SequenceShard | None = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("PackedWanAttnProcessor takes no attention_mask (Wan uses none)")
        kv = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        heads = (attn.heads, -1)
        query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, heads)
        key = attn.norm_k(attn.to_k(kv)).unflatten(2, heads)
        value = attn.to_v(kv).unflatten(2, heads)
        if rotary_emb is not None:
            query, key = rotate(query, *rotary_emb), rotate(key, *rotary_emb)
        if self.segments is None:  # a dense batch [B, S, heads, head_dim]
            out = attention(query, key, value)
        elif encoder_hidden_states is None and self.shard is not None:  # over whole segments
            out = self.shard.attention(query[0], key[0], value[0], None)[None]
        elif encoder_hidden_states is None:  # self-attention over the stream [1, L, ...]
            out = attention(query[0], key[0], value[0], self.segments)[None]
        else:  # cross-attention: the stream's queries, each segment's own context [G, L_k]
            out = attention(query[0], key, value, self.segments)[None]
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan RoPE, in x's dtype: channel pairs (2i, 2i+1) by its interleaved tables
    [1, S, 1, head_dim] (cos and sin repeated per pair)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class PackedWan(nn.Module):
    """A `WanTransformer3DModel` that also takes packed micro-batches (module docstring).

    Its parameters are the transformer's (train, LoRA-wrap and save `adapter.transformer` as
    usual); building it installs the packed processor on every attention layer."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        diffusers = require("diffusers")
        if not isinstance(transformer, diffusers.WanTransformer3DModel):
            raise UserError(f"PackedWan wraps a diffusers WanTransformer3DModel, got "
                            f"{type(transformer).__name__}")
        config = transformer.config
        if config.image_dim is not None or config.added_kv_proj_dim is not None:
            raise UserError("PackedWan: this WanTransformer3DModel is an I2V model (image_dim/"
                            "added_kv_proj_dim set); packing supports T2V only (docs/models.md)")
        if any(getattr(m, "fused_projections", False) for m in transformer.modules()):
            raise UserError("PackedWan: the model's q/k/v projections are fused; call "
                            "transformer.unfuse_qkv_projections() first")
        self.transformer = transformer
        self.processor = PackedWanAttnProcessor()
        transformer.set_attn_processor(self.processor)

    def forward(
        self,
        x: Latents,
        t: torch.Tensor,
        context: torch.Tensor,
        sp_group: torch.distributed.ProcessGroup | None = None,
    ) -> Latents:
        """Dense: x [B, C, T', H', W'] -> the model's prediction. Packed: x a list of dense
        latents of different shapes, t [G] and context [G, L, text_dim] for their G samples
        in list order -> the list of their predictions.

        `sp_group`: the sequence-parallel group a packed micro-batch runs over, as for
        `WanModel` (every rank passes the same samples and gets the same predictions)."""
        model = self.transformer
        if isinstance(x, torch.Tensor):
            if degree_of(sp_group) > 1:
                raise ValueError("sequence parallelism shards packed micro-batches only; give "
                                 "the latents as a list (model.batch_layout: packed)")
            self.processor.segments = self.processor.shard = None
            return model(x, timestep=t, encoder_hidden_states=context, return_dict=False)[0]
        groups = list(x)
        patch = tuple(model.config.patch_size)
        grids = [tuple(n // p for n, p in zip(g.shape[2:], patch, strict=True)) for g in groups]
        segments = Segments.of(grids, [g.shape[0] for g in groups], groups[0].device)
        if t.shape != (segments.num_segments,) or context.shape[0] != segments.num_segments:
            raise ValueError(f"packed batch of {segments.num_segments} samples got timesteps "
                             f"{tuple(t.shape)} and context {tuple(context.shape)}")
        hidden = torch.cat([model.patch_embedding(g).flatten(2).transpose(1, 2).flatten(0, 1)
                            for g in groups])[None]
        rope = self._stream_rope(groups)
        temb, proj, context, _ = model.condition_embedder(t, context)
        token_sample = torch.repeat_interleave(
            torch.arange(segments.num_segments, device=hidden.device),
            torch.diff(segments.cu_seqlens).long(),
        )
        temb, proj = temb[token_sample][None], proj[token_sample].unflatten(1, (6, -1))[None]
        shard = shard_over(segments, sp_group, model.config.num_attention_heads)
        layout = segments
        if shard is not None:  # this rank's tokens with their RoPE and modulation rows
            hidden, temb, proj = (shard.take(v[0])[None] for v in (hidden, temb, proj))
            rope = tuple(shard.take(r[0])[None] for r in rope)
            layout = shard.local
        for block in model.blocks:
            args = (block, layout, shard, hidden, context, proj, rope)
            if torch.is_grad_enabled() and model.gradient_checkpointing:
                hidden = checkpoint(self._block, *args, use_reentrant=False)
            else:
                hidden = self._block(*args)
        self.processor.segments = self.processor.shard = None
        shift, scale = (model.scale_shift_table[None] + temb[:, :, None]).chunk(2, dim=2)
        normed = model.norm_out(hidden.float()) * (1 + scale[:, :, 0]) + shift[:, :, 0]
        hidden = model.proj_out(normed.type_as(hidden))
        if shard is not None:  # every sample whole, on every rank of the group
            hidden = shard.gather(hidden[0])[None]
        parts = segments.split_groups(hidden[0])
        return [self._unpatchify(p, g, patch) for p, g in zip(parts, grids, strict=True)]

    def _block(
        self,
        block: nn.Module,
        segments: SegmentLayout,
        shard: SequenceShard | None,
        *args: Any,
    ) -> torch.Tensor:
        """One block with the processor pointed at this stream (and shard): also when
        checkpointing recomputes it in the backward, after the forward has moved on."""
        self.processor.segments, self.processor.shard = segments, shard
        return block(*args)

    def _stream_rope(self, groups: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's RoPE tables of each group's grid, repeated per sample: [1, L, 1, hd]."""
        tables = [self.transformer.rope(g) for g in groups]
        return tuple(
            torch.cat([table[i].repeat(1, g.shape[0], 1, 1)
                       for table, g in zip(tables, groups, strict=True)], dim=1)
            for i in (0, 1)
        )

    @staticmethod
    def _unpatchify(x: torch.Tensor, grid: tuple[int, ...], patch: tuple[int, ...]) -> torch.Tensor:
        """[n, S, C*prod(patch)] -> [n, C, T', H', W'], diffusers' permutation."""
        x = x.reshape(x.shape[0], *grid, *patch, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)
