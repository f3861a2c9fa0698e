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
