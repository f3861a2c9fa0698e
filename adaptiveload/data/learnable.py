"""Learnable synthetic video: procedural scenes that a tiny Wan learns in minutes on a CPU.

Gaussian noise (`data.content: noise`, the default) is right for timing and cannot be learned,
so it cannot tell whether a loading policy changes what a model learns. A `learnable` sample
is a scene drawn at its bucket's latent shape [C, T', H', W'] from its per-sample seed:

    x0[c, t, h, w] = sqrt(a) * colour_k[c] + sqrt(2 (1 - a)) * texture_k[c] * wave(t, h, w)
    wave           = cos(2 pi f_k . ((h, w) - v_m t) + phi)

Class k (of `NUM_CLASSES`) fixes the channel colour, the channel weights of the texture and
its spatial frequency f_k (two frequencies x four orientations, in cycles per latent pixel);
motion m (of `MOTIONS`) its velocity v_m in latent pixels per latent frame; the phase phi is
the sample's own. colour and texture have unit mean square and a = `MEAN_SHARE`, so x0 has
unit mean square, like the noise it replaces. The text context carries (k, m) as two token
embeddings of a fixed table, the rest zeros (Wan pads prompts with zeros): the model has to
read the context to know a scene's colour, texture and motion, and at high noise x0 is known
from (k, m) up to its phase. Same shapes as the noise, so the same cost per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from adaptiveload.errors import UserError

NUM_CLASSES = 8
# (dy, dx) in latent pixels per latent frame: still, down, up, right, left
MOTIONS = ((0.0, 0.0), (1.0, 0.0), (-1.0, 0.0), (0.0, 1.0), (0.0, -1.0))
FREQUENCIES = (0.125, 0.25)  # cycles per latent pixel; class k has FREQUENCIES[k % 2]
MEAN_SHARE = 0.5  # share of x0's mean square in the class colour (the rest: the moving texture)
TABLE_SEED = 0  # the classes and the word embeddings are the same in every run and experiment
CONTEXT_TOKENS = 2  # class word, motion word


@dataclass(frozen=True)
class _Tables:
    colour: torch.Tensor  # [classes, C], unit mean square per class
    texture: torch.Tensor  # [classes, C], unit mean square per class
    words: torch.Tensor  # [classes + motions, text_dim]


@cache
def _tables(channels: int, text_dim: int) -> _Tables:
    gen = torch.Generator().manual_seed(TABLE_SEED)

    def unit_rms(rows: torch.Tensor) -> torch.Tensor:
        return rows / rows.pow(2).mean(dim=1, keepdim=True).sqrt()

    colour = unit_rms(torch.randn(NUM_CLASSES, channels, generator=gen))
    texture = unit_rms(torch.randn(NUM_CLASSES, channels, generator=gen))
    words = torch.randn(NUM_CLASSES + len(MOTIONS), text_dim, generator=gen)
    return _Tables(colour, texture, words)


def scene_attributes(seed: int) -> tuple[int, int, float]:
    """(class, motion, phase) of the scene of `seed` (a `dataset.sample_seed`)."""
    gen = torch.Generator().manual_seed(seed)
    k = int(torch.randint(NUM_CLASSES, (1,), generator=gen))
    m = int(torch.randint(len(MOTIONS), (1,), generator=gen))
    return k, m, float(torch.rand(1, generator=gen, dtype=torch.float64)) * 2 * math.pi


def scene(
    seed: int, shape: tuple[int, int, int, int], text_len: int, text_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(latent [C, T', H', W'], context [text_len, text_dim]) of the scene of `seed`."""
    if text_len < CONTEXT_TOKENS:
        raise UserError(
            f"data.content learnable: the model's text_len {text_len} is below the "
            f"{CONTEXT_TOKENS} context tokens a scene needs; use a model config with a longer one"
        )
    channels, frames, height, width = shape
    tables = _tables(channels, text_dim)
    k, m, phase = scene_attributes(seed)
    dy, dx = MOTIONS[m]
    freq, angle = FREQUENCIES[k % 2], (k // 2) * math.pi / 4
    fy, fx = freq * math.sin(angle), freq * math.cos(angle)
    t = torch.arange(frames, dtype=torch.float32).view(-1, 1, 1)
    h = torch.arange(height, dtype=torch.float32).view(1, -1, 1)
    w = torch.arange(width, dtype=torch.float32).view(1, 1, -1)
    wave = torch.cos(2 * math.pi * (fy * (h - dy * t) + fx * (w - dx * t)) + phase)
    per_channel = (-1, 1, 1, 1)
    latent = math.sqrt(MEAN_SHARE) * tables.colour[k].view(per_channel) + math.sqrt(
        2 * (1 - MEAN_SHARE)
    ) * tables.texture[k].view(per_channel) * wave.unsqueeze(0)
    context = torch.zeros(text_len, text_dim)
    context[0], context[1] = tables.words[k], tables.words[NUM_CLASSES + m]
    return latent.contiguous(), context
