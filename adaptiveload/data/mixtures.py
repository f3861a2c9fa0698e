"""Named synthetic manifests that imitate published data recipes, deterministic by seed.

The paper (arXiv 2605.17923) does not publish its data mix, so no mixture here claims to be
it. Each mixture imitates a public recipe or statistic, named in its `provenance`, and every
weight that the source does not give is marked as our assumption. Raw sizes are what sources
look like (1920x1080, 854x480, 4:5 photos, odd frame counts from duration x fps, letterbox
crops), not bucket shapes, so bucketing has real work to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from adaptiveload.data.manifest import COLUMNS, validate_manifest
from adaptiveload.errors import UserError

# (height, width, weight) source sizes; weights are relative within a list
HD_LANDSCAPE = ((1080, 1920, 0.50), (720, 1280, 0.30), (2160, 3840, 0.12), (1440, 2560, 0.08))
HD_PORTRAIT = ((1920, 1080, 0.6), (1280, 720, 0.4))
SD_VIDEO = (
    (480, 854, 0.40),
    (480, 848, 0.15),
    (540, 960, 0.20),
    (360, 640, 0.15),
    (480, 640, 0.10),
)
PHOTOS = (
    (1024, 1024, 0.20),  # square T2I / social
    (1350, 1080, 0.15),  # 4:5 portrait
    (1080, 1920, 0.15),
    (1024, 1536, 0.10),  # 3:2 landscape
    (1536, 1024, 0.10),
    (768, 1024, 0.10),  # 4:3 landscape
    (3000, 4000, 0.10),  # phone camera 4:3
    (720, 1280, 0.05),
    (512, 512, 0.05),
)
CLIP_FPS = ((23.976, 0.25), (24.0, 0.15), (25.0, 0.15), (29.97, 0.25), (30.0, 0.15), (60.0, 0.05))
CROP_SHARE = 0.15  # share of sources centre-cropped (letterbox removal, reframing): odd sizes


@dataclass(frozen=True)
class Frames:
    """How many raw frames a component's samples have.

    ``seconds=(median, sigma)``: log-normal duration times the sample's fps, clipped to
    ``[lo, hi]`` frames. ``seconds=None`` and ``lo == hi == 1``: images. ``seconds=None``
    otherwise: uniform integers in ``[lo, hi]``.
    """

    lo: int = 1
    hi: int = 1
    seconds: tuple[float, float] | None = None

    def sample(self, rng: np.random.Generator, fps: np.ndarray) -> np.ndarray:
        n = fps.shape[0]
        if self.seconds is not None:
            median, sigma = self.seconds
            dur = rng.lognormal(np.log(median), sigma, n)
            raw = np.rint(dur * fps).astype(np.int64)
        else:
            raw = rng.integers(self.lo, self.hi + 1, n)
        return np.clip(raw, self.lo, self.hi)

    @property
    def is_image(self) -> bool:
        return self.hi == 1


IMAGE = Frames()


@dataclass(frozen=True)
class Component:
    weight: float
    sources: tuple[tuple[int, int, float], ...]
    frames: Frames


@dataclass(frozen=True)
class Mixture:
    name: str
    components: tuple[Component, ...]
    provenance: str
    side_divisor: int = 1  # tiny mixtures: every source side // divisor


PAPER_MIXED = Mixture(
    name="paper-mixed",
    components=(
        Component(0.35, PHOTOS, IMAGE),
        Component(0.30, SD_VIDEO, Frames(8, 300, seconds=(2.0, 0.6))),
        Component(0.15, HD_LANDSCAPE + HD_PORTRAIT, Frames(8, 300, seconds=(1.5, 0.6))),
        Component(0.13, SD_VIDEO, Frames(48, 3000, seconds=(8.0, 0.6))),
        Component(0.07, HD_LANDSCAPE, Frames(48, 3000, seconds=(10.0, 0.6))),
    ),
    provenance=(
        "The mix the AdaptiveLoad abstract describes (images + short + long clips at 480p/720p) "
        "with the long tail of world-model / web-video corpora: most samples are images and "
        "short clips, few are long high-resolution clips, which dominate compute. Shares "
        "(35% images, 45% short clips, 20% long clips of which 7 points at 720p+) are our "
        "assumption; the paper does not publish its mix. Under the Wan grid this covers every "
        "row of the Wan 2.1 token table (docs/definitions.md): 1,560..75,600 tokens."
    ),
)

# Open-Sora 2.0 stage 1 (configs/diffusion/train/stage1.py): buckets image bs 45, 5-33f bs 12,
# 37-65f bs 6, 69-97f bs 4, 101-129f bs 3. We give each bucket a sample share proportional
# to its batch size, i.e. every bucket contributes the same number of micro-batches (the
# per-bucket sample counts are not published: our assumption).
_OS2_BS = {(1, 1): 45, (5, 33): 12, (37, 65): 6, (69, 97): 4, (101, 129): 3}
OPENSORA2_STAGE1 = Mixture(
    name="opensora2-stage1",
    components=tuple(
        Component(
            bs / sum(_OS2_BS.values()),
            PHOTOS if lo == 1 else HD_LANDSCAPE + HD_PORTRAIT,
            IMAGE if lo == 1 else Frames(lo, hi + 3),  # raw lengths overshoot the 4k+1 rungs
        )
        for (lo, hi), bs in _OS2_BS.items()
    ),
    provenance=(
        "Open-Sora 2.0 stage-1 bucket table (hpcaitech/Open-Sora configs/diffusion/train/"
        "stage1.py): images and clips of 5-33, 37-65, 69-97 and 101-129 frames with batch "
        "sizes 45/12/6/4/3. Sample shares are proportional to those batch sizes (equal "
        "micro-batch counts per bucket; our assumption). Sources are HD web video; Open-Sora "
        "resizes them to 256px in stage 1, here the bucket grid decides. Use max_frames=129 "
        "to keep its longest buckets."
    ),
)

IMAGES_ONLY = Mixture(
    name="images-only",
    components=(Component(1.0, PHOTOS, IMAGE),),
    provenance=(
        "An image pre-training stage (Wan 2.1 starts with image-only pre-training; Open-Sora "
        "2.0 configs/diffusion/train/image.py): photos and web images at common camera and "
        "social-media sizes (1:1, 4:5, 3:2, 4:3, 16:9). Size shares are our assumption."
    ),
)


def _videosys_zipf(alpha: float = 3.0, offset: int = 5) -> tuple[Component, ...]:
    """Video cells sorted by pixels x frames, sample share ~ (rank + offset)^-alpha."""
    resolutions = ((360, 640), (480, 854), (720, 1280), (1080, 1920))
    lengths = ((17, 32), (33, 64), (65, 128), (129, 256))
    cells = sorted(
        ((h, w, lo, hi) for h, w in resolutions for lo, hi in lengths),
        key=lambda c: c[0] * c[1] * c[2],
    )
    weights = (np.arange(len(cells)) + offset) ** -alpha
    weights = weights / weights.sum()
    return tuple(
        Component(float(p), ((h, w, 1.0),), Frames(lo, hi))
        for p, (h, w, lo, hi) in zip(weights, cells, strict=True)
    )


VIDEO_ONLY = Mixture(
    name="video-only",
    components=_videosys_zipf(),
    provenance=(
        "VideoSys Data-Centric Parallel benchmark data (NUS-HPC-AI-Lab/VideoSys docs/dcp.md): "
        "synthetic Zipf over buckets sorted by pixels x frames, alpha 3.0, offset 5, here "
        "without the image share: 4 resolutions (360p..1080p) x 4 length ranges (17..256 "
        "frames), share of the k-th smallest cell ~ (k + 5)^-3. Our reading of the recipe, "
        "not VideoSys's exact sampler."
    ),
)

TINY_CPU = Mixture(
    name="tiny-cpu",
    components=PAPER_MIXED.components,
    side_divisor=4,
    provenance=(
        "paper-mixed with every source side divided by 4 (1920x1080 -> 480x270) and the "
        "same frame counts; with the tiny grid (Wan grid / 4, clips up to 65 frames) tokens "
        "span about 12..3,825, so tiny Wan models train on 2 CPU cores."
    ),
)

# 480p and 720p sources of world-model and robotics recordings (16:9 ego and fixed cameras,
# 4:3 sensors at 800x600, 1080p recordings); weights are our assumption
WM_480P = ((480, 854, 0.7), (600, 800, 0.3))
WM_720P = ((720, 1280, 0.8), (1080, 1920, 0.2))
LONG_CLIPS = Mixture(
    name="long-clips",
    components=(
        Component(0.05, PHOTOS, IMAGE),
        Component(0.05, SD_VIDEO, Frames(17, 48, seconds=(1.2, 0.4))),
        Component(0.55, WM_480P, Frames(49, 81, seconds=(2.6, 0.25))),
        Component(0.35, WM_720P, Frames(49, 81, seconds=(2.6, 0.25))),
    ),
    provenance=(
        "A long-clip-heavy mix as world-model and robotics corpora look: fixed-length episode "
        "chunks of 2-3.5 s (49-81 frames at 24-30 fps) recorded at 480p and 720p, with few "
        "images and short clips (5% each). Shares, sizes and durations are our assumption. "
        "Under the Wan grid most samples take the 49-81-frame rungs at 480p (about 20k-33k "
        "tokens) and 720p (about 46k-76k): a narrow band of costly samples, so a pack holds "
        "few of them and whole-step rounding, not the spread of lengths, decides the epoch."
    ),
)

# Longer episode chunks of the same 480p and 720p recordings, as Wan 2.2-style training
# (121-frame clips, 5 s at 24 fps) and long-clip sets take them: bucketed on the `wan-long`
# grid (rungs 81, 121 and 161 frames) with max_frames 121 or 161. Durations and shares are
# our assumption.
LONG_CLIPS_121 = Mixture(
    name="long-clips-121",
    components=(
        Component(0.05, PHOTOS, IMAGE),
        Component(0.05, SD_VIDEO, Frames(17, 48, seconds=(1.2, 0.4))),
        Component(0.55, WM_480P, Frames(49, 125, seconds=(4.2, 0.25))),
        Component(0.35, WM_720P, Frames(49, 125, seconds=(4.2, 0.25))),
    ),
    provenance=(
        "long-clips with episode chunks of 2-5 s (49-125 frames at 24-30 fps, median ~4.2 s) "
        "at 480p and 720p, few images and short clips (5% each); shares and durations are our "
        "assumption. On the wan-long grid with max_frames 121 about half the clips take the "
        "121-frame rung: 720p x 121 frames is 111,600 tokens, more than one H200 holds for "
        "Wan 2.1 14B (sequence parallelism: degree 2 and up)."
    ),
)
LONG_CLIPS_161 = Mixture(
    name="long-clips-161",
    components=(
        Component(0.05, PHOTOS, IMAGE),
        Component(0.05, SD_VIDEO, Frames(17, 48, seconds=(1.2, 0.4))),
        Component(0.55, WM_480P, Frames(49, 170, seconds=(5.0, 0.3))),
        Component(0.35, WM_720P, Frames(49, 170, seconds=(5.0, 0.3))),
    ),
    provenance=(
        "long-clips with episode chunks of 2-7 s (49-170 frames at 24-30 fps, median 5 s) at "
        "480p and 720p, few images and short clips (5% each); shares and durations are our "
        "assumption. On the wan-long grid with max_frames 161 the clips spread over the 81-, "
        "121- and 161-frame rungs (480p: 32,760-63,960 tokens; 720p: 75,600-147,600)."
    ),
)


# Stress mixtures of the planners (docs/packing.md): data unlike what the defaults were tuned
# on. 16:9 720p sources only, so no crop leaves the 720p tier's 1280x720 size but by height.
WM_720P_WIDE = ((720, 1280, 0.7), (1080, 1920, 0.3))
REFERENCE_HEAVY = Mixture(
    name="reference-heavy",
    components=(
        Component(0.36, WM_720P_WIDE, Frames(81, 300, seconds=(5.0, 0.3))),
        Component(0.34, WM_480P, Frames(17, 81, seconds=(2.0, 0.5))),
        Component(0.20, WM_720P, Frames(17, 64, seconds=(1.5, 0.4))),
        Component(0.10, PHOTOS, IMAGE),
    ),
    provenance=(
        "A world-model-like set whose longest clips are cut to Wan 2.1's 81 frames: with the "
        "wan grid and max_frames 81 about a third of the samples take exactly the 720p x "
        "81-frame bucket (75,600 tokens), the reference bucket budgets are derived from, so "
        "B_ref of them fill M_comp exactly; the rest are shorter 480p/720p clips and images. "
        "Shares and durations are our assumption; it stresses packs that fill a cap exactly "
        "and steps where ranks must double up the costliest samples (large N)."
    ),
)
# robotics recordings: 4:3 wrist cameras at 640x480 and 16:9 third-person cameras
WRIST_CAMERA = ((480, 640, 1.0),)
THIRD_PERSON = ((480, 854, 0.6), (720, 1280, 0.4))
ROBOTICS = Mixture(
    name="robotics",
    components=(
        Component(0.50, WRIST_CAMERA, Frames(33, 121)),
        Component(0.40, THIRD_PERSON, Frames(33, 121)),
        Component(0.04, WRIST_CAMERA, Frames(9, 16)),
        Component(0.06, ((720, 1280, 1.0),), Frames(161, 200)),
    ),
    provenance=(
        "A robotics-like set (our assumption, after episode-chunked manipulation corpora): "
        "many 33-121-frame clips of 4:3 wrist cameras (256p tier on the Wan grids) and 16:9 "
        "third-person cameras at 480p/720p, a few 9-16-frame wrist clips (below the first "
        "video rung of 17 frames: a bucketing warning) and a few long 720p clips of 161+ "
        "frames. Bucket it on the wan-long grid with max_frames 161: 720p x 161 frames is "
        "147,600 tokens, about twice the 81-frame reference bucket."
    ),
)

MIXTURES: dict[str, Mixture] = {
    m.name: m
    for m in (PAPER_MIXED, OPENSORA2_STAGE1, IMAGES_ONLY, VIDEO_ONLY, TINY_CPU, LONG_CLIPS,
              LONG_CLIPS_121, LONG_CLIPS_161, REFERENCE_HEAVY, ROBOTICS)
}


# The parametric family around paper-mixed: `mixed-i<I>-l<L>` has I% images, L% long clips and
# the rest short clips, each part split over its sources as in paper-mixed (short: 2:1 SD:HD,
# long: 13:7 SD:HD), so `mixed-i35-l20` is paper-mixed's recipe. It maps how the result depends
# on the two shares the paper does not publish.
MIXED_FAMILY = re.compile(r"mixed-i(\d{1,3})-l(\d{1,3})")


def mixed(image_pct: int, long_pct: int) -> Mixture:
    """paper-mixed's components with `image_pct`% images and `long_pct`% long clips."""
    if not (image_pct >= 0 and long_pct >= 0 and image_pct + long_pct <= 100):
        raise UserError(
            f"mixture mixed-i{image_pct}-l{long_pct}: image and long-clip percentages must be "
            ">= 0 and sum to at most 100"
        )
    images, short_sd, short_hd, long_sd, long_hd = PAPER_MIXED.components
    short = (100 - image_pct - long_pct) / 100
    shares = (image_pct / 100, short * 2 / 3, short / 3, long_pct / 100 * 0.65,
              long_pct / 100 * 0.35)
    parts = (images, short_sd, short_hd, long_sd, long_hd)
    return Mixture(
        name=f"mixed-i{image_pct}-l{long_pct}",
        components=tuple(
            Component(w, c.sources, c.frames) for w, c in zip(shares, parts, strict=True)
        ),
        provenance=(
            f"paper-mixed's sources with {image_pct}% images, {long_pct}% long clips and the "
            "rest short clips (our parametric family for mapping the unpublished data mix)"
        ),
    )


