"""Build a manifest from a directory of real media: frames, height, width, fps per file.

Videos are read with PyAV (container metadata; packets are counted when the container does not
store a frame count; nothing is decoded), images with Pillow (header only). A file with a
media extension that cannot be read is skipped with a warning naming it, and counted;
files with other extensions are ignored.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload.data.manifest import COLUMNS, validate_manifest
from adaptiveload.errors import UserError
from adaptiveload.extras import require
from adaptiveload.progress import progress_bar

VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg"})
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff"})


class ProbeWarning(UserWarning):
    """A media file was skipped because it could not be read."""


@dataclass
class Probed:
    manifest: pd.DataFrame  # paths relative to the probed directory
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (relative path, reason)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def probe_directory(directory: str | Path, progress: bool = True) -> Probed:
    """Probe every video and image under `directory` (recursively, in sorted order)."""
    root = Path(directory)
    if not root.is_dir():
        raise UserError(f"{root}: not a directory; expected a folder of videos and images")
    media = VIDEO_SUFFIXES | IMAGE_SUFFIXES
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in media)
    # checked once here: inside the loop a missing package would skip every file as unreadable
    if any(p.suffix.lower() in VIDEO_SUFFIXES for p in files):
        require("av")
    if any(p.suffix.lower() in IMAGE_SUFFIXES for p in files):
        require("PIL.Image")
    rows: list[tuple[str, int, int, int, float]] = []
    skipped: list[tuple[str, str]] = []
    for path in progress_bar(iterable=files, desc="probe", unit="file", disable=not progress):
        rel = path.relative_to(root).as_posix()
        try:
            frames, height, width, fps = (
                _probe_video(path) if path.suffix.lower() in VIDEO_SUFFIXES else _probe_image(path)
            )
        except Exception as exc:  # PyAV and Pillow raise many types for broken files
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            skipped.append((rel, reason))
            warnings.warn(f"{path}: skipped, cannot be read: {reason}", ProbeWarning, stacklevel=2)
            continue
        rows.append((rel, frames, height, width, fps))
    if not rows:
        raise UserError(
            f"{root}: no readable video or image files ({len(skipped)} skipped); expected files "
            f"ending in {', '.join(sorted(media))}"
        )
    ids, frames, heights, widths, fps = zip(*rows, strict=True)
    raw = pd.DataFrame(
        {
            "sample_id": ids,
            "num_frames": np.array(frames, dtype=np.int64),
            "height": np.array(heights, dtype=np.int64),
            "width": np.array(widths, dtype=np.int64),
            "fps": np.array(fps, dtype=np.float64),
            "path": ids,
        }
    )
    manifest = validate_manifest(raw, origin=str(root))[list(COLUMNS)]
    return Probed(manifest=manifest, skipped=skipped)


def _probe_video(path: Path) -> tuple[int, int, int, float]:
    import av

    with av.open(str(path)) as container:
        if not container.streams.video:
            raise ValueError("no video stream")
        stream = container.streams.video[0]
        height, width = stream.codec_context.height, stream.codec_context.width
        rate = stream.average_rate or stream.guessed_rate
        fps = float(rate) if rate else float("nan")
        frames = stream.frames
        if not frames:  # containers such as WebM/MKV store no count: count packets
            frames = sum(1 for pkt in container.demux(stream) if pkt.size)
    if frames < 1 or height < 1 or width < 1:
        raise ValueError(f"empty video stream ({frames} frames, {width}x{height})")
    return int(frames), int(height), int(width), fps


def _probe_image(path: Path) -> tuple[int, int, int, float]:
    from PIL import Image

    with Image.open(path) as img:
        img.verify()  # header + structure check without decoding pixels
        width, height = img.size
    return 1, int(height), int(width), float("nan")
