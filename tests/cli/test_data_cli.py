"""`adaptiveload manifest ...` end to end, through a real subprocess."""

from pathlib import Path

from PIL import Image
from training_setup import adaptiveload

from adaptiveload.data.manifest import load_manifest


def test_probe_writes_manifest_with_paths_relative_to_it(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    Image.new("RGB", (832, 480)).save(media / "a.png")
    (media / "broken.jpg").write_bytes(b"nope")
    out_dir = tmp_path / "out"
    out = adaptiveload("manifest", "probe", str(media), "-o", str(out_dir / "m.csv"))
    assert out.returncode == 0, out.stderr
    assert "broken.jpg" in out.stderr and "1 skipped" in out.stderr
    df = load_manifest(out_dir / "m.csv")
    assert df["sample_id"].tolist() == ["a.png"]
    assert Path(df["path"].iloc[0]).resolve() == (media / "a.png").resolve()
