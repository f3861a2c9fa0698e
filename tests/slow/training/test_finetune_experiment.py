"""experiments/finetune.yaml at tiny size, end to end through the CLI: a latent cache in
musubi-tuner's or DiffSynth-Studio's layout and a pretrained checkpoint, where the file
expects them (under the working directory), indexed by `adaptiveload manifest import`, then
`adaptiveload train` on the file with only the sizes changed (micro model, CPU budgets, a few
steps on 2 emulated ranks). The run trains LoRA adapters alone, scores the cache's own
held-out samples and reports its exposed load."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
import yaml
from finetune_setup import CONFIG, write_pretrained
from repo_paths import ROOT
from safetensors.torch import save_file
from training_setup import adaptiveload, cli_env

from adaptiveload.data.latents import save_text
from adaptiveload.data.manifest import load_manifest
from adaptiveload.model.architectures import get_config
from adaptiveload.model.lora import is_lora_key
from adaptiveload.training import checkpoint

STEPS, WORLD = 4, 2


def _cache(folder, layout: str) -> None:
    """Ten clips of 1-3 latent frames, each with its caption's embedding, in `layout`."""
    cfg = get_config(CONFIG)
    gen = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    for i in range(10):
        frames, side = 1 + i % 3, (4, 6)[i % 2]
        latent = torch.randn(cfg.in_dim, frames, side, side, generator=gen)
        text = torch.randn(5, cfg.text_dim, generator=gen)
        if layout == "musubi":
            pixels = 8 * side
            name = f"clip{i}_00000-{4 * frames - 3:03d}_{pixels:04d}x{pixels:04d}_wan"
            save_file(
                {f"latents_{frames}x{side}x{side}_bf16": latent.bfloat16()},
                folder / f"{name}.safetensors",
            )
            save_file({"varlen_t5_bf16": text.bfloat16()}, folder / f"clip{i}_wan_te.safetensors")
        else:
            torch.save(
                {"latents": latent[None], "prompt_emb": {"context": text[None]}},
                folder / f"clip{i}.mp4.tensors.pth",
            )
    save_text(folder / "empty_text.safetensors", torch.zeros(1, cfg.text_dim))


def _tiny(tmp_path):
    """experiments/finetune.yaml with its sizes made tiny; every other field as shipped."""
    exp = yaml.safe_load((ROOT / "experiments" / "finetune.yaml").read_text())
    exp["model"]["config"] = CONFIG
    exp["calibration"] = {"device": "cpu"}  # no calibration file: explicit CPU budgets
    exp["budgets"] = {"m_tok": 512, "m_mem": 512, "m_comp": 60000, "p": 1.4}
    exp["train"].update(
        world_size=WORLD,
        steps=STEPS,
        epochs=1,
        val_every=2,
        checkpoint_every=2,
        lr_warmup_steps=1,
        reader_workers=1,
        activation_checkpointing=False,
        lora={"rank": 4, "alpha": 8},
    )
    path = tmp_path / "finetune.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path, exp


@pytest.mark.parametrize("layout", ["musubi", "diffsynth"])
def test_the_finetune_experiment_runs_on_either_tools_cache(tmp_path, layout):
    config, exp = _tiny(tmp_path)
    _cache(tmp_path / "data" / "my-cache", layout)
    write_pretrained(tmp_path / exp["model"]["init_from"], "original")
    env = dict(cli_env(), PYTHONPATH=str(ROOT))
    manifest = exp["data"]["manifest"]
    made = adaptiveload(
        "manifest",
        "import",
        "data/my-cache",
        "--layout",
        layout,
        "--val-fraction",
        "0.2",
        "-o",
        manifest,
        env=env,
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    out = tmp_path / "run"
    run = adaptiveload(
        "train",
        "--config",
        str(config),
        "--policy",
        "adaptiveload-packed",
        "--seed",
        "0",
        "--emulate-world-size",
        str(WORLD),
        "--out",
        str(out),
        "--no-track",
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]

    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == STEPS * WORLD
    frame = load_manifest(tmp_path / manifest)
    held = set(frame.loc[frame["split"] == "val", "sample_id"])
    assert held and steps["val_loss"].notna().any()  # the cache's own held-out samples
    assert {"load_s", "load_exposed_s"} <= set(steps.columns)
    assert (steps["load_s"] > 0).all()
    state = checkpoint.load_one(out / "checkpoints" / f"ckpt-{STEPS:08d}.pt")
    assert state["model"] and all(is_lora_key(k) for k in state["model"])  # adapters alone
