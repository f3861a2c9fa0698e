"""LatentDataset: bucket-shaped latents, per-id deterministic noise, cached .safetensors."""

import os
import re

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.dataset import LatentDataset, sample_seed
from adaptiveload.data.manifest import validate_manifest
from adaptiveload.errors import UserError

torch.set_num_threads(1)


def bucketed(rows, latent_paths=None) -> pd.DataFrame:
    raw = pd.DataFrame(rows, columns=["sample_id", "num_frames", "height", "width"])
    if latent_paths is not None:
        raw["latent_path"] = latent_paths
    return bucketize(validate_manifest(raw, origin="test"), grid="tiny").samples


SAMPLES = bucketed([("a", 40, 130, 230), ("b", 1, 64, 64), ("c", 70, 200, 340)])


def test_shapes_follow_bucket():
    ds = LatentDataset(SAMPLES, text_len=7, text_dim=12)
    assert len(ds) == 3
    item = ds[0]  # 33 frames, 112x208 -> [16, 9, 14, 26]
    assert item["sample_id"] == "a"
    assert item["latent"].shape == (16, 9, 14, 26) and item["latent"].dtype == torch.float32
    assert item["context"].shape == (7, 12)
    assert ds[1]["latent"].shape == (16, 1, 8, 8)
    assert ds[2]["latent"].shape == (16, 17, 22, 40)  # 65f 176x320


def test_noise_is_deterministic_per_id_and_seed():
    ds = LatentDataset(SAMPLES, text_len=4, text_dim=8)
    reordered = LatentDataset(SAMPLES.iloc[::-1].reset_index(drop=True), text_len=4, text_dim=8)
    assert torch.equal(ds[0]["latent"], reordered[2]["latent"])  # by id, not by position
    assert torch.equal(ds[0]["context"], reordered[2]["context"])
    assert not torch.equal(ds[0]["context"], ds[1]["context"])
    other_seed = LatentDataset(SAMPLES, text_len=4, text_dim=8, seed=1)
    assert not torch.equal(ds[0]["latent"], other_seed[0]["latent"])


def test_seed_is_stable_across_processes():
    """Python's hash() is salted per process; ours is pinned (blake2b of seed, stream, id)."""
    assert sample_seed("a", 0, "latent") == 3330012425370396531


def test_cached_latents(tmp_path):
    good, wrong, nokey = (tmp_path / f"{n}.safetensors" for n in "abc")
    latent = torch.randn(16, 9, 14, 26)
    context = torch.randn(3, 12)
    save_file({"latent": latent, "context": context}, good)
    save_file({"latent": torch.zeros(16, 1, 4, 4), "context": context}, wrong)
    save_file({"other": torch.zeros(1)}, nokey)
    df = bucketed(
        [("a", 40, 130, 230), ("b", 1, 64, 64), ("c", 1, 64, 64)],
        latent_paths=[str(good), str(wrong), str(nokey)],
    )
    ds = LatentDataset(df, text_len=5, text_dim=12)
    item = ds[0]
    assert torch.equal(item["latent"], latent)
    assert torch.equal(item["context"][:3], context) and item["context"][3:].abs().sum() == 0
    with pytest.raises(UserError, match=r"shape \[16, 1, 4, 4\] .* is not \[16, 1, 8, 8\]"):
        ds[1]
    with pytest.raises(UserError, match=r"no tensor 'latent' \(found other\)"):
        ds[2]


def test_a_manifest_mixing_cached_and_uncached_rows_is_refused(tmp_path):
    """A row without latent_path among cached ones would train on seeded noise: refused,
    naming the row; noise stays the path of wholly synthetic data."""
    save_file({"latent": torch.zeros(16, 1, 8, 8), "context": torch.zeros(2, 12)},
              tmp_path / "a.safetensors")
    df = bucketed([("a", 1, 64, 64), ("d", 1, 64, 64)],
                  latent_paths=[str(tmp_path / "a.safetensors"), None])
    with pytest.raises(UserError, match="sample 'd' has no latent_path while 1 others"):
        LatentDataset(df, text_len=5, text_dim=12)


def test_a_latent_without_its_text_embedding_is_refused_never_noise(tmp_path):
    """The text embedding missing, under another key (diffusers' `prompt_embeds`) or in a
    separate file: one line naming the file and the keys found, never seeded noise (which
    would train the model to ignore its prompt)."""
    latent = torch.randn(16, 1, 8, 8)
    save_file({"latent": latent}, tmp_path / "alone.safetensors")
    save_file({"latent": latent, "prompt_embeds": torch.randn(3, 12)},
              tmp_path / "other.safetensors")
    paths = [str(tmp_path / "alone.safetensors"), str(tmp_path / "other.safetensors")]
    ds = LatentDataset(bucketed([("a", 1, 64, 64), ("b", 1, 64, 64)], latent_paths=paths),
                       text_len=5, text_dim=12)
    for i, found in enumerate(["found latent)", "found latent, prompt_embeds)"]):
        with pytest.raises(UserError) as exc:
            ds[i]
        assert paths[i] in str(exc.value) and "no tensor 'context'" in str(exc.value)
        assert found in str(exc.value) and "\n" not in str(exc.value)


def test_latent_paths_stay_in_their_root_and_only_tensor_files_are_opened(tmp_path):
    """A shared manifest's latent_path outside the dataset's root (`..`, absolute, a link) is
    refused when the dataset is made; a FIFO (whose open would block past every signal) is
    refused before it is opened; a .pth file is read with weights_only (a pickle that runs
    code is refused)."""
    root, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    save_file({"latent": torch.zeros(16, 1, 8, 8), "context": torch.zeros(2, 12)},
              elsewhere / "x.safetensors")
    (root / "link.safetensors").symlink_to(elsewhere / "x.safetensors")
    for path in (root / ".." / "elsewhere" / "x.safetensors", elsewhere / "x.safetensors",
                 root / "link.safetensors"):
        with pytest.raises(UserError, match="outside"):
            LatentDataset(bucketed([("a", 1, 64, 64)], latent_paths=[str(path)]), root=root)
    os.mkfifo(root / "fifo.safetensors")
    torch.save({"latent": torch.zeros(16, 1, 8, 8)}, root / "x.pth")
    torch.save({"latent": torch.zeros(16, 1, 8, 8), "code": print}, root / "y.pth")
    (root / "z.npy").write_bytes(b"")
    for name, says in (("fifo.safetensors", "not a regular file (a FIFO"),
                       ("x.pth", "no tensor 'context' (found latent)"),
                       ("y.pth", "cannot be read with torch.load(weights_only=True)"),
                       ("z.npy", "unknown cache file type '.npy'")):
        ds = LatentDataset(bucketed([("a", 1, 64, 64)], latent_paths=[str(root / name)]),
                           text_len=5, text_dim=12)
        with pytest.raises(UserError, match=re.escape(says)):
            ds[0]


def test_needs_bucketed_samples():
    raw = pd.DataFrame({"sample_id": ["a"], "num_frames": [1], "height": [64], "width": [64]})
    with pytest.raises(UserError, match="bucket_frames"):
        LatentDataset(raw)
