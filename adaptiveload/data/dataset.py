"""A map-style Dataset of Wan 2.1 training inputs: latent [C, T', H/8, W/8] + text context.

By default both are seeded Gaussian noise (`content="noise"`): the benchmark measures systems
behaviour, and noise of the right shape costs the model exactly what real latents cost.
`content="learnable"` draws a procedural scene instead, with a context that says what it
shows (`data.learnable`): same shapes and cost, but a model can learn it. The seed of a sample
is a hash of (sample_id, seed) (blake2b, not Python's per-process salted `hash`), so any rank,
worker or resumed run regenerates the same tensors. A manifest row with ``latent_path`` is
served from that ``.safetensors`` file instead (keys ``latent`` and ``context``, the text
embedding, which is never replaced by noise), with its shape checked against the bucket; the
file must lie inside the dataset's `root` and be a regular file. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pandas as pd
import torch
from torch.utils.data import Dataset

from adaptiveload.data import learnable
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
    ) -> None:
        """`root`: the folder every `latent_path` must lie in once links and `..` are resolved
        (a manifest someone shares must not reach other files); None checks none."""
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
        if "latent_path" in samples_df.columns:
            paths = samples_df["latent_path"]
            self.latent_paths = [None if pd.isna(p) else str(p) for p in paths.tolist()]
        else:
            self.latent_paths = [None] * len(self.sample_ids)
        if root is not None:
            for path in dict.fromkeys(p for p in self.latent_paths if p is not None):
                regular_file(path, "latent_path", root=root)
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
        sample_id = self.sample_ids[index]
        shape = self.latent_size(index)
        path = self.latent_paths[index]
        if path is None and self.content == "learnable":
            seed = sample_seed(sample_id, self.seed, "scene")
            latent, context = learnable.scene(seed, shape, self.text_len, self.text_dim)
        elif path is None:
            latent = self._noise(sample_id, "latent", shape)
            context = self._noise(sample_id, "context", (self.text_len, self.text_dim))
        else:
            latent, context = self._cached(sample_id, Path(path), shape)
        return {"sample_id": sample_id, "latent": latent, "context": context}

    def _noise(self, sample_id: str, stream: str, shape: tuple[int, ...]) -> torch.Tensor:
        gen = torch.Generator().manual_seed(sample_seed(sample_id, self.seed, stream))
        return torch.randn(shape, generator=gen, dtype=torch.float32)

    def _cached(
        self, sample_id: str, path: Path, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        if path.suffix != ".safetensors":  # a .pth read as safetensors: "header too large"
            raise UserError(f"{path} (latent of sample {sample_id!r}): not a .safetensors file; "
                            "cache latents as .safetensors (keys 'latent' and 'context')")
        regular_file(path, f"latent of sample {sample_id!r}")
        try:
            tensors = load_file(path)
        except (OSError, SafetensorError) as exc:
            raise UserError(
                f"{path} (latent of sample {sample_id!r}): cannot be read: {exc}"
            ) from None
        if "latent" not in tensors:
            raise UserError(
                f"{path} (latent of sample {sample_id!r}): no tensor named 'latent' "
                f"(found {', '.join(sorted(tensors)) or 'none'}); expected key 'latent' "
                f"of shape {list(shape)} and 'context'"
            )
        latent = tensors["latent"]
        if tuple(latent.shape) != shape:
            raise UserError(
                f"{path} (latent of sample {sample_id!r}): shape {list(latent.shape)}; expected "
                f"{list(shape)} = [channels, 1+(F-1)/4, H/8, W/8] of its bucket; re-encode it "
                "at the bucket shape or bucket the manifest with the settings it was cached at"
            )
        context = tensors.get("context")
        for name, tensor in (("latent", latent), ("context", context)):
            if tensor is not None and not torch.isfinite(tensor).all():
                raise UserError(f"{path} (latent of sample {sample_id!r}): tensor {name!r} "
                                "holds NaN or infinite values; encode the sample again")
        if context is None:  # noise as the text would train a model to ignore its prompt
            raise UserError(
                f"{path} (latent of sample {sample_id!r}): no tensor named 'context' (found "
                f"{', '.join(sorted(tensors))}); cache the text embedding [L <= {self.text_len}, "
                f"{self.text_dim}] in the same file under 'context'"
            )
        if (
            context.ndim != 2
            or context.shape[0] > self.text_len
            or context.shape[1] != self.text_dim
        ):
            raise UserError(
                f"{path} (context of sample {sample_id!r}): shape {list(context.shape)}; "
                f"expected [L <= {self.text_len}, {self.text_dim}]"
            )
        # Wan pads the text context to text_len with zeros
        context = torch.nn.functional.pad(
            context.float(), (0, 0, 0, self.text_len - context.shape[0])
        )
        return latent.float(), context
