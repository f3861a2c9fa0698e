"""What a run reads of a manifest of cached latents (adaptiveload.training.inputs): every
latent_path inside data.root (by default the manifest's folder), and no validation score of
synthetic samples passed off as one of the user's data."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from training_setup import write_experiment

from adaptiveload import experiment
from adaptiveload.data.manifest import load_manifest, write_manifest
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.planning.sampler import PlanWarning
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import prepare_data, split_holdout
from adaptiveload.training.loop import Trainer
from adaptiveload.training.settings import from_experiment


def _run(tmp_path, latent_path: str, **fields):
    torch.set_num_threads(1)
    manifest = tmp_path / "data" / "manifest.csv"
    manifest.parent.mkdir(exist_ok=True)
    # cached latents keep their shape: sizes of a bucket of the exact bucketing
    rows = synthesize("tiny-cpu", 120, 0).assign(
        latent_path=latent_path, num_frames=17, height=64, width=64
    )
    write_manifest(manifest, rows)
    data = {"manifest": str(manifest), "bucketing": "exact", **fields.pop("data", {})}
    exp = experiment.load(write_experiment(tmp_path, data=data, **fields))
    return prepare_data(exp, from_experiment(exp, "adaptiveload", 0, launch_mode="emulated",
                                                     world_size=3))


def test_latent_paths_outside_data_root_are_refused(tmp_path):
    with pytest.raises(UserError, match=r"latent_path resolves to .*, outside .*/data;"):
        _run(tmp_path, "../elsewhere/x.safetensors", val_every=0)
    data = _run(tmp_path, "../elsewhere/x.safetensors", val_every=0,
                data={"root": str(tmp_path)})  # the root the experiment names holds them
    assert data.builder.samples["latent_path"].notna().all()


def test_validation_of_synthetic_samples_on_a_manifest_of_latents_is_refused(tmp_path):
    with pytest.raises(UserError) as exc:
        _run(tmp_path, "x.safetensors", val_every=2)
    assert "train.val_every: 2" in str(exc.value) and "set train.val_every: 0" in str(exc.value)


def test_a_diverged_loss_is_one_line_naming_the_lr(tmp_path):
    """An in-schema lr of 10 drives the loss to NaN within a few steps: one UserError line
    (exit 2 from the CLI) naming train.lr, not a FloatingPointError traceback."""
    torch.set_num_threads(1)
    exp = experiment.load(write_experiment(tmp_path, lr=10, lr_warmup_steps=0, grad_clip=1e6,
                                           steps=20, warmup_steps=0))
    cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=1)
    trainer = Trainer(cfg, prepare_data(exp, cfg), None, Ranks.emulated(1), progress=False)
    try:
        with pytest.raises(UserError) as exc:
            trainer.run()
    finally:
        trainer.close()
    assert "the loss is nan" in str(exc.value) and "lower train.lr (now 10)" in str(exc.value)


def _cache(tmp_path, monkeypatch, capsys, n=24):
    """A cache of this project's layout (latents of two shapes, captions shared by four
    samples each), indexed by `adaptiveload manifest import` with a held-out share."""
    from cli_runner import run

    from adaptiveload.data.latents import save_sample, save_text

    cache = tmp_path / "cache"
    cache.mkdir()
    for c in range(n // 4):
        save_text(cache / f"caption{c}.safetensors", torch.randn(3, 32))
    for i in range(n):
        frames, side = (2, 4) if i % 2 else (1, 6)
        save_sample(cache / f"s{i:02d}.safetensors", torch.randn(16, frames, side, side),
                    text_file=f"caption{i // 4}.safetensors")
    manifest = cache / "manifest.csv"
    code, _, err = run(monkeypatch, capsys, "manifest", "import", str(cache), "-o",
                       str(manifest), "--val-fraction", "0.25")
    assert code == 0, err
    return manifest


def test_validation_scores_the_manifests_own_held_out_split(tmp_path, monkeypatch, capsys):
    manifest = _cache(tmp_path, monkeypatch, capsys)
    data = {"manifest": str(manifest), "bucketing": "exact", "val_split": "val"}
    exp = experiment.load(write_experiment(tmp_path, data=data, val_every=2, world_size=1))
    cfg = from_experiment(exp, "adaptiveload", 0, launch_mode="emulated", world_size=1)
    prepared = prepare_data(exp, cfg)
    frame = load_manifest(manifest)
    held = set(frame.loc[frame["split"] == "val", "sample_id"])
    assert held and set(prepared.validation.dataset.sample_ids) == held
    assert not held & set(prepared.builder.samples["sample_id"])  # never trained on
    item = prepared.validation.dataset[0]  # the user's latent, not a synthetic sample
    row = frame.set_index("sample_id").loc[item["sample_id"]]
    assert torch.equal(item["latent"], load_file(row["latent_path"])["latent"])
    for fields, says in (
        ({"val_split": "holdout"}, "data.val_split 'holdout' matches no row"),
        ({"max_frames": 1}, "a cached latent cannot be resized: set data.bucketing: exact"),
    ):
        bad = experiment.load(write_experiment(tmp_path, name="bad", data={**data, **fields},
                                               val_every=2, world_size=1))
        with pytest.raises(UserError, match=says):
            prepare_data(bad, from_experiment(bad, "adaptiveload", 0, launch_mode="emulated",
                                              world_size=1))


def test_a_held_out_split_nothing_scores_is_a_warning():
    frame = synthesize("tiny-cpu", 20, 0).assign(split=["val"] * 4 + ["train"] * 16)
    with pytest.warns(PlanWarning, match="4 samples are held out but train.val_every is 0"):
        train, held = split_holdout(frame, "val", "m.csv", val_every=0)
    assert len(train) == 16 and set(held["split"]) == {"val"}
