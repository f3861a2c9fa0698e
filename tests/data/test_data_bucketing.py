"""Bucketing: never upscales, tokens follow the one formula, deterministic, exclusions counted."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptiveload.data.bucketing import (
    GRIDS,
    TINY_GRID,
    WAN_GRID,
    bucketize,
    cut_note,
    stills_warning,
)
from adaptiveload.data.manifest import validate_manifest
from adaptiveload.errors import UserError
from adaptiveload.tokens import token_count


def manifest(rows) -> pd.DataFrame:
    frames, heights, widths = zip(*rows, strict=True) if rows else ((), (), ())
    raw = pd.DataFrame(
        {
            "sample_id": [f"s{i}" for i in range(len(rows))],
            "num_frames": np.array(frames, dtype=np.int64),
            "height": np.array(heights, dtype=np.int64),
            "width": np.array(widths, dtype=np.int64),
        }
    )
    return validate_manifest(raw, origin="test")


def one(frames, height, width, **kw) -> tuple[int, int, int, int] | None:
    out = bucketize(manifest([(frames, height, width)]), **kw).samples
    if out.empty:
        return None
    row = out.iloc[0]
    return tuple(int(row[c]) for c in ("bucket_frames", "bucket_height", "bucket_width", "tokens"))


def test_wan_native_shapes_and_pinned_tokens():
    assert one(81, 480, 832) == (81, 480, 832, 32_760)
    assert one(81, 720, 1280) == (81, 720, 1280, 75_600)
    assert one(1, 480, 832) == (1, 480, 832, 1_560)
    assert one(200, 1080, 1920) == (81, 720, 1280, 75_600)  # 1080p source, long clip
    assert one(200, 1920, 1080) == (81, 1280, 720, 75_600)  # portrait twin
    assert one(60, 480, 854) == (49, 480, 832, 20_280)  # largest rung <= 60 frames
    assert one(1, 1024, 1024) == (1, 960, 960, 3_600)  # 1:1 at 720p area


def test_wan_grid_contents():
    sizes = set(WAN_GRID.sizes())
    assert {(480, 832), (832, 480), (720, 1280), (1280, 720)} <= sizes
    assert WAN_GRID.frames(81).tolist() == [1, 17, 33, 49, 65, 81]
    assert WAN_GRID.frames(121).tolist() == [1, 17, 33, 49, 65, 81, 97, 113, 121]
    assert WAN_GRID.frames(30).tolist() == [1, 17, 29]
    assert TINY_GRID.frames(81).tolist() == [1, 17, 33, 49, 65]  # capped at 65


def test_tiny_grid_token_span():
    toks = [token_count(f, h, w) for f in TINY_GRID.frames(81) for h, w in TINY_GRID.sizes()]
    assert 10 <= min(toks) <= 16 and 3_500 <= max(toks) <= 4_096


def test_nearest_aspect_ratio_within_largest_fitting_tier():
    # 4:3 photo at 720p area -> the ~3:4 size of that tier, not 16:9
    assert one(1, 3000, 4000)[1:3] == (832, 1104)
    # too small for any 480p size (640 < 720 wide needed by 544x720) -> 256p tier
    assert one(1, 480, 640)[1:3] == (224, 288)


def test_smaller_than_smallest_bucket_is_excluded_and_counted():
    df = manifest([(81, 480, 832), (81, 100, 100), (1, 191, 5000), (5, 15, 15)])
    b = bucketize(df)
    assert b.num_excluded == 3 and len(b.samples) == 1
    assert sorted(b.excluded_ids) == ["s1", "s2", "s3"]
    assert b.num_samples == 4
    # exact keeps what is >= 16 px a side
    e = bucketize(df, mode="exact")
    assert e.num_excluded == 1 and e.excluded_ids.tolist() == ["s3"]


def test_exact_mode_rounds_down():
    assert one(100, 487, 850, mode="exact") == (81, 480, 848, 21 * 30 * 53)
    assert one(100, 487, 850, mode="exact", max_frames=50) == (49, 480, 848, 13 * 30 * 53)
    assert one(4, 16, 16, mode="exact") == (1, 16, 16, 1)


def test_bad_arguments():
    df = manifest([(1, 64, 64)])
    with pytest.raises(UserError, match="mode 'x'"):
        bucketize(df, mode="x")
    with pytest.raises(UserError, match="grid 'huge'"):
        bucketize(df, grid="huge")
    with pytest.raises(UserError, match="max_frames"):
        bucketize(df, max_frames=0)


def test_bucket_table_and_stats():
    df = manifest([(81, 480, 832)] * 3 + [(1, 480, 832)] * 2)
    b = bucketize(df)
    table = b.bucket_table()
    assert table.to_dict(orient="records") == [
        {"frames": 1, "height": 480, "width": 832, "tokens": 1560, "count": 2},
        {"frames": 81, "height": 480, "width": 832, "tokens": 32760, "count": 3},
    ]
    stats = b.token_stats()
    assert stats["min"] == 1560 and stats["max"] == 32760 and stats["p50"] == 32760


shapes = st.lists(
    st.tuples(st.integers(1, 400), st.integers(1, 4000), st.integers(1, 4000)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(
    rows=shapes,
    mode=st.sampled_from(["aspect", "exact"]),
    grid=st.sampled_from(sorted(GRIDS)),
    max_frames=st.integers(1, 129),
)
def test_property_bucket_never_exceeds_sample_and_tokens_follow_formula(
    rows, mode, grid, max_frames
):
    df = manifest(rows)
    b = bucketize(df, mode=mode, grid=grid, max_frames=max_frames)
    s = b.samples
    assert len(s) + b.num_excluded == len(df)
    f, h, w = (s[c].to_numpy() for c in ("bucket_frames", "bucket_height", "bucket_width"))
    assert (f <= s["num_frames"]).all() and (f <= max_frames).all()
    assert (h <= s["height"]).all() and (w <= s["width"]).all()
    assert ((f - 1) % 4 == 0).all() and (h % 16 == 0).all() and (w % 16 == 0).all()
    assert (h > 0).all() and (w > 0).all()
    assert np.array_equal(s["tokens"].to_numpy(), token_count(f, h, w))
    # deterministic: same input, same output
    again = bucketize(df, mode=mode, grid=grid, max_frames=max_frames)
    pd.testing.assert_frame_equal(again.samples, s)


@settings(max_examples=40, deadline=None)
@given(rows=shapes)
def test_property_aspect_picks_largest_fitting_tier(rows):
    """No kept sample could have fitted a size of a strictly larger-area tier."""
    b = bucketize(manifest(rows), grid="wan")
    area_of = {size: i for i, t in enumerate(WAN_GRID.tiers) for size in t.sizes}
    for _, r in b.samples.iterrows():
        tier = area_of[(r.bucket_height, r.bucket_width)]
        for bigger in WAN_GRID.tiers[tier + 1 :]:
            assert not any(r.height >= h and r.width >= w for h, w in bigger.sizes)


def test_clips_below_the_first_video_rung_are_said_or_kept():
    """A 9-16-frame clip on a ladder whose first video rung is 17 frames trains as a still,
    with a warning naming how many and the frames lost; short_clips='video' keeps it as a clip
    of its own 4k+1 frames (a 3-frame clip has none above 1 and stays a still)."""
    rows = [(9, 480, 832), (16, 480, 832), (3, 480, 832), (40, 480, 832), (1, 480, 832)]
    still = bucketize(manifest(rows), grid="wan")
    assert still.samples["bucket_frames"].tolist() == [1, 1, 1, 33, 1]
    said = stills_warning(still.samples)
    assert said.startswith("3 of 5 samples are clips of 3-16 frames") and "(25 frames lost)" in said
    assert cut_note(still.samples) is None  # said once, by the warning
    video = bucketize(manifest(rows), grid="wan", short_clips="video")
    assert video.samples["bucket_frames"].tolist() == [9, 13, 1, 33, 1]
    assert video.samples["tokens"].tolist()[:2] == [token_count(9, 480, 832),
                                                    token_count(13, 480, 832)]
    assert stills_warning(video.samples).startswith("1 of 5 samples are clips of 3-3 frames")
    with pytest.raises(UserError, match="short_clips 'pad'"):
        bucketize(manifest(rows), short_clips="pad")
