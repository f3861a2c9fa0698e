"""The latent cache: importers of this project's, musubi-tuner's and DiffSynth-Studio's layouts,
shapes from headers, frame windows, held-out split, caption dropout, and the errors that
replace silent noise."""

import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.dataset import LatentDataset
from adaptiveload.data.importers import CacheWarning, import_cache
from adaptiveload.data.latents import read_header, save_sample, save_text
from adaptiveload.errors import UserError

torch.set_num_threads(1)
C, D = 16, 12  # latent channels, text width


def dataset(manifest: pd.DataFrame, **kw) -> LatentDataset:
    samples = bucketize(manifest, mode="exact", max_frames=1000).samples
    return LatentDataset(samples, latent_channels=C, text_len=6, text_dim=D, **kw)


def musubi_cache(root, clips=(("cat", 9), ("dog", 3))):
    """musubi-tuner's Wan layout: <item>_<start>-<frames>_<W>x<H>_wan.safetensors latents
    (key latents_FxHxW_bf16) and one <item>_wan_te.safetensors (key varlen_t5_bf16) each."""
    tensors = {}
    for item, frames in clips:
        latent = torch.randn(C, frames, 4, 6).to(torch.bfloat16)
        text = torch.randn(3, D).to(torch.bfloat16)
        save_file(
            {f"latents_{frames}x4x6_bf16": latent},
            root / f"{item}_00000-{4 * frames - 3:03d}_0048x0032_wan.safetensors",
        )
        save_file({"varlen_t5_bf16": text}, root / f"{item}_wan_te.safetensors")
        tensors[item] = (latent.float(), text.float())
    return tensors


def test_musubi_cache_imports_from_headers_with_windows_split_and_shared_text(tmp_path):
    tensors = musubi_cache(tmp_path)
    with pytest.warns(CacheWarning, match="1 clip.* shorter than a window of 5 latent frames"):
        got = import_cache(tmp_path, "musubi", windows=3, window_frames=5, val_fraction=0.3)
    m = got.manifest.set_index("sample_id")
    cat = "cat_00000-033_0048x0032_wan"
    # 9 latent frames, windows of 5 at latent frames 0, 2, 4; the 3-frame dog is one sample
    assert list(m.index) == [f"{cat}#0", f"{cat}#2", f"{cat}#4", "dog_00000-009_0048x0032_wan"]
    assert m.loc[f"{cat}#2", ["num_frames", "height", "width"]].tolist() == [17, 32, 48]
    assert m.loc[f"{cat}#2", "latent_key"] == "latents_9x4x6_bf16"
    assert m.loc[f"{cat}#2", "text_key"] == "varlen_t5_bf16"
    assert m["split"].nunique() == 2 and m.groupby("latent_path")["split"].nunique().max() == 1
    ds = dataset(got.manifest)
    item = ds[ds.sample_ids.index(f"{cat}#2")]
    latent, text = tensors["cat"]
    assert torch.equal(item["latent"], latent[:, 2:7])  # the window, read from the cache
    assert torch.equal(item["context"][:3], text) and item["context"][3:].abs().sum() == 0


def test_musubi_section_index_names_import(tmp_path):
    """musubi-tuner's frame-extraction names may carry a section index (`00000-033-01`); a
    file of no musubi name is left out with a warning, never silently."""
    musubi_cache(tmp_path, clips=(("cat", 2),))
    latent = next(tmp_path.glob("cat_*_wan.safetensors"))
    latent.rename(tmp_path / "cat_00000-005-01_0048x0032_wan.safetensors")
    save_text(tmp_path / "empty_text.safetensors", torch.zeros(1, D))  # an embedding: no word
    save_file({"x": torch.zeros(1)}, tmp_path / "cat_wan.safetensors")
    with pytest.warns(CacheWarning, match=r"1 \.safetensors file.* left out, e\.g\. cat_wan"):
        got = import_cache(tmp_path, "musubi").manifest
    assert got["sample_id"].tolist() == ["cat_00000-005-01_0048x0032_wan"]
    assert got["text_path"].str.endswith("cat_wan_te.safetensors").all()


def test_musubi_cache_without_its_text_encoder_output_is_refused(tmp_path):
    musubi_cache(tmp_path, clips=(("cat", 2),))
    (tmp_path / "cat_wan_te.safetensors").unlink()
    with pytest.raises(UserError, match=r"text encoder cache cat_wan_te\.safetensors is not in"):
        import_cache(tmp_path, "musubi")


