"""Sequence parallelism of the packed model (docs/sequence_parallel.md).

Without processes: the chunk rule, a rank's slice and its inverse, the local layout, and the
three exchanges run in a simulated world (the collective only moves rows: each rank's send
buffer cut by its send rows, the pieces delivered rank after rank), with the refusals.
The torchrun cases (gloo, mixed degrees, equal to one process) are in
tests/slow/model/test_sp_model_slow.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptiveload.model.segments import Segments, offsets
from adaptiveload.model.sequence_parallel import (
    SequenceShard,
    check_degree,
    chunk_lengths,
)


def _segments(lengths: list[int]) -> Segments:
    """A stream of segments of `lengths` tokens (grids 1 x 1 x S), adjacent equal ones in one
    shape group as collate makes them."""
    grids, counts = [], []
    for s in lengths:
        if grids and grids[-1] == (1, 1, s):
            counts[-1] += 1
        else:
            grids.append((1, 1, s))
            counts.append(1)
    return Segments.of(grids, counts, "cpu")


def _world(lengths: list[int], degree: int) -> list[SequenceShard]:
    segments = _segments(lengths)
    return [SequenceShard.of(segments, degree, r) for r in range(degree)]


def _simulate(shards: list[SequenceShard], xs: list[torch.Tensor], way: str) -> list:
    """Exchange `way` of every rank's x, the collective simulated: rank src's rows for dst
    reach dst in src order; each receiver expects exactly the rows its senders send."""
    d = len(shards)
    sends = [s.pack(x, way) for s, x in zip(shards, xs, strict=True)]
    pieces = [buf.split(s.rows(way)[0]) for s, buf in zip(shards, sends, strict=True)]
    for dst, shard in enumerate(shards):
        assert [len(pieces[src][dst]) for src in range(d)] == shard.rows(way)[1]
    received = [torch.cat([pieces[src][dst] for src in range(d)]) for dst in range(d)]
    return [s.unpack(buf, way) for s, buf in zip(shards, received, strict=True)]


def test_the_chunk_rule_and_a_rank_s_tokens():
    assert chunk_lengths([5, 8, 3], 2) == ((3, 2), (4, 4), (2, 1))
    assert chunk_lengths([10], 4) == ((3, 3, 2, 2),)
    shards = _world([5, 8, 3], 2)
    assert shards[0].positions(0).tolist() == [0, 1, 2, 5, 6, 7, 8, 13, 14]
    assert shards[1].positions(1).tolist() == [3, 4, 9, 10, 11, 12, 15]
    rank_major = torch.cat([shards[0].positions(r) for r in range(2)])
    assert rank_major.tolist() != list(range(16))  # unpacking must reorder: a real check
    assert shards[0].rank_tokens == (9, 7)
    assert shards[1].local.lengths == (2, 4, 1)
    assert shards[1].local.cu_seqlens.tolist() == [0, 2, 6, 7]
    assert shards[1].local.cu_seqlens.dtype == torch.int32


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5).flatmap(lambda d: st.tuples(
    st.just(d), st.lists(st.integers(d, 40), min_size=1, max_size=8))))
def test_every_token_on_one_rank_in_order_and_the_local_layouts(case):
    degree, lengths = case
    shards = _world(lengths, degree)
    cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    x = torch.randn(sum(lengths), 3)
    rebuilt = torch.full_like(x, float("nan"))
    for r, shard in enumerate(shards):
        pos = shard.positions(r)
        assert torch.equal(shard.take(x), x[pos])
        rebuilt[pos] = shard.take(x)
        sizes = [c[r] for c in shard.chunks]
        assert shard.local.lengths == tuple(sizes)
        assert torch.equal(shard.local.cu_seqlens, offsets(sizes, "cpu"))
        assert shard.local.num_tokens == shard.rank_tokens[r] == len(pos)
        # chunk r of segment i: contiguous, right after the chunks of ranks < r
        for i, part in enumerate(pos.split(sizes)):
            start = cu[i] + sum(shard.chunks[i][:r])
            assert part.tolist() == list(range(start, start + sizes[i]))
    assert torch.equal(rebuilt, x)  # the slices partition the stream
    for s, chunks in zip(lengths, shards[0].chunks, strict=True):
        assert sum(chunks) == s and list(chunks) == sorted(chunks, reverse=True)
        assert max(chunks) - min(chunks) <= 1


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4).flatmap(lambda d: st.tuples(
    st.just(d), st.integers(1, 3), st.lists(st.integers(d, 30), min_size=1, max_size=6))))
def test_the_exchanges_in_a_simulated_world(case):
    """To heads: rank s holds heads of group s of every token, in stream order; back to
    tokens: each rank's own rows again; gather: the whole stream on every rank."""
    degree, per_rank, lengths = case
    shards = _world(lengths, degree)
    heads = degree * per_rank
    full = torch.randn(sum(lengths), 3, heads, 5)  # [L, (q, k, v), H, hd]
    local = [s.take(full) for s in shards]
    head_shards = _simulate(shards, local, "heads")
    for s, got in enumerate(head_shards):
        assert torch.equal(got, full[:, :, s * per_rank : (s + 1) * per_rank])
    back = _simulate(shards, head_shards, "tokens")
    assert all(torch.equal(b, x) for b, x in zip(back, local, strict=True))
    gathered = _simulate(shards, local, "gather")
    assert all(torch.equal(g, full) for g in gathered)


def test_refusals_in_one_line():
    check_degree(4, 40)
    check_degree(1, 12)
    with pytest.raises(ValueError, match="degree 8 does not divide the model's 12 heads"):
        check_degree(8, 12)
    segments = _segments([9, 3])
    with pytest.raises(ValueError, match="of 3 tokens into empty chunks; use a degree <= 3"):
        SequenceShard.of(segments, 4, 0)
    with pytest.raises(ValueError, match="rank 2 is not in a sequence-parallel group of 2"):
        SequenceShard.of(segments, 2, 2)
    with pytest.raises(ValueError, match="unknown exchange"):
        SequenceShard.of(segments, 2, 0).pack(torch.zeros(6, 2), "sideways")