def get_mixture(name: str) -> Mixture:
    """A registered mixture, or a member `mixed-i<I>-l<L>` of the parametric family."""
    if name in MIXTURES:
        return MIXTURES[name]
    match = MIXED_FAMILY.fullmatch(name)
    if match is None:
        raise UserError(
            f"mixture '{name}': unknown; expected one of {', '.join(MIXTURES)} or "
            "mixed-i<image %>-l<long-clip %> (e.g. mixed-i35-l20)"
        )
    return mixed(int(match[1]), int(match[2]))


def synthesize(name: str, n: int, seed: int) -> pd.DataFrame:
    """`n` manifest rows of mixture `name`; the same (name, n, seed) gives the same frame."""
    mix = get_mixture(name)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise UserError(f"number of samples {n!r}: expected an integer >= 1")
    rng = np.random.default_rng(seed)
    weights = np.array([c.weight for c in mix.components])
    which = rng.choice(len(mix.components), size=n, p=weights / weights.sum())
    frames = np.ones(n, dtype=np.int64)
    height = np.zeros(n, dtype=np.int64)
    width = np.zeros(n, dtype=np.int64)
    fps = np.full(n, np.nan)
    fps_values = np.array([f for f, _ in CLIP_FPS])
    fps_p = np.array([p for _, p in CLIP_FPS])
    for k, comp in enumerate(mix.components):
        rows = np.flatnonzero(which == k)
        if rows.size == 0:
            continue
        src = np.array([(h, w) for h, w, _ in comp.sources])
        p = np.array([p for _, _, p in comp.sources])
        pick = src[rng.choice(len(src), size=rows.size, p=p / p.sum())]
        height[rows], width[rows] = pick[:, 0], pick[:, 1]
        if not comp.frames.is_image:
            fps[rows] = rng.choice(fps_values, size=rows.size, p=fps_p / fps_p.sum())
        frames[rows] = comp.frames.sample(rng, fps[rows])
    height, width = _crop(rng, height, width)
    height //= mix.side_divisor
    width //= mix.side_divisor
    ids = pd.Series(np.arange(n)).astype(str).str.zfill(len(str(n - 1)))
    frame = pd.DataFrame(
        {
            "sample_id": f"{name}-s{seed}-" + ids,
            "num_frames": frames,
            "height": height,
            "width": width,
            "fps": fps,
        }
    )
    return validate_manifest(frame, origin=f"mixture {name}")[list(COLUMNS)]


def _crop(rng: np.random.Generator, h: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Centre-crop a share of sources by up to 25% per side, to even sizes (as codecs need)."""
    n = h.shape[0]
    cropped = rng.random(n) < CROP_SHARE
    fh = np.where(cropped, rng.uniform(0.75, 1.0, n), 1.0)
    fw = np.where(cropped, rng.uniform(0.75, 1.0, n), 1.0)
    return (h * fh).astype(np.int64) // 2 * 2, (w * fw).astype(np.int64) // 2 * 2
