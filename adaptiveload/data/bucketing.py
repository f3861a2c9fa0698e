"""Raw (frames, height, width) -> Wan 2.1 bucket shape -> tokens, for a whole manifest at once.

Two modes:

* ``aspect`` (Open-Sora style, ``opensora/datasets/bucket.py``): a grid of resolution tiers,
  each a handful of aspect-ratio sizes of about equal area, times a ladder of 4k+1 frame
  counts. A sample takes the largest tier that has a size fitting inside it, within that tier
  the size whose aspect ratio is nearest its own, and the largest frame count not above its
  own. "Fitting" means bucket height <= sample height and bucket width <= sample width, so a
  resize-then-centre-crop never upscales (stricter than Open-Sora's 0.8x-area rule).
* ``exact``: the sample keeps its own shape, rounded down to 4k+1 frames (capped at
  ``max_frames``) and to multiples of 16 pixels.

Samples that fit no bucket are dropped and counted in ``Bucketed.num_excluded``, never silently.
Everything is numpy over whole columns: the grid is small (tens of cells), the rows are many.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from adaptiveload.errors import UserError
from adaptiveload.experiment import schema_default
from adaptiveload.tokens import FRAME_STEP, PIXEL_STEP, token_count

MODES = ("aspect", "exact")
# What becomes of a clip shorter than its grid's first video rung (17 frames on the Wan
# grids): `still`, its largest rung is the 1-frame one and it trains as an image (a
# PlanWarning says how many and the frames lost); `video`, it keeps its own length rounded
# down to 4k+1 (5, 9 or 13 frames: 2 to 4 latent frames, motion kept), a rung below the
# ladder's. Clips of 2-4 frames have no 4k+1 length above 1 and are stills either way.
SHORT_CLIPS = ("still", "video")
DEFAULT_SHORT_CLIPS = schema_default("data.short_clips")
BUCKET_COLUMNS = ("bucket_frames", "bucket_height", "bucket_width", "tokens")


@dataclass(frozen=True)
class Tier:
    """One target resolution: (height, width) sizes of about equal area, one per aspect ratio."""

    name: str
    sizes: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Grid:
    """An aspect-bucket grid: resolution tiers (small to large) x a 4k+1 frame ladder.

    Frame counts are 1 (image), then 1 + ``frame_stride``*k up to min(max_frames, frame_cap),
    or the explicit `rungs` up to it where a grid lists them; the cap itself (rounded down to
    4k+1) is always a rung, so every clip can use its length up to the configured maximum.
    """

    name: str
    tiers: tuple[Tier, ...]
    frame_stride: int = 16
    frame_cap: int | None = None
    rungs: tuple[int, ...] = ()  # an explicit frame ladder (4k+1 each) instead of the stride

    def frames(self, max_frames: int) -> np.ndarray:
        top = max_frames if self.frame_cap is None else min(max_frames, self.frame_cap)
        top = round_down_4k1(top)
        if self.rungs:
            ladder = np.array([f for f in self.rungs if f <= top], dtype=np.int64)
        else:
            ladder = np.arange(1, top + 1, self.frame_stride, dtype=np.int64)
        return np.unique(np.append(ladder, top))

    def sizes(self) -> list[tuple[int, int]]:
        return [s for tier in self.tiers for s in tier.sizes]


# Wan 2.1 grid. 480p and 720p tiers are Wan's native sizes (480x832, 720x1280 and their
# portrait twins) plus 1:1 and ~3:4 sizes of the same area, snapped to 16 px; a 256p tier
# (Wan's low-resolution pre-training stage; Open-Sora 2.0 stage 1 trains at 256px) keeps
# small sources instead of dropping them.
WAN_GRID = Grid(
    name="wan",
    tiers=(
        Tier("256p", ((256, 256), (192, 336), (336, 192), (224, 288), (288, 224))),
        Tier("480p", ((480, 832), (832, 480), (624, 624), (544, 720), (720, 544))),
        Tier("720p", ((720, 1280), (1280, 720), (960, 960), (832, 1104), (1104, 832))),
    ),
)


def _scaled(grid: Grid, name: str, factor: int, frame_cap: int) -> Grid:
    """The same grid with every side divided by `factor` and snapped down to 16 px."""

    def snap(v: int) -> int:
        return max(PIXEL_STEP, (v // factor) // PIXEL_STEP * PIXEL_STEP)

    tiers = tuple(
        Tier(f"{t.name}/{factor}", tuple((snap(h), snap(w)) for h, w in t.sizes))
        for t in grid.tiers
    )
    return Grid(name=name, tiers=tiers, frame_stride=grid.frame_stride, frame_cap=frame_cap)


# CPU default: the Wan grid at 1/4 of the side length, clips up to 65 frames, so tokens span
# 12 (48x64 image) .. 3,825 (65f 240x240; 3,740 at 65f 176x320), so tiny models train on 2 cores.
TINY_GRID = _scaled(WAN_GRID, "tiny", factor=4, frame_cap=65)

# Longer clips (what Wan 2.2 and long-clip sets train: 121 frames, 5 s at 24 fps, and 161):
# the Wan grid's sizes and its ladder up to 81 frames, then rungs at 121 and 161 frames, so
# 480p clips reach 48,360 and 63,960 tokens and 720p ones 111,600 and 147,600 (beyond one
# H200 for the 14B: sequence parallelism, planning.groups). Up to 81 frames it buckets as
# the Wan grid does; give max_frames 161 (121) to keep the long rungs.
WAN_LONG_GRID = Grid(
    name="wan-long", tiers=WAN_GRID.tiers, frame_cap=161,
    rungs=(1, 17, 33, 49, 65, 81, 121, 161),
)

GRIDS: dict[str, Grid] = {g.name: g for g in (WAN_GRID, TINY_GRID, WAN_LONG_GRID)}

# The bucketing of real Wan 2.1 data, every command's and function's default: aspect buckets
# on the Wan grid, clips up to Wan 2.1's 81 frames. The experiment schema's `data` and
# `simulate` entries repeat these (tests/base/test_experiment.py checks the copies); its `data.grid`
# default is `tiny` on purpose, for the default experiment's tiny model.
DEFAULT_MODE = "aspect"
DEFAULT_GRID = WAN_GRID.name
DEFAULT_MAX_FRAMES = 81


@dataclass
class Bucketed:
    """Bucketed manifest: kept rows (+ bucket shape and tokens), and how many were dropped."""

    samples: pd.DataFrame
    num_excluded: int
    mode: str
    grid: str
    max_frames: int
    short_clips: str = DEFAULT_SHORT_CLIPS
    excluded_ids: pd.Series = field(repr=False, default_factory=lambda: pd.Series([], dtype=str))
    # of num_excluded, those a device cannot hold alone (planning.plan.without_over_capacity)
    num_over_capacity: int = 0

    @property
    def num_samples(self) -> int:
        """Rows in the input manifest (kept + excluded)."""
        return len(self.samples) + self.num_excluded

    def bucket_table(self) -> pd.DataFrame:
        """One row per bucket shape: frames, height, width, tokens, count (sorted by tokens)."""
        cols = list(BUCKET_COLUMNS)
        table = self.samples.groupby(cols, sort=False).size().reset_index(name="count")
        table = table.rename(
            columns={"bucket_frames": "frames", "bucket_height": "height", "bucket_width": "width"}
        )
        table = table.sort_values(["tokens", "frames", "height", "width"], ignore_index=True)
        return table[["frames", "height", "width", "tokens", "count"]]

    def token_stats(self) -> dict[str, float]:
        """min, max, mean, p50, p99 of tokens over kept samples (zeros when none are kept)."""
        tok = self.samples["tokens"].to_numpy()
        if tok.size == 0:
            return {"min": 0, "max": 0, "mean": 0.0, "p50": 0.0, "p99": 0.0}
        return {
            "min": int(tok.min()),
            "max": int(tok.max()),
            "mean": float(tok.mean()),
            "p50": float(np.percentile(tok, 50)),
            "p99": float(np.percentile(tok, 99)),
        }


def round_down_4k1(frames):
    """Largest 4k+1 not above `frames` (frames >= 1); ints or integer arrays."""
    return (frames - 1) // FRAME_STEP * FRAME_STEP + 1


def get_grid(name: str) -> Grid:
    try:
        return GRIDS[name]
    except KeyError:
        raise UserError(
            f"grid '{name}': unknown; expected one of {', '.join(sorted(GRIDS))}"
        ) from None


def bucketize(
    manifest_df: pd.DataFrame,
    mode: str = DEFAULT_MODE,
    grid: str = DEFAULT_GRID,
    max_frames: int = DEFAULT_MAX_FRAMES,
    short_clips: str = DEFAULT_SHORT_CLIPS,
) -> Bucketed:
    """Assign every row of a validated manifest to a bucket shape and its token count.

    `grid` is only used by ``aspect``; ``exact`` rounds each sample's own shape.
    `short_clips` (SHORT_CLIPS): what becomes of a clip below the grid's first video rung.
    Row order of the kept samples is the manifest's.
    """
    if mode not in MODES:
        raise UserError(f"bucketing mode '{mode}': unknown; expected one of {', '.join(MODES)}")
    if short_clips not in SHORT_CLIPS:
        raise UserError(
            f"short_clips '{short_clips}': unknown; expected one of {', '.join(SHORT_CLIPS)}"
        )
    if (
        isinstance(max_frames, bool)
        or not isinstance(max_frames, (int, np.integer))
        or (max_frames < 1)
    ):
        raise UserError(f"max_frames {max_frames!r}: expected an integer >= 1")
    the_grid = get_grid(grid)
    frames = manifest_df["num_frames"].to_numpy(dtype=np.int64)
    height = manifest_df["height"].to_numpy(dtype=np.int64)
    width = manifest_df["width"].to_numpy(dtype=np.int64)

    if mode == "exact":
        bf = round_down_4k1(np.minimum(frames, max_frames))
        bh = height // PIXEL_STEP * PIXEL_STEP
        bw = width // PIXEL_STEP * PIXEL_STEP
        keep = (bh > 0) & (bw > 0)
    else:
        bf, bh, bw, keep = _aspect(frames, height, width, the_grid, int(max_frames))
        if short_clips == "video":  # below the first video rung: its own 4k+1 length
            short = (bf == 1) & (frames > 1)
            bf[short] = round_down_4k1(np.minimum(frames[short], max_frames))

    _check_own_columns(manifest_df, bf, bh, bw, keep)
    samples = manifest_df.loc[keep].reset_index(drop=True)
    bf, bh, bw = bf[keep], bh[keep], bw[keep]
    samples["bucket_frames"] = bf
    samples["bucket_height"] = bh
    samples["bucket_width"] = bw
    samples["tokens"] = token_count(bf, bh, bw).astype(np.int64)
    excluded = manifest_df.loc[~keep, "sample_id"].reset_index(drop=True)
    return Bucketed(
        samples=samples,
        num_excluded=int((~keep).sum()),
        mode=mode,
        grid=the_grid.name if mode == "aspect" else "exact",
        max_frames=int(max_frames),
        short_clips=short_clips,
        excluded_ids=excluded,
    )


def _check_own_columns(
    frame: pd.DataFrame, bf: np.ndarray, bh: np.ndarray, bw: np.ndarray, keep: np.ndarray
) -> None:
    """UserError if the manifest has a column of its own under a name bucketing writes
    (BUCKET_COLUMNS) with other values: it would be overwritten without a word. The same
    values (a bucketed manifest read back) are fine."""
    made = dict(zip(BUCKET_COLUMNS, (bf, bh, bw, token_count(bf, bh, bw)), strict=True))
    for name, values in made.items():
        if name not in frame.columns:
            continue
        own = pd.to_numeric(frame[name], errors="coerce").to_numpy(np.float64)
        if not np.array_equal(own[keep], values[keep].astype(np.float64)):
            raise UserError(
                f"manifest: column {name!r} is the manifest's own, and bucketing writes its "
                f"own {name!r} (the bucket's); rename or drop that column"
            )


def cut_note(samples: pd.DataFrame, show: int = 5) -> str | None:
    """One clause on the bucketed samples whose bucket keeps fewer than half of their frames
    (a clip trains as its bucket's frame count and size, cut and resized to it), naming the
    first `show`; None when there are none (or the frame has no ``num_frames``)."""
    if "num_frames" not in samples.columns or len(samples) == 0:
        return None
    frames, kept = samples["num_frames"].to_numpy(), samples["bucket_frames"].to_numpy()
    cut = np.flatnonzero((kept * 2 < frames) & ~_stills(samples))  # stills: `stills_warning`
    if cut.size == 0:
        return None
    ids = samples["sample_id"].to_numpy()
    named = ", ".join(f"{ids[i]!r} ({frames[i]} -> {kept[i]} frames)" for i in cut[:show])
    more = " ..." if cut.size > show else ""
    return (
        f"{cut.size} of {len(samples)} samples are cut to fewer than half their frames by "
        f"their bucket (what trains is the bucket's shape), e.g. {named}{more}"
    )


def _stills(samples: pd.DataFrame) -> np.ndarray:
    """Per bucketed sample: a clip (more than one frame) that trains as a 1-frame still."""
    return (samples["bucket_frames"].to_numpy() == 1) & (samples["num_frames"].to_numpy() > 1)


def stills_warning(samples: pd.DataFrame) -> str | None:
    """One clause on the clips that bucketing turned into 1-frame stills (shorter than their
    grid's first video rung): how many, of which lengths, the frames lost, and the option
    that keeps them as clips; None when there are none (or no ``num_frames``)."""
    if "num_frames" not in samples.columns or len(samples) == 0:
        return None
    still = _stills(samples)
    if not still.any():
        return None
    frames = samples["num_frames"].to_numpy()[still]
    return (
        f"{int(still.sum())} of {len(samples)} samples are clips of {frames.min()}-"
        f"{frames.max()} frames below the grid's first video rung: they train as 1-frame "
        f"stills ({int((frames - 1).sum()):,} frames lost); short_clips: video (the "
        "experiment's data section; --short-clips video of plan and compare) keeps those of 5 "
        "frames or more as clips of their own 4k+1 frames"
    )


def _log_aspect(height: np.ndarray, width: np.ndarray) -> np.ndarray:
    """log(height) - log(width) of each sample, through the C library's log for each distinct
    size: numpy's vector log rounds differently on CPUs with AVX-512, and a sample halfway
    between two buckets' aspect ratios would take another bucket on another machine."""
    code, sizes = pd.factorize(height.astype(np.int64) * (1 << 32) + width.astype(np.int64))
    sizes = np.asarray(sizes, dtype=np.int64)
    per_size = [math.log(h) - math.log(w) if h > 0 and w > 0 else math.nan  # never placed
                 for h, w in zip((sizes >> 32).tolist(), (sizes & 0xFFFFFFFF).tolist(),
                                 strict=True)]
    return np.asarray(per_size, dtype=np.float64)[code]


def _aspect(
    frames: np.ndarray, height: np.ndarray, width: np.ndarray, grid: Grid, max_frames: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    n = frames.shape[0]
    bh = np.zeros(n, dtype=np.int64)
    bw = np.zeros(n, dtype=np.int64)
    placed = np.zeros(n, dtype=bool)
    log_ar = _log_aspect(height, width)
    # largest tier first; within a tier the fitting size of nearest aspect ratio wins
    for tier in reversed(grid.tiers):
        best = np.full(n, np.inf)
        tier_h = np.zeros(n, dtype=np.int64)
        tier_w = np.zeros(n, dtype=np.int64)
        open_rows = ~placed
        for h, w in tier.sizes:
            dist = np.abs(log_ar - (math.log(h) - math.log(w)))
            better = open_rows & (height >= h) & (width >= w) & (dist < best)
            best = np.where(better, dist, best)
            tier_h[better] = h
            tier_w[better] = w
        hit = np.isfinite(best)
        bh[hit] = tier_h[hit]
        bw[hit] = tier_w[hit]
        placed |= hit
    ladder = grid.frames(max_frames)
    rung = np.searchsorted(ladder, frames, side="right") - 1  # frames >= 1 so rung >= 0
    bf = ladder[rung]
    return bf, bh, bw, placed
