"""experiments/finetune.yaml at tiny size, end to end through the Snakemake pipeline: latent
caches in musubi-tuner's and DiffSynth-Studio's layouts (one run covers both: each folder is
imported by `adaptiveload manifest import`, the two manifests joined into the one the file
names) and a pretrained checkpoint, where the file expects them (under the working
directory), then `snakemake` on the file with only the sizes changed (micro model, a
calibration measured on this CPU, a few steps on 2 emulated ranks). The run trains LoRA
adapters alone under the cost-based plan, scores the cache's own held-out samples and
reports its exposed load; a rerun does nothing, and weights overwritten at the same
`model.init_from` path rerun training."""

from __future__ import annotations

import json

import pandas as pd
import torch
import yaml
from finetune_setup import CONFIG, pretrained_model, write_pretrained
from repo_paths import ROOT
from safetensors.torch import save_file
from training_setup import adaptiveload, cli_env
from workflow_setup import copy_workflow, dry_run_jobs, snakemake

from adaptiveload.data.latents import save_text
from adaptiveload.data.manifest import load_manifest, write_manifest
from adaptiveload.model.architectures import get_config
from adaptiveload.model.lora import is_lora_key
from adaptiveload.model.weights import save_wan
from adaptiveload.training import checkpoint

STEPS, WORLD = 4, 2
EXPERIMENT = "experiments/finetune.yaml"


def _cache(folder, layout: str, clips: range) -> None:
    """Clips of 1-3 latent frames, each with its caption's embedding, in `layout`."""
    cfg = get_config(CONFIG)
    gen = torch.Generator().manual_seed(clips.start)
    folder.mkdir(parents=True)
    for i in clips:
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


def _tiny(work) -> dict:
    """experiments/finetune.yaml in the workflow copy `work`, its sizes made tiny: the micro
    model, a calibration measured here (no file: the pipeline's calibrate job measures the
    micro model on the CPU, at a pretend 5 MB device), a few steps; every other field as
    shipped."""
    path = work / EXPERIMENT
    exp = yaml.safe_load(path.read_text())
    exp["model"]["config"] = CONFIG
    exp["calibration"] = {
        "device": "cpu",
        "file": None,
        "batch_sizes": [1, 2],
        "tokens": [16, 64, 256, 1024],
        "repeats": 2,
        "capacity_gb": 0.005,
        "max_loo_error": 10,  # timings beside the pipeline's other jobs; the fit is not checked
        "packs": [],
    }
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
    path.write_text(yaml.safe_dump(exp))
    return exp


def test_the_finetune_experiment_runs_through_the_pipeline_on_both_tools_caches(tmp_path):
    work = copy_workflow(tmp_path)
    exp = _tiny(work)
    init = work / exp["model"]["init_from"]
    write_pretrained(init, "original")
    cache = work / "data" / "my-cache"
    parts = []
    for layout, clips in (("musubi", range(0, 6)), ("diffsynth", range(6, 12))):
        _cache(cache / layout, layout, clips)
        made = adaptiveload(
            "manifest",
            "import",
            f"data/my-cache/{layout}",
            "--layout",
            layout,
            "--val-fraction",
            "0.2",
            "-o",
            f"data/my-cache/{layout}.csv",
            env=dict(cli_env(), PYTHONPATH=str(ROOT)),
            cwd=work,
        )
        assert made.returncode == 0, made.stderr[-3000:]
        parts.append(load_manifest(cache / f"{layout}.csv"))
    manifest = work / exp["data"]["manifest"]
    write_manifest(manifest, pd.concat(parts, ignore_index=True))
    save_text(cache / "empty_text.safetensors", torch.zeros(1, get_config(CONFIG).text_dim))

    run = snakemake(work, "--cores", "2", "--configfile", EXPERIMENT)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]

    res = work / "results" / "finetune"
    out = res / "runs" / "adaptiveload-packed" / "seed0" / "eager"
    steps = pd.read_parquet(out / "steps.parquet")
    assert len(steps) == STEPS * WORLD
    frame = load_manifest(manifest)
    assert set(frame["text_key"]) == {"varlen_t5_bf16", "prompt_emb.context"}  # both tools
    held = frame["split"] == "val"
    assert held.any() and steps["val_loss"].notna().any()  # the cache's own held-out samples
    # the plan the pipeline made (and the run executed) is of the training split alone
    planned = json.loads((out / "plan_summary.json").read_text())
    assert planned["num_samples"] == int((~held).sum())
    assert {"load_s", "load_exposed_s"} <= set(steps.columns)
    assert (steps["load_s"] > 0).all()
    state = checkpoint.load_one(out / "checkpoints" / f"ckpt-{STEPS:08d}.pt")
    assert state["model"] and all(is_lora_key(k) for k in state["model"])  # adapters alone
    # one policy: no baseline to compare with, and none of the rows claims to be it
    headline = (res / "tables" / "headline.md").read_text()
    assert "adaptiveload-packed" in headline and "| baseline " not in headline

    assert dry_run_jobs(snakemake(work, "-n", "--configfile", EXPERIMENT)) == {}
    # other weights at the same path: training (and what reads its runs) is due again
    weights = [f for f in init.iterdir() if f.suffix == ".safetensors"]
    before = {f.name: f.read_bytes() for f in weights}
    save_wan(pretrained_model(seed=8), tmp_path / "other", "original")
    for f in weights:
        f.write_bytes((tmp_path / "other" / f.name).read_bytes())
    assert any(f.read_bytes() != before[f.name] for f in weights)
    assert dry_run_jobs(snakemake(work, "-n", "--configfile", EXPERIMENT)).get("train") == 1
