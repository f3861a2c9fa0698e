"""A training checkpoint's model out as weights other tools read: merged into a Wan 2.1
checkpoint (`save_wan`, either layout), or a LoRA run's adapters alone in the naming of
ComfyUI / Wan's original code or of diffusers (`lora.convert_lora`).

The model is rebuilt as the run built it (`loop.build_model` from the checkpoint's config:
the same `init_from`, checked by its digest, or the same seed) and the checkpoint's weights
are loaded over it, so a merged export is the trained model itself, on the CPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from adaptiveload.errors import UserError
from adaptiveload.io import atomic_path
from adaptiveload.model.lora import LORA_LAYOUTS, LoraSpec, convert_lora, lora_state, merge_lora
from adaptiveload.model.weights import save_wan
from adaptiveload.training import checkpoint, finetune
from adaptiveload.training.loop import build_model
from adaptiveload.training.settings import ObjectiveConfig, OptimConfig, TrainConfig


def config_of(saved: dict[str, Any]) -> TrainConfig:
    """The TrainConfig a checkpoint's `config` (`TrainConfig.to_dict`) was written from."""
    names = {f.name for f in fields(TrainConfig) if f.init}
    plain = {k: v for k, v in saved.items() if k in names}
    plain["optim"] = OptimConfig(**{**saved["optim"], "betas": tuple(saved["optim"]["betas"])})
    plain["objective"] = ObjectiveConfig(**saved["objective"])
    plain["lora"] = _lora_of(saved)
    return TrainConfig(**plain)


def _lora_of(saved: dict[str, Any]) -> LoraSpec | None:
    lora = saved.get("lora")
    return None if lora is None else LoraSpec(**{**lora, "targets": tuple(lora["targets"])})


def trained_model(path: str | os.PathLike[str]) -> tuple[torch.nn.Module, TrainConfig, dict]:
    """The model a training checkpoint holds (with its adapters, unmerged), on the CPU, its
    run's config, and the checkpoint's saved model state."""
    payload = checkpoint.load_one(Path(path))
    saved = payload["config"]
    cfg = replace(config_of(saved), device="cpu", precision="fp32")
    if cfg.init_digest != saved.get("init_digest"):
        raise UserError(
            f"{path}: its run started from {cfg.init_from} of digest "
            f"{saved.get('init_digest')}, which now has digest {cfg.init_digest}; "
            "put the checkpoint it trained from back at that path"
        )
    model = build_model(cfg, torch.device("cpu"))
    if cfg.lora is None:
        model.load_state_dict(payload["model"])
    else:
        finetune.restore_state(model, payload["model"], str(path))
    return model, cfg, payload["model"]


def export_merged(src: str | os.PathLike[str], dst: str | os.PathLike[str], layout: str) -> Path:
    """The trained model of checkpoint `src`, adapters merged, as a Wan 2.1 checkpoint folder
    `dst` in `layout` (`save_wan`)."""
    model, _, _ = trained_model(src)
    return save_wan(merge_lora(model), dst, layout)


def export_lora(src: str | os.PathLike[str], dst: str | os.PathLike[str], layout: str) -> Path:
    """A LoRA run's adapters alone, as the safetensors file `dst` in `layout`'s names."""
    from safetensors.torch import save_file

    payload = checkpoint.load_one(Path(src))
    if payload["config"].get("lora") is None:
        raise UserError(
            f"{src}: a full fine-tune (train.lora null) has no adapters; export the "
            "merged model (drop --lora-only)"
        )
    state = convert_lora(lora_state(payload["model"]), layout)
    spec = _lora_of(payload["config"])
    prefix = LORA_LAYOUTS[layout]
    modules = sorted({k[len(prefix) :].rsplit(".lora_", 1)[0] for k in state})
    if layout == "original":  # ComfyUI reads the scale alpha / rank from each module's .alpha
        state.update({f"{prefix}{m}.alpha": torch.tensor(spec.lora_alpha) for m in modules})
    # peft's adapter config, each key under the naming's prefix, where diffusers'
    # load_lora_weights reads rank and alpha ("transformer.r", ...)
    config = {"r": spec.rank, "lora_alpha": spec.lora_alpha, "target_modules": modules}
    meta = json.dumps({prefix + k: v for k, v in config.items()})
    dst = Path(dst)
    if dst.exists():
        raise UserError(f"{dst}: exists; choose a new output file")
    with atomic_path(dst) as tmp:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            str(tmp),
            metadata={"format": "pt", "lora_naming": layout, "lora_adapter_metadata": meta},
        )
    return dst
