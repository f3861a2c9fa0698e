"""A tiny pretrained checkpoint, standing for a real Wan 2.1 one in the fine-tuning tests:
a seeded random `wan2.1-micro` with every weight perturbed (Wan zero-inits its head, which
would hide every upstream gradient), written by `save_wan` in either layout."""

from __future__ import annotations

from pathlib import Path

import torch

from adaptiveload.model.architectures import get_config
from adaptiveload.model.wan import WanModel
from adaptiveload.model.weights import save_wan

CONFIG = "wan2.1-micro"


def pretrained_model(seed: int = 7, config: str = CONFIG) -> WanModel:
    torch.manual_seed(seed)
    model = WanModel(get_config(config))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def write_pretrained(
    folder: Path, layout: str = "original", seed: int = 7, config: str = CONFIG
) -> Path:
    """The checkpoint folder `folder` (new), of `pretrained_model(seed)` in `layout`."""
    return save_wan(pretrained_model(seed, config), folder, layout)
