"""Which token counts the budgets must serve: the per-sample tokens of a (bucketed) manifest,
a named synthetic mixture, or the calibration grid standing in for one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload.data.bucketing import DEFAULT_GRID, DEFAULT_MAX_FRAMES, DEFAULT_MODE
from adaptiveload.errors import UserError


@dataclass(frozen=True)
class TokenMix:
    """Per-sample token counts of a (bucketed) manifest: what the budgets must serve."""

    tokens: np.ndarray
    origin: str
    samples: pd.DataFrame | None = field(default=None, repr=False, compare=False)  # bucketed

    def to_dict(self) -> dict[str, Any]:
        tok = self.tokens
        return {
            "origin": self.origin,
            "num_samples": int(tok.size),
            "tokens_min": int(tok.min()),
            "tokens_max": int(tok.max()),
            "tokens_p5": float(np.percentile(tok, 5)),
            "tokens_p95": float(np.percentile(tok, 95)),
        }


def token_mix(samples: pd.DataFrame, origin: str) -> TokenMix:
    """From bucketed samples (a `tokens` column)."""
    if samples.empty:
        raise UserError(f"{origin}: manifest has no samples (after bucketing); nothing to budget")
    return TokenMix(samples["tokens"].to_numpy(dtype=np.int64), origin, samples)


def manifest_token_mix(
    path: str | Path, bucketing: str = DEFAULT_MODE, grid: str = DEFAULT_GRID,
    max_frames: int = DEFAULT_MAX_FRAMES,
) -> TokenMix:
    """Load and bucket a manifest file (a file that already has `tokens` is used as it is)."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.manifest import load_manifest

    frame = load_manifest(path)
    if "tokens" not in frame.columns:
        frame = bucketize(frame, mode=bucketing, grid=grid, max_frames=max_frames).samples
    return token_mix(frame, str(path))


def mixture_token_mix(
    name: str, num_samples: int, seed: int = 0, bucketing: str = DEFAULT_MODE,
    grid: str = DEFAULT_GRID, max_frames: int = DEFAULT_MAX_FRAMES,
) -> TokenMix:
    """A named synthetic mixture, bucketed."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.mixtures import synthesize

    frame = synthesize(name, num_samples, seed)
    samples = bucketize(frame, mode=bucketing, grid=grid, max_frames=max_frames).samples
    return token_mix(samples, f"mixture {name} (n={num_samples}, seed={seed}, grid={grid})")


def grid_token_mix(tokens: Sequence[int]) -> TokenMix:
    """No manifest: the grid's token counts stand in for it (one sample each)."""
    tok = np.asarray(sorted(tokens), dtype=np.int64)
    return TokenMix(tok, "calibration grid (no manifest given)")
