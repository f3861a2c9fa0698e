"""The one mapping from a (bucket) shape to its Wan 2.1 sequence length.

Wan 2.1's VAE compresses (time, height, width) by (4, 8, 8) and the DiT patchifies the latent
by (1, 2, 2), so a clip of F = 4k+1 frames at H x W pixels (multiples of 16) becomes
``S = (1 + (F-1)/4) * (H/16) * (W/16)`` tokens. An image is F = 1.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np

VAE_STRIDE = (4, 8, 8)
PATCH_SIZE = (1, 2, 2)
LATENT_CHANNELS = 16

# F and H/W granularity that a bucket shape must respect
FRAME_STEP = VAE_STRIDE[0] * PATCH_SIZE[0]  # 4: frames are 4k+1
PIXEL_STEP = VAE_STRIDE[1] * PATCH_SIZE[1]  # 16: height and width are multiples of 16

IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def latent_shape(frames: IntOrArray, height: IntOrArray, width: IntOrArray) -> tuple:
    """Latent grid (T', H/8, W/8) of a bucket shape; works on ints and integer arrays."""
    return (
        1 + (frames - 1) // VAE_STRIDE[0],
        height // VAE_STRIDE[1],
        width // VAE_STRIDE[2],
    )


def token_count(frames: IntOrArray, height: IntOrArray, width: IntOrArray) -> IntOrArray:
    """Sequence length S of a bucket shape (frames 4k+1, height and width multiples of 16)."""
    t, h, w = latent_shape(frames, height, width)
    return t * (h // PATCH_SIZE[1]) * (w // PATCH_SIZE[2])


# The shape classes that validation reports a loss for: images (F = 1), short clips (up to 33
# frames, Open-Sora's 5-33-frame bucket) and long clips (more frames).
SHAPE_CLASSES = ("image", "short", "long")
SHORT_CLIP_MAX_FRAMES = 33


def shape_class(frames: int) -> str:
    """The shape class ("image", "short" or "long") of a bucket shape of `frames` frames."""
    if frames == 1:
        return "image"
    return "short" if frames <= SHORT_CLIP_MAX_FRAMES else "long"
