"""A map-style Dataset of Wan 2.1 training inputs: latent [C, T', H/8, W/8] + text context.

A manifest row with ``latent_path`` is served from the latent cache (`data.latents`): the
latent (a window of it, ``latent_start``) from its file, the text embedding from its own
file or the latent's, shape-checked against the bucket; a missing or misnamed embedding is
an error naming the file and the keys it holds. Every cached file must lie inside the
dataset's `root` and be a regular file. Nothing is ever downloaded.

Rows without ``latent_path`` are the synthetic path: by default seeded Gaussian noise
(`content="noise"`: the benchmark measures systems behaviour, and noise of the right shape
costs the model exactly what real latents cost); `content="learnable"` draws a procedural
scene instead, with a context that says what it shows (`data.learnable`). A manifest mixes
neither: one cached row makes every row cached, or the uncached ones would train on noise.
The seed of a synthetic sample is a hash of (sample_id, seed) (blake2b, not Python's
per-process salted `hash`), so any rank, worker or resumed run regenerates the same tensors.

Caption dropout (`caption_dropout` q > 0, with `empty_text`, the embedding of the empty
caption): a cached sample's context is the empty one with probability q, decided by a hash of
(sample_id, seed, epoch), so every rank, worker and resumed run drops the same captions.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

from adaptiveload.data import learnable
from adaptiveload.data.latents import LATENT_KEY, TEXT_KEY, read_latent, read_text
from adaptiveload.errors import UserError
from adaptiveload.io import regular_file
from adaptiveload.tokens import LATENT_CHANNELS, latent_shape

_NEEDED = ("sample_id", "bucket_frames", "bucket_height", "bucket_width")
# what a sample without a cached latent holds (`data.content` of an experiment)
CONTENTS = ("noise", "learnable")


def sample_seed(sample_id: str, seed: int, stream: str) -> int:
    """A 63-bit seed from (sample_id, seed, stream), stable across processes and machines."""
    digest = hashlib.blake2b(f"{seed}\x1f{stream}\x1f{sample_id}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


class LatentDataset(Dataset):
    """Item i (a row position of bucketed `samples_df`) -> dict(sample_id, latent, context)."""

    def __init__(
        self,
        samples_df: pd.DataFrame,
        latent_channels: int = LATENT_CHANNELS,
        text_len: int = 512,
        text_dim: int = 4096,
        seed: int = 0,
        content: str = CONTENTS[0],
        root: str | Path | None = None,
        caption_dropout: float = 0.0,
        empty_text: str | None = None,
    ) -> None:
        """`root`: the folder every cached file must lie in once links and `..` are resolved
        (a manifest someone shares must not reach other files); None checks none.
        `caption_dropout`, `empty_text`: module docstring."""
        if content not in CONTENTS:
            raise UserError(f"data.content {content!r}: expected one of {', '.join(CONTENTS)}")
        missing = [c for c in _NEEDED if c not in samples_df.columns]
        if missing:
            raise UserError(
                f"LatentDataset: samples lack column(s) {', '.join(missing)}; "
                "pass Bucketed.samples (from adaptiveload.data.bucketing.bucketize)"
            )
        self.sample_ids = samples_df["sample_id"].astype(str).tolist()
        self.shapes = list(
            zip(
                samples_df["bucket_frames"].tolist(),
                samples_df["bucket_height"].tolist(),
                samples_df["bucket_width"].tolist(),
                strict=True,
            )
        )
        self.cached = _cached_rows(samples_df)
        if root is not None:
            files = {(p, col) for row in self.cached if row
                     for p, col in ((row.latent_path, "latent_path"),
                                    (row.text_path, "text_path"))}
            for path, column in sorted(files):
                regular_file(path, column, root=root)
        if not 0 <= caption_dropout < 1:
            raise UserError(f"data.caption_dropout {caption_dropout}: expected 0 <= q < 1")
        if caption_dropout > 0 and empty_text is None:
            raise UserError(
                f"data.caption_dropout {caption_dropout} needs data.empty_text: the text "
                "embedding of the empty caption (the encoder's output for '')"
            )
        if empty_text is not None:
            regular_file(empty_text, "data.empty_text")
        self.caption_dropout, self.empty_text = caption_dropout, empty_text
        self.latent_channels = latent_channels
        self.text_len = text_len
        self.text_dim = text_dim
        self.seed = seed
        self.content = content

    def __len__(self) -> int:
        return len(self.sample_ids)

    def latent_size(self, index: int) -> tuple[int, int, int, int]:
        """[C, T', H/8, W/8] of item `index` (from its bucket shape)."""
        return (self.latent_channels, *(int(v) for v in latent_shape(*self.shapes[index])))

    def __getitem__(self, index: int) -> dict:
        return self.item(index)

    def item(self, index: int, epoch: int = 0) -> dict:
        """Item `index` as epoch `epoch` sees it (the epoch decides caption dropout)."""
        sample_id = self.sample_ids[index]
        shape = self.latent_size(index)
        row = self.cached[index]
        if row is not None:
            latent = read_latent(row.latent_path, row.latent_key, row.latent_start, shape)
            text_path, text_key = row.text_path, row.text_key
            if self._dropped(sample_id, epoch):
                text_path, text_key = self.empty_text, TEXT_KEY
            context = read_text(text_path, text_key, self.text_len, self.text_dim)
        elif self.content == "learnable":
            seed = sample_seed(sample_id, self.seed, "scene")
            latent, context = learnable.scene(seed, shape, self.text_len, self.text_dim)
        else:
            latent = self._noise(sample_id, "latent", shape)
            context = self._noise(sample_id, "context", (self.text_len, self.text_dim))
        return {"sample_id": sample_id, "latent": latent, "context": context}

    def _dropped(self, sample_id: str, epoch: int) -> bool:
        """Whether `sample_id` trains on the empty caption in `epoch` (probability q)."""
        if not self.caption_dropout:
            return False
        draw = sample_seed(sample_id, self.seed, f"caption_dropout/{epoch}") / float(1 << 63)
        return draw < self.caption_dropout

    def _noise(self, sample_id: str, stream: str, shape: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sample_seed(sample_id, self.seed, stream))
        return torch.randn(shape, generator=gen, dtype=torch.float32)


class _Cached(NamedTuple):
    """Where one cached sample's tensors are (`data.latents`, the manifest's cache columns)."""

    latent_path: str
    latent_key: str
    latent_start: int
    text_path: str
    text_key: str


def _cached_rows(samples: pd.DataFrame) -> list[_Cached | None]:
    """Per row, its cache entry (None: a synthetic row); a manifest with both kinds is refused,
    naming the first uncached row, because that row would train on noise."""
    n = len(samples)
    if "latent_path" not in samples.columns or samples["latent_path"].isna().all():
        return [None] * n
    paths = samples["latent_path"]
    if paths.isna().any():
        first = int(np.flatnonzero(paths.isna().to_numpy())[0])
        raise UserError(
            f"manifest: sample {samples['sample_id'].iloc[first]!r} has no latent_path while "
            f"{int(paths.notna().sum())} others have one; it would train on noise. Give every "
            "row its cached latent, or drop the rows without one"
        )

    def column(name: str, default: object) -> list:
        if name not in samples.columns:
            return [default] * n
        return [default if pd.isna(v) else v for v in samples[name].tolist()]

    latent_paths = [str(p) for p in paths.tolist()]
    # no text_path: the embedding is in the latent's own file
    text_paths = [p if t is None else str(t)
                  for p, t in zip(latent_paths, column("text_path", None), strict=True)]
    return [
        _Cached(path, str(key), int(start), text, str(tkey))
        for path, key, start, text, tkey in zip(
            latent_paths, column("latent_key", LATENT_KEY), column("latent_start", 0),
            text_paths, column("text_key", TEXT_KEY), strict=True,
        )
    ]
