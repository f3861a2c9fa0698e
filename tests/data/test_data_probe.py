"""Probing real files: the test encodes small videos (PyAV) and images (Pillow) itself."""

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from adaptiveload.data.probe import ProbeWarning, probe_directory
from adaptiveload.errors import UserError


def encode(path: Path, frames: int, height: int, width: int, fps: int, codec: str) -> None:
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream(codec, rate=Fraction(fps))
        stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
        rng = np.random.default_rng(0)
        for _ in range(frames):
            pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    encode(root / "clip.mp4", 13, 48, 80, 24, "libx264")
    (root / "sub").mkdir()
    encode(root / "sub" / "clip.webm", 9, 32, 64, 10, "libvpx-vp9")
    Image.new("RGB", (120, 90), (10, 20, 30)).save(root / "photo.jpg")
    Image.new("RGB", (33, 65)).save(root / "sub" / "tall.png")
    (root / "broken.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 not really a video")
    (root / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (root / "notes.txt").write_text("not media, ignored")
    return root


def test_probe_reads_frames_size_fps_and_skips_broken(media):
    with pytest.warns(ProbeWarning) as caught:
        probed = probe_directory(media, progress=False)
    df = probed.manifest.set_index("sample_id")
    assert sorted(df.index) == ["clip.mp4", "photo.jpg", "sub/clip.webm", "sub/tall.png"]
    assert df.loc["clip.mp4", ["num_frames", "height", "width"]].tolist() == [13, 48, 80]
    assert df.loc["clip.mp4", "fps"] == pytest.approx(24)
    assert df.loc["sub/clip.webm", ["num_frames", "height", "width"]].tolist() == [9, 32, 64]
    assert df.loc["sub/clip.webm", "fps"] == pytest.approx(10)
    assert df.loc["photo.jpg", ["num_frames", "height", "width"]].tolist() == [1, 90, 120]
    assert np.isnan(df.loc["photo.jpg", "fps"])
    assert df.loc["sub/tall.png", ["height", "width"]].tolist() == [65, 33]
    assert probed.num_skipped == 2
    assert sorted(rel for rel, _ in probed.skipped) == ["broken.mp4", "broken.png"]
    messages = " ".join(str(w.message) for w in caught)
    assert "broken.mp4" in messages and "broken.png" in messages


def test_probe_errors(tmp_path):
    with pytest.raises(UserError, match="not a directory"):
        probe_directory(tmp_path / "nope", progress=False)
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(UserError, match="no readable video or image"):
        probe_directory(tmp_path, progress=False)
