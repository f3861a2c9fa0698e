"""Ulysses sequence parallelism inside a packed micro-batch (docs/sequence_parallel.md).

The d ranks of an SP group hold the same samples; each keeps a share of the packed token
stream. The rule (`chunk_lengths`): each segment of S_i tokens is cut into d contiguous
chunks, the first S_i % d of S_i // d + 1 tokens and the rest of S_i // d; rank r holds
chunk r of every segment, in segment order (`Chunks`, its local layout). Every rank then
holds an equal share (within one token per segment) and segments of equal length keep equal
chunks, so the runs of the local layout stay whole. A segment shorter than d tokens would
leave a rank an empty chunk, which the GPU varlen kernels do not all take: refused.

Self-attention needs each segment whole: q, k, v go from sequence-sharded [L_r, H, hd] to
head-sharded [L, H/d, hd] (rank s gets heads s*H/d .. (s+1)*H/d - 1 of every token) by one
all-to-all, attention runs on the full `Segments` with the run's backend, and one all-to-all
takes its output back. Each exchange is a pure packing (`pack`), a collective that only
moves rows (`all_to_all`, `torch.distributed.all_to_all_single` with split sizes, on gloo and
NCCL), and a pure unpacking (`unpack`); the index maths can therefore be checked without
processes. Both directions are permutations of the group's rows, so each one's backward is
the other (`_Exchange`). `gather` gives every rank the whole output stream; its backward
keeps the rank's own rows of the gradient, which is exact when every rank of the group
computes the same loss from the gathered output (the reduction contract: docs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch
import torch.distributed as dist

from adaptiveload.model.attention import attention
from adaptiveload.model.segments import Chunks, Segments

WAYS = ("heads", "tokens", "gather")  # what an exchange does: `SequenceShard.pack`
_BACKWARD = {"heads": "tokens", "tokens": "heads"}  # "gather": the rank's own rows


def check_degree(degree: int, num_heads: int) -> None:
    """Refuse an SP degree that does not divide the head count (each rank gets whole heads)."""
    if degree < 1 or num_heads % degree:
        raise ValueError(
            f"sequence-parallel degree {degree} does not divide the model's {num_heads} heads; "
            f"use a divisor of {num_heads}"
        )


def chunk_lengths(lengths: Sequence[int], degree: int) -> tuple[tuple[int, ...], ...]:
    """The chunk rule: [G][d] tokens of segment i held by rank r, S_i // d plus one for the
    first S_i % d ranks."""
    return tuple(
        tuple(s // degree + (r < s % degree) for r in range(degree)) for s in lengths
    )


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """One rank's share of a packed stream over an SP group of `degree` ranks: the whole
    stream's `segments`, this rank's index `rank` in the group, the chunks of every segment
    (`chunks[i][r]`) and the group that moves them (None only in the pure tests)."""

    segments: Segments
    degree: int
    rank: int
    chunks: tuple[tuple[int, ...], ...]
    group: dist.ProcessGroup | None = None

    @classmethod
    def of(
        cls,
        segments: Segments,
        degree: int,
        rank: int,
        group: dist.ProcessGroup | None = None,
    ) -> SequenceShard:
        """The shard of rank `rank` of `degree`; ValueError for a rank outside the group or a
        segment shorter than `degree` tokens."""
        if degree < 1 or not 0 <= rank < degree:
            raise ValueError(f"rank {rank} is not in a sequence-parallel group of {degree}")
        short = min(segments.lengths)
        if short < degree:
            raise ValueError(
                f"sequence-parallel degree {degree} cuts a segment of {short} tokens into "
                f"empty chunks; use a degree <= {short} for this micro-batch"
            )
        return cls(segments, degree, rank, chunk_lengths(segments.lengths, degree), group)

    @cached_property
    def local(self) -> Chunks:
        """This rank's layout: chunk `rank` of every segment, in segment order."""
        return Chunks.of([c[self.rank] for c in self.chunks], self.segments.cu_seqlens.device)

    @cached_property
    def rank_tokens(self) -> tuple[int, ...]:
        """Tokens held by each rank of the group (L_r)."""
        return tuple(sum(c[r] for c in self.chunks) for r in range(self.degree))

    def positions(self, rank: int) -> torch.Tensor:
        """int64 stream positions [L_rank] of `rank`'s tokens, in its local order."""
        lengths = torch.tensor([c[rank] for c in self.chunks])
        before = torch.tensor([sum(c[:rank]) for c in self.chunks])  # earlier ranks' chunks
        starts = torch.tensor([0, *accumulate(self.segments.lengths)][:-1])
        local_starts = torch.cumsum(lengths, 0) - lengths
        shift = torch.repeat_interleave(starts + before - local_starts, lengths)
        out = shift + torch.arange(int(lengths.sum()))
        return out.to(self.segments.cu_seqlens.device)

    @cached_property
    def _own(self) -> torch.Tensor:
        return self.positions(self.rank)

    @cached_property
    def _rank_major(self) -> torch.Tensor:
        """Stream positions of every rank's tokens, rank after rank (what the exchange to heads
        receives), and `_stream_order` its inverse."""
        return torch.cat([self.positions(r) for r in range(self.degree)])

    @cached_property
    def _stream_order(self) -> torch.Tensor:
        order = torch.empty_like(self._rank_major)
        order[self._rank_major] = torch.arange(len(order), device=order.device)
        return order

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows [L_r, ...] of a whole stream `x` [L, ...] (differentiable)."""
        return x.index_select(0, self._own)

    def rows(self, way: str) -> tuple[list[int], list[int]]:
        """(rows sent to each rank, rows received from each) of the exchange `way`."""
        mine, every = [self.rank_tokens[self.rank]] * self.degree, list(self.rank_tokens)
        return (every, mine) if way == "tokens" else (mine, every)

    def pack(self, x: torch.Tensor, way: str) -> torch.Tensor:
        """The send buffer of exchange `way`, rows for rank 0 first (pure).

        Heads are the second-to-last dim. "heads": x [L_r, ..., H, hd] -> rank s gets head
        group s of this rank's tokens; "tokens": x [L, ..., H/d, hd] (this rank's heads of
        the whole stream) -> rank s gets its own tokens' rows; "gather": x [L_r, ...] ->
        every rank gets all of them."""
        if way == "heads":
            return x.unflatten(-2, (self.degree, -1)).movedim(-3, 0).flatten(0, 1)
        if way == "tokens":
            return x.index_select(0, self._rank_major)
        if way == "gather":
            return x.expand(self.degree, *x.shape).flatten(0, 1)
        raise ValueError(f"unknown exchange '{way}'; expected one of {WAYS}")

    def unpack(self, buf: torch.Tensor, way: str) -> torch.Tensor:
        """The received buffer of exchange `way` (rows from rank 0 first) in its layout:
        the whole stream in stream order ("heads", "gather"), or this rank's tokens with
        every head, head group after head group ("tokens") (pure)."""
        if way == "tokens":
            return buf.unflatten(0, (self.degree, -1)).movedim(0, -3).flatten(-3, -2)
        return buf.index_select(0, self._stream_order)

    def exchange(self, x: torch.Tensor, way: str) -> torch.Tensor:
        """`unpack(all_to_all(pack(x)))` over the group, without autograd."""
        if way not in WAYS:
            raise ValueError(f"unknown exchange '{way}'; expected one of {WAYS}")
        send, recv = self.rows(way)
        return self.unpack(all_to_all(self.pack(x, way), send, recv, self.group), way)

    def to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[L_r, ..., H, hd] sequence-sharded -> [L, ..., H/d, hd] head-sharded, segments
        whole."""
        return _Exchange.apply(x, self, "heads")

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[L, ..., H/d, hd] head-sharded -> [L_r, ..., H, hd] sequence-sharded (`to_heads`
        undone)."""
        return _Exchange.apply(x, self, "tokens")

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[L_r, ...] -> the whole stream [L, ...] on every rank of the group; the gradient
        keeps this rank's rows of the incoming one (every rank computes the same loss)."""
        return _Exchange.apply(x, self, "gather")

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None
    ) -> torch.Tensor:
        """Self-attention of this rank's tokens' q, k, v [L_r, H, hd] (q, k cast to v's dtype
        as `attention` does) over whole segments: one exchange of the three to head shards,
        `attention` on the full stream, one exchange back; returns [L_r, H, hd]. The three
        travel as [L, 3, H/d, hd], flash-attn's qkv-packed layout, and are views of it."""
        qkv = torch.stack([q.to(v.dtype), k.to(v.dtype), v], dim=1)  # [L_r, 3, H, hd]
        q, k, v = self.to_heads(qkv).unbind(1)
        return self.to_tokens(attention(q, k, v, self.segments, backend))


