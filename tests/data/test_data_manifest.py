"""Manifest loading: every kind of bad row is caught, named by file, row and column."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from adaptiveload.data.manifest import COLUMNS, load_manifest, validate_manifest, write_manifest
from adaptiveload.errors import UserError

GOOD = """sample_id,num_frames,height,width,fps
007,81,480,832,16
b,1,1024,1024,
c,121,1080,1920,29.97
"""


def _csv(tmp_path: Path, text: str, name: str = "m.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _error(path: Path) -> str:
    with pytest.raises(UserError) as info:
        load_manifest(path)
    return str(info.value)


def test_good_csv_is_typed(tmp_path):
    df = load_manifest(_csv(tmp_path, GOOD))
    assert list(df.columns) == list(COLUMNS)
    assert df["sample_id"].tolist() == ["007", "b", "c"]  # ids stay strings
    for col in ("num_frames", "height", "width"):
        assert df[col].dtype == np.int64
    assert df["num_frames"].tolist() == [81, 1, 121]
    assert np.isnan(df["fps"].iloc[1]) and df["fps"].iloc[2] == pytest.approx(29.97)
    assert df["latent_path"].isna().all()


def test_parquet_round_trip(tmp_path):
    df = load_manifest(_csv(tmp_path, GOOD))
    write_manifest(tmp_path / "m.parquet", df)
    back = load_manifest(tmp_path / "m.parquet")
    pd.testing.assert_frame_equal(back, df)


def test_relative_paths_resolve_against_manifest_dir(tmp_path):
    sub = tmp_path / "data"
    sub.mkdir()
    text = "sample_id,num_frames,height,width,path,latent_path\na,1,64,64,img/a.png,/abs/a.st\n"
    df = load_manifest(_csv(sub, text))
    assert df["path"].iloc[0] == str(sub.resolve() / "img" / "a.png")
    assert df["latent_path"].iloc[0] == "/abs/a.st"


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ("a,81,480,832\na,1,64,64\n", ["sample_id", "unique", "'a'", "lines 2, 3"]),
        ("a,81,-480,832\n", ["'height'", "line 2", "-480", "from 1 to 16384"]),
        ("a,81,480,0\n", ["'width'", "line 2"]),
        ("a,81.5,480,832\n", ["'num_frames'", "line 2", "not a whole number"]),
        ("a,abc,480,832\n", ["'num_frames'", "line 2", "'abc'"]),
        ("a,81,,832\n", ["'height'", "line 2", "empty"]),
        ("a,81,480,20000\n", ["'width'", "line 2", "20000", "16384"]),
        ("a,200000,480,832\n", ["'num_frames'", "line 2", "100000"]),
        (",81,480,832\n", ["'sample_id'", "line 2", "non-empty"]),
    ],
)
def test_bad_rows_are_named(tmp_path, body, needles):
    path = _csv(tmp_path, "sample_id,num_frames,height,width\n" + body)
    msg = _error(path)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_many_bad_rows_show_first_few_and_count(tmp_path):
    rows = "".join(f"s{i},{-i if i % 2 else 81},480,832\n" for i in range(1, 41))
    msg = _error(_csv(tmp_path, "sample_id,num_frames,height,width\n" + rows))
    assert "lines 2 (-1), 4 (-3), 6 (-5), 8 (-7), 10 (-9) and 15 more" in msg
    assert "20 bad rows" in msg


def test_missing_column_empty_file_header_only_unknown_suffix(tmp_path):
    assert "missing column(s) width" in _error(
        _csv(tmp_path, "sample_id,num_frames,height\na,1,2\n")
    )
    assert "file is empty" in _error(_csv(tmp_path, ""))
    assert "no samples" in _error(_csv(tmp_path, "sample_id,num_frames,height,width\n"))
    assert "expected .csv or .parquet" in _error(_csv(tmp_path, GOOD, "m.txt"))
    assert "no such manifest" in _error(tmp_path / "absent.csv")


def test_parquet_rows_are_one_based_rows(tmp_path):
    df = pd.DataFrame(
        {
            "sample_id": ["a", "b", "c"],
            "num_frames": [1, 0, 5],
            "height": [64] * 3,
            "width": [64] * 3,
        }
    )
    df.to_parquet(tmp_path / "m.parquet")
    msg = _error(tmp_path / "m.parquet")
    assert "row 2 (0)" in msg and "'num_frames'" in msg


def test_garbage_parquet_is_a_user_error(tmp_path):
    (tmp_path / "m.parquet").write_bytes(b"not parquet at all")
    assert "cannot be parsed" in _error(tmp_path / "m.parquet")


def test_every_bad_column_is_reported_at_once(tmp_path):
    body = "sample_id,num_frames,height,width\na,1.5,480,832\nb,81,-4,832\nb,81,480,x\n"
    msg = _error(_csv(tmp_path, body))
    assert msg.count(" | ") == 3, msg
    for needle in ("'sample_id'", "'num_frames': 1 bad row, at line 2 (1.5)", "'height'", "'x'"):
        assert needle in msg, (needle, msg)


def test_bad_fps(tmp_path):
    msg = _error(_csv(tmp_path, "sample_id,num_frames,height,width,fps\na,81,480,832,-3\n"))
    assert "'fps'" in msg and "line 2" in msg


def test_validate_ignores_the_input_index():
    raw = pd.DataFrame(
        {"sample_id": ["a", "b"], "num_frames": [1, 5], "height": [64, 64], "width": [64, 80]},
        index=[10, 3],
    )
    df = validate_manifest(raw, origin="frame")
    assert df["sample_id"].tolist() == ["a", "b"] and df["width"].tolist() == [64, 80]


def _mixed_optional_cells(n: int) -> pd.DataFrame:
    """n rows where each optional column is empty in a different, interleaved pattern."""
    rng = np.random.default_rng(0)
    image = rng.random(n) < 0.3
    return pd.DataFrame(
        {
            "sample_id": [f"s{i:06d}" for i in range(n)],
            "num_frames": np.where(image, 1, rng.integers(17, 122, n)),
            "height": rng.choice([480, 720, 1080], n),
            "width": rng.choice([832, 1280, 1920], n),
            "fps": np.where(image, np.nan, rng.choice([16.0, 24.0, 30.0], n)),
            "path": np.where(rng.random(n) < 0.5, None, [f"v/{i}.mp4" for i in range(n)]),
            "caption": np.where(rng.random(n) < 0.2, None, "a caption, with a comma"),
            "latent_path": np.where(rng.random(n) < 0.9, None, "lat.safetensors"),
        }
    )


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_many_rows_with_empty_optional_cells_load(tmp_path, suffix):
    """Images leave fps empty; paths and captions come and go: all of it is a valid manifest.

    The first rows are complete, so a reader that infers integer fps from them and then
    meets an empty cell (pandas' pyarrow engine with `dtype=`) would fail here.
    """
    frame = _mixed_optional_cells(5000).sort_values("fps", na_position="last")
    frame.loc[frame.index[:10], "fps"] = 24.0  # a run of whole numbers before the first gap
    path = tmp_path / f"m.{suffix}"
    if suffix == "csv":  # integer fps as users write it ("16", not "16.0"), empty for images
        frame.astype({"fps": "Int64"}).to_csv(path, index=False)
    else:
        frame.to_parquet(path)
    df = load_manifest(path)
    assert len(df) == 5000
    assert df["fps"].isna().sum() == frame["fps"].isna().sum() > 0
    assert df["path"].isna().sum() == frame["path"].isna().sum() > 0
    assert df["caption"].isna().sum() == frame["caption"].isna().sum() > 0
    assert df["num_frames"].dtype == np.int64
    assert df.loc[df["num_frames"] == 1, "fps"].isna().all()
    present = df["path"].notna()
    assert df.loc[present, "path"].str.startswith(str(tmp_path.resolve())).all()


def test_empty_required_cell_is_named_by_line_after_valid_rows(tmp_path):
    rows = "".join(f"s{i},81,480,832,16\n" for i in range(50))
    body = "sample_id,num_frames,height,width,fps\n" + rows + "bad,81,,832,\n" + rows.replace(
        "s", "t"
    )
    msg = _error(_csv(tmp_path, body))
    assert "column 'height': 1 bad row, at line 52 (empty)" in msg, msg
    assert "the cell is empty" in msg and "'fps'" not in msg, msg