def test_diffsynth_pth_caches_of_both_trainers_import_and_load(tmp_path):
    """`<video>.tensors.pth` (latents, prompt_emb.context), the newer trainer's
    `sft:data_process` output `<rank>/<n>.pth` (a tuple: shared inputs with input_latents and
    the noise under latents, the positive prompt's context, the negative's), and the same
    keys in one dict; batch dim 1, read with weights_only: no 'header too large'. The clip is
    input_latents, never the noise."""
    old, new = torch.randn(1, C, 2, 4, 4), torch.randn(1, C, 1, 6, 2)
    text, negative = torch.randn(1, 5, D), torch.randn(1, 5, D)
    (tmp_path / "train").mkdir()
    torch.save(
        {"latents": old, "prompt_emb": {"context": text}, "image_emb": {}},
        tmp_path / "train" / "a.mp4.tensors.pth",
    )
    shared = {
        "input_latents": new,
        "latents": torch.randn_like(new),
        "height": 48,
        "tiled": False,
        "rand_device": torch.device("cpu"),
    }
    (tmp_path / "0").mkdir()
    torch.save((shared, {"context": text}, {"context": negative}), tmp_path / "0" / "0.pth")
    torch.save({**shared, "context": text}, tmp_path / "flat.pth")
    got = import_cache(tmp_path, "diffsynth").manifest.set_index("sample_id")
    assert got.loc["train/a.mp4", ["num_frames", "height", "width"]].tolist() == [5, 32, 32]
    assert got.loc["0/0", ["latent_key", "text_key"]].tolist() == ["0.input_latents", "1.context"]
    assert got.loc["flat", ["latent_key", "text_key"]].tolist() == ["input_latents", "context"]
    assert got.loc["train/a.mp4", "text_key"] == "prompt_emb.context"
    ds = dataset(got.reset_index())
    by_id = {ds.sample_ids[i]: ds[i] for i in range(len(ds))}
    assert torch.equal(by_id["train/a.mp4"]["latent"], old[0])
    for sample in ("0/0", "flat"):
        assert torch.equal(by_id[sample]["latent"], new[0])
        assert torch.equal(by_id[sample]["context"][:5], text[0])


def test_a_misnamed_text_embedding_is_an_error_naming_file_and_keys(tmp_path):
    torch.save(
        {"latents": torch.randn(C, 1, 4, 4), "prompt_embeds": torch.randn(3, D)},
        tmp_path / "x.tensors.pth",
    )
    with pytest.raises(UserError) as exc:
        import_cache(tmp_path, "diffsynth")
    message = str(exc.value)
    assert "x.tensors.pth" in message and "found latents, prompt_embeds" in message
    assert "\n" not in message


def test_odd_latent_sides_are_refused_at_import(tmp_path):
    save_sample(tmp_path / "a.safetensors", torch.randn(C, 1, 5, 4), torch.randn(2, D))
    with pytest.raises(UserError, match=r"shape \[16, 1, 5, 4\]; expected .* even H' and W'"):
        import_cache(tmp_path, "adaptiveload")


def test_own_layout_shares_one_text_file_and_reads_headers_only(tmp_path):
    save_text(tmp_path / "caption0.safetensors", torch.randn(4, D))
    for i in range(3):
        save_sample(
            tmp_path / f"s{i}.safetensors",
            torch.randn(C, 2, 4, 4),
            text_file="caption0.safetensors",
        )
    shapes, meta = read_header(tmp_path / "s0.safetensors")
    assert shapes == {"latent": (C, 2, 4, 4)} and meta == {"text_file": "caption0.safetensors"}
    got = import_cache(tmp_path, "adaptiveload").manifest
    assert got["text_path"].nunique() == 1 and len(got) == 3
    (tmp_path / "caption0.safetensors").unlink()
    with pytest.raises(UserError, match=r"its text_file 'caption0\.safetensors'"):
        import_cache(tmp_path, "adaptiveload")


def test_caption_dropout_is_seeded_per_sample_and_epoch(tmp_path):
    save_text(tmp_path / "empty.safetensors", torch.zeros(1, D))
    save_text(tmp_path / "text.safetensors", torch.ones(2, D))
    for i in range(40):
        save_sample(
            tmp_path / f"s{i:02d}.safetensors",
            torch.randn(C, 1, 2, 2),
            text_file="text.safetensors",
        )
    manifest = import_cache(tmp_path, "adaptiveload").manifest
    with pytest.raises(UserError, match=r"caption_dropout 0\.5 needs data\.empty_text"):
        dataset(manifest, caption_dropout=0.5)
    ds = dataset(manifest, caption_dropout=0.5, empty_text=str(tmp_path / "empty.safetensors"))

    def dropped(epoch):
        return [bool(ds.item(i, epoch)["context"].sum() == 0) for i in range(len(ds))]

    first = dropped(0)
    assert first == dropped(0)  # the same on every rank, worker and resumed run
    assert 8 <= sum(first) <= 32 and first != dropped(1)
    assert not any(dataset(manifest)[i]["context"].sum() == 0 for i in range(len(ds)))
