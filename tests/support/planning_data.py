"""Bucketed test manifests for the planning tests (shapes on Wan's 4k+1 / 16-px grid), bucketed
by the product's own `bucketize` (exact mode keeps each shape), so they carry its columns: a
fixed draw (`bucketed`) and the property tests' strategy over random shapes (`manifests`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import strategies as st

from adaptiveload.data.bucketing import bucketize

# (frames, height, width): images, short and long clips, one 720p clip over most budgets
SHAPES = np.array(
    [
        (1, 480, 832), (1, 1024, 1024), (17, 480, 832), (33, 480, 832),
        (49, 480, 832), (81, 480, 832), (81, 720, 1280), (5, 256, 256),
    ]
)


def bucketed(n: int, seed: int = 0, shapes: np.ndarray = SHAPES) -> pd.DataFrame:
    """`n` samples drawn over `shapes`, with the columns bucketize() adds."""
    rng = np.random.default_rng(seed)
    pick = np.asarray(shapes)[rng.integers(0, len(shapes), n)]
    manifest = pd.DataFrame({
        "sample_id": [f"s{i:07d}" for i in range(n)],
        "num_frames": pick[:, 0], "height": pick[:, 1], "width": pick[:, 2],
    })
    return bucketize(manifest, mode="exact").samples


@st.composite
def manifests(draw) -> pd.DataFrame:
    """A bucketed manifest of 1-400 samples over 1-8 random Wan bucket shapes."""
    k = draw(st.integers(1, 8))
    shapes = np.array(
        [
            (
                4 * draw(st.integers(0, 20)) + 1,
                16 * draw(st.integers(1, 80)),
                16 * draw(st.integers(1, 80)),
            )
            for _ in range(k)
        ]
    )
    return bucketed(draw(st.integers(1, 400)), seed=draw(st.integers(0, 2**16)), shapes=shapes)
