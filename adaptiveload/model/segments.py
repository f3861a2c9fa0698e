"""Where each sample's tokens lie in a packed micro-batch: one token stream of G segments.

A packed micro-batch arrives as shape groups (`WanModel.forward` with a list of dense latent
tensors [n_g, C, T'_g, H'_g, W'_g]); after patch embedding its tokens are one stream
[L, dim], L = sum_i S_i, the groups in list order and, within a group, sample after sample.
Segment i is sample i's S_i tokens, rows ``cu_seqlens[i] : cu_seqlens[i + 1]`` (int32, the
layout flash-attn's `flash_attn_varlen_func`, torch's varlen attention and the segment-mode
LayerNorm-Modulate take).

Token-wise layers (Linear, RMSNorm, FFN) run on the whole stream, and the LayerNorm-Modulate
takes `cu_seqlens` itself (its segment form). Attention (on CPU) and the gated residuals run
per **run**: a maximal stretch of adjacent segments of equal length, which views as a dense
[n, S, ...] tensor without a copy (`per_run`); per-sample rows (gates, the text context) then
broadcast over their own segment's tokens as in the dense model, with no per-token gather. A
stream of one shape is one run, the dense batch itself. Under sequence parallelism a rank
holds a chunk of every segment: a `Chunks` layout, the same G segments of other lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, groupby

import torch

Grid = tuple[int, int, int]


def offsets(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 `cu_seqlens` [G + 1] of segments of `lengths` tokens, on `device`."""
    return torch.tensor([0, *accumulate(lengths)], dtype=torch.int32).to(device)


class SegmentLayout:
    """What a packed layout offers given its per-segment token counts `lengths` and their
    int32 offsets `cu_seqlens` (attributes of the subclass): the runs, `per_run`, the varlen
    kernels' offsets. `Segments` is a stream of whole samples, its lengths those of their
    grids; `Chunks` a stream of any lengths (a rank's share under sequence parallelism)."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor  # int32 [G + 1] on the stream's device

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def max_seqlen(self) -> int:
        return max(self.lengths)

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        """(segments, tokens per segment) of each maximal run of adjacent equal-length
        segments: shape groups of equal S (e.g. 1x4x6 and 1x6x4) merge when adjacent."""
        return tuple((len(list(same)), s) for s, same in groupby(self.lengths))

    def per_run(
        self,
        fn: Callable[..., torch.Tensor],
        tokens: Sequence[torch.Tensor],
        rows: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor:
        """``fn(*token_views, *row_slices)`` on each run, the results joined into one stream.

        `tokens` are streams [L, ...], each viewed [n, S, ...] per run; `rows` are per-segment
        tensors [G, ...], sliced to the run's n segments. `fn` returns [n, S, ...] (a dense
        per-sample computation); the result is [L, ...]. One run is one call, no copy."""
        runs = self.runs
        if len(runs) == 1:
            ((n, s),) = runs
            views = [t.unflatten(0, (n, s)) for t in tokens]
            return fn(*views, *rows).flatten(0, 1)
        token_parts = [t.split([n * s for n, s in runs]) for t in tokens]
        row_parts = [r.split([n for n, _ in runs]) for r in rows]
        out = []
        for k, (n, s) in enumerate(runs):
            views = [parts[k].unflatten(0, (n, s)) for parts in token_parts]
            out.append(fn(*views, *(parts[k] for parts in row_parts)).flatten(0, 1))
        return torch.cat(out)

    def cu_rows(self, rows_per_segment: int) -> torch.Tensor:
        """int32 offsets [G + 1] of `rows_per_segment` keys per segment (each segment's text
        context, for varlen cross-attention)."""
        g = self.num_segments
        return torch.arange(0, (g + 1) * rows_per_segment, rows_per_segment, dtype=torch.int32,
                            device=self.cu_seqlens.device)


@dataclass(frozen=True)
class Segments(SegmentLayout):
    """The layout of one packed token stream: `grids[g]` is the (F', H', W') patch grid of the
    `counts[g]` samples of shape group g; groups lie in the stream in this order."""

    grids: tuple[Grid, ...]
    counts: tuple[int, ...]
    cu_seqlens: torch.Tensor  # int32 [G + 1] on the stream's device

    @classmethod
    def of(cls, grids: Sequence[Grid], counts: Sequence[int], device: torch.device) -> Segments:
        """The layout of `counts[g]` samples of grid `grids[g]`, group after group."""
        if len(grids) != len(counts) or not grids or min(counts) < 1:
            raise ValueError(f"a packed batch needs >= 1 sample per group, got counts {counts}")
        grids = tuple(tuple(int(n) for n in g) for g in grids)
        lengths = [g[0] * g[1] * g[2] for g, n in zip(grids, counts, strict=True) for _ in range(n)]
        return cls(grids, tuple(int(n) for n in counts), offsets(lengths, device))

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of each segment (S_i), in stream order."""
        return tuple(s for s, n in zip(self.group_lengths, self.counts, strict=True)
                     for _ in range(n))

    @property
    def group_lengths(self) -> tuple[int, ...]:
        """Tokens of one sample of each group (S_g)."""
        return tuple(f * h * w for f, h, w in self.grids)

    def split_groups(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The stream `x` [L, ...] as one [n_g, S_g, ...] view per shape group."""
        sizes = [n * s for n, s in zip(self.counts, self.group_lengths, strict=True)]
        return [
            part.unflatten(0, (n, s))
            for part, n, s in zip(x.split(sizes), self.counts, self.group_lengths, strict=True)
        ]


@dataclass(frozen=True)
class Chunks(SegmentLayout):
    """A stream of G segments of any `lengths` (no grids): what a rank holds of a packed
    stream under sequence parallelism, a chunk of each segment (`sequence_parallel`)."""

    lengths: tuple[int, ...]
    cu_seqlens: torch.Tensor  # int32 [G + 1] on the stream's device

    @classmethod
    def of(cls, lengths: Sequence[int], device: torch.device) -> Chunks:
        lengths = tuple(int(n) for n in lengths)
        return cls(lengths, offsets(lengths, device))
