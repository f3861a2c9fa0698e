"""What `adaptiveload model info` reports: shapes, parameters and FLOPs of a config."""

from __future__ import annotations

from typing import Any

from adaptiveload.errors import UserError
from adaptiveload.model import analytic
from adaptiveload.model.architectures import get_config
from adaptiveload.model.wan import build_on_meta, count_parameters
from adaptiveload.tokens import FRAME_STEP, PIXEL_STEP, token_count


def model_info(name: str, frames: int, height: int, width: int) -> dict[str, Any]:
    """Config facts + parameter count + analytic FLOPs for one (frames, height, width) sample."""
    cfg = get_config(name)
    if frames < 1 or (frames - 1) % FRAME_STEP:
        raise UserError(f"--frames {frames}: expected 4k+1 (1, 5, ..., 81)")
    for flag, value in (("--height", height), ("--width", width)):
        if value < PIXEL_STEP or value % PIXEL_STEP:
            raise UserError(f"{flag} {value}: expected a positive multiple of {PIXEL_STEP}")
    tokens = int(token_count(frames, height, width))
    terms = analytic.flop_terms(cfg)
    return {
        "config": cfg.name,
        "parameters": count_parameters(build_on_meta(cfg)),
        "dim": cfg.dim,
        "ffn_dim": cfg.ffn_dim,
        "num_heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "num_layers": cfg.num_layers,
        "rope_split": list(cfg.rope_split),
        "text_len": cfg.text_len,
        "text_dim": cfg.text_dim,
        "frames": frames,
        "height": height,
        "width": width,
        "tokens": tokens,
        "flops_forward": terms.forward(tokens),
        "flops_per_sample": analytic.training_flops(cfg, 1, tokens),
        "flops_note": "model: forward+backward = 3x forward, no activation recomputation",
        "attention_share": terms.attention * tokens**2 / terms.forward(tokens),
    }
