"""What a run reads of a manifest of cached latents (adaptiveload.training.inputs): every
latent_path inside data.root (by default the manifest's folder), and no validation score of
synthetic samples passed off as one of the user's data."""

from __future__ import annotations

import pytest
import torch
from training_setup import write_experiment

from adaptiveload import experiment
from adaptiveload.data.manifest import write_manifest
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.training.distributed import Ranks
from adaptiveload.training.inputs import prepare_data
from adaptiveload.training.loop import Trainer
from adaptiveload.training.settings import from_experiment


def _run(tmp_path, latent_path: str, **fields):
    torch.set_num_threads(1)
    manifest = tmp_path / "data" / "manifest.csv"
    manifest.parent.mkdir(exist_ok=True)
    write_manifest(manifest, synthesize("tiny-cpu", 120, 0).assign(latent_path=latent_path))
    data = {"manifest": str(manifest), **fields.pop("data", {})}
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
