"""A micro-batch of samples of any bucket shapes: latents grouped by shape, contexts per sample.

`collate` builds it from `LatentDataset` items. Samples of one latent shape are stacked into
one dense group [n, C, T', H', W']; groups run longest sample first (ties: first seen), so
groups of equal token count lie side by side and the model batches their attention into one
call. Within a group the items keep their order, so a micro-batch of one shape (what every
plan of today's policies holds) is exactly today's dense batch.

What the model makes of it (docs/packing.md): `WanModel(batch.latents, t, batch.context)`
runs the groups as one token stream of G segments with int32 offsets `cu_seqlens`; the
objective draws each sample's timestep and noise (`training.objective.per_sample_loss`).
Text contexts are dense [G, text_len, text_dim]: the dataset pads each to text_len with zeros
as Wan 2.1 does, and each segment attends to all of its own context, as Wan's training does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PackedBatch:
    """`latents[g]`: the samples of shape group g, [n_g, C, T'_g, H'_g, W'_g]; `context`
    [G, L, text_dim] and `sample_ids` for the G samples in group order."""

    latents: tuple[torch.Tensor, ...]
    context: torch.Tensor
    sample_ids: tuple[str, ...]

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def is_dense(self) -> bool:
        """One bucket shape: the batch is a single dense tensor (`dense`)."""
        return len(self.latents) == 1

    def dense(self) -> torch.Tensor:
        """The latents as one [B, C, T', H', W'] tensor; ValueError for several shapes."""
        if not self.is_dense:
            shapes = ", ".join(str(tuple(g.shape[1:])) for g in self.latents)
            raise ValueError(f"micro-batch holds {len(self.latents)} latent shapes ({shapes})")
        return self.latents[0]

    def inputs(self, packed: bool) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The latents in a run's layout (`Execution.packed`): the shape groups for a model
        that runs packed micro-batches, the one dense tensor otherwise (a model refuses the
        other layout)."""
        return self.latents if packed else self.dense()

    def to(self, device: torch.device, dtype: torch.dtype) -> PackedBatch:
        latents = tuple(g.to(device, dtype, non_blocking=True) for g in self.latents)
        context = self.context.to(device, dtype, non_blocking=True)
        return PackedBatch(latents, context, self.sample_ids)


def collate(items: Sequence[Mapping[str, Any]]) -> PackedBatch:
    """Dataset items (dicts of sample_id, latent [C, T', H', W'], context [L, text_dim]) ->
    one PackedBatch, the items of each latent shape stacked in their order."""
    if not items:
        raise ValueError("collate: a micro-batch needs at least one sample")
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, item in enumerate(items):
        by_shape.setdefault(tuple(item["latent"].shape), []).append(i)
    channels = {shape[0] for shape in by_shape}
    if len(channels) > 1 or any(len(shape) != 4 for shape in by_shape):
        raise ValueError(f"collate: latents must be [C, T', H', W'] of one C, got {list(by_shape)}")
    # longest first; dict order (first seen) breaks ties, and sorted() is stable
    shapes = sorted(by_shape, key=lambda shape: -shape[1] * shape[2] * shape[3])
    order = [i for shape in shapes for i in by_shape[shape]]
    contexts = {tuple(items[i]["context"].shape) for i in order}
    if len(contexts) > 1:
        raise ValueError(f"collate: text contexts differ in shape {sorted(contexts)}; pad them")
    return PackedBatch(
        latents=tuple(torch.stack([items[i]["latent"] for i in by_shape[s]]) for s in shapes),
        context=torch.stack([items[i]["context"] for i in order]),
        sample_ids=tuple(str(items[i]["sample_id"]) for i in order),
    )
