"""Synthetic mixtures: deterministic, valid, realistic raw sizes, and the shape each promises."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.manifest import COLUMNS
from adaptiveload.data.mixtures import MIXTURES, synthesize
from adaptiveload.errors import UserError

N = 4000


@pytest.fixture(scope="module", params=sorted(MIXTURES))
def mixture(request):
    return request.param, synthesize(request.param, N, seed=3)


def test_registry_names():
    assert {"paper-mixed", "opensora2-stage1", "images-only", "video-only", "tiny-cpu"} <= set(
        MIXTURES
    )
    for mix in MIXTURES.values():
        assert len(mix.provenance) > 80  # says what it imitates


def test_deterministic_and_seed_sensitive(mixture):
    name, df = mixture
    pd.testing.assert_frame_equal(df, synthesize(name, N, seed=3))
    other = synthesize(name, N, seed=4)
    assert not np.array_equal(other["height"].to_numpy(), df["height"].to_numpy()) or not (
        np.array_equal(other["num_frames"].to_numpy(), df["num_frames"].to_numpy())
    )


def test_valid_columns_and_unique_ids(mixture):
    _, df = mixture
    assert list(df.columns) == list(COLUMNS)
    assert len(df) == N and df["sample_id"].is_unique
    assert (df[["num_frames", "height", "width"]] >= 1).all().all()


def test_raw_sizes_are_not_bucket_aligned(mixture):
    _, df = mixture
    video = df[df["num_frames"] > 1]
    if len(video):
        assert ((video["num_frames"] - 1) % 4 != 0).mean() > 0.3
    assert (df["height"] % 16 != 0).mean() > 0.2 or (df["width"] % 16 != 0).mean() > 0.2


def test_images_only_and_video_only():
    assert (synthesize("images-only", 500, 0)["num_frames"] == 1).all()
    assert (synthesize("video-only", 500, 0)["num_frames"] > 1).all()


def test_paper_mixed_spans_the_wan_token_table():
    b = bucketize(synthesize("paper-mixed", 20_000, 0), grid="wan")
    tok = b.samples["tokens"]
    assert b.num_excluded == 0
    for pinned in (1_560, 3_600, 7_800, 32_760, 75_600):
        assert (tok == pinned).any(), pinned
    images = (b.samples["bucket_frames"] == 1).mean()
    long_hd = (tok == 75_600).mean()
    assert 0.25 < images < 0.45 and 0.02 < long_hd < 0.15  # long tail: few expensive samples


def test_tiny_cpu_token_range():
    b = bucketize(synthesize("tiny-cpu", 20_000, 0), grid="tiny")
    assert b.num_excluded == 0
    assert 10 <= b.samples["tokens"].min() <= 32
    assert 3_000 <= b.samples["tokens"].max() <= 4_096


def test_opensora2_stage1_image_share_and_frame_ranges():
    df = synthesize("opensora2-stage1", 20_000, 0)
    assert abs((df["num_frames"] == 1).mean() - 45 / 70) < 0.02
    assert df["num_frames"].max() <= 132
    long = bucketize(df, grid="wan", max_frames=129).samples["bucket_frames"]
    assert long.max() == 129


def test_bad_arguments():
    with pytest.raises(UserError, match="mixture 'nope'"):
        synthesize("nope", 10, 0)
    with pytest.raises(UserError, match="expected an integer >= 1"):
        synthesize("tiny-cpu", 0, 0)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(sorted(MIXTURES)), n=st.integers(1, 300), seed=st.integers(0, 2**32))
def test_property_generation_is_deterministic(name, n, seed):
    a = synthesize(name, n, seed)
    b = synthesize(name, n, seed)
    pd.testing.assert_frame_equal(a, b)
    assert len(a) == n and a["sample_id"].is_unique


def test_parametric_family_reproduces_paper_mixed_and_moves_its_shares():
    cols = ["num_frames", "height", "width", "fps"]
    same = synthesize("mixed-i35-l20", 3000, 5)[cols]
    pd.testing.assert_frame_equal(same, synthesize("paper-mixed", 3000, 5)[cols])
    heavy = synthesize("mixed-i10-l60", 3000, 5)
    assert (heavy["num_frames"] == 1).mean() == pytest.approx(0.10, abs=0.03)
    assert (heavy["num_frames"] >= 48).mean() > 0.5  # long clips have >= 48 raw frames
    assert (synthesize("mixed-i100-l0", 200, 0)["num_frames"] == 1).all()


@pytest.mark.parametrize("bad", ["mixed-i80-l30", "mixed-ix-l1", "paper"])
def test_parametric_family_rejects_bad_names(bad):
    with pytest.raises(UserError, match="mixture"):
        synthesize(bad, 10, 0)


def test_the_stress_mixtures_are_what_they_say():
    """reference-heavy: about a third of the samples exactly at the 720p x 81-frame reference
    bucket; robotics: mostly 33-121-frame clips, a few 720p x 161-frame ones, and some clips
    below the first video rung."""
    ref = bucketize(synthesize("reference-heavy", 5000, 0), grid="wan").samples["tokens"]
    assert 0.25 < (ref == 75_600).mean() < 0.4 and ref.max() == 75_600
    robots = bucketize(synthesize("robotics", 5000, 0), grid="wan-long", max_frames=161).samples
    raw = robots["num_frames"]
    assert ((raw >= 33) & (raw <= 121)).mean() > 0.85
    assert 0.02 < (robots["tokens"] == 147_600).mean() < 0.1
    assert ((raw > 1) & (robots["bucket_frames"] == 1)).mean() > 0.02