def all_to_all(
    send: torch.Tensor,
    send_rows: Sequence[int],
    recv_rows: Sequence[int],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Rows `send_rows[s]` of `send` (in order) to rank s of `group`, `recv_rows[s]` rows from
    each; the received rows, rank 0's first. The only collective here: it moves rows."""
    out = send.new_empty((sum(recv_rows), *send.shape[1:]))
    dist.all_to_all_single(
        out, send.contiguous(), list(recv_rows), list(send_rows), group=group
    )
    return out


class _Exchange(torch.autograd.Function):
    """An exchange whose backward is the reverse one (both are permutations of the group's
    rows); the gather's backward keeps the rank's own rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: SequenceShard, way: str) -> torch.Tensor:
        ctx.shard, ctx.way = shard, way
        return shard.exchange(x, way)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        shard, way = ctx.shard, ctx.way
        if way == "gather":
            return shard.take(grad), None, None
        return shard.exchange(grad.contiguous(), _BACKWARD[way]), None, None


def degree_of(group: dist.ProcessGroup | None) -> int:
    """The SP degree of `group`: its size, 1 without one."""
    return 1 if group is None else dist.get_world_size(group)


def shard_over(
    segments: Segments, group: dist.ProcessGroup | None, num_heads: int
) -> SequenceShard | None:
    """This process's shard of `segments` over the SP `group`, or None (no group, or a group
    of one: the unsharded path, no collective). ValueError for a degree that does not divide
    `num_heads` or exceeds the shortest segment."""
    degree = degree_of(group)
    if degree == 1:
        return None
    check_degree(degree, num_heads)
    return SequenceShard.of(segments, degree, dist.get_rank(group), group)
