"""Fine-tuning: a run that starts from a pretrained checkpoint (`model.init_from`) and trains
all of it or LoRA adapters on it (`train.lora`).

The checkpoint is read by `weights.load_wan` (either layout, every key and shape checked) and
must be the model `model.config` names; its content digest (`checkpoint_digest`: the bytes of
its weight files and config.json) is part of the run's config fingerprint, so another
checkpoint is another run, and a rerun with the same one resumes (or finds the run done).

A LoRA run's checkpoints hold the adapters alone (`saved_state`): the base weights are those
of `init_from` (or of the seed, from scratch), which the run identity fixes, so a resume
rebuilds them exactly and loads the adapters over them (`restore_state`).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from adaptiveload.costmodel import Calibration
from adaptiveload.errors import UserError
from adaptiveload.experiment import SCRATCH
from adaptiveload.model.architectures import WanConfig, get_config
from adaptiveload.model.lora import LoraSpec, add_lora, is_lora_key, lora_state, spec_record
from adaptiveload.model.wan import WanModel
from adaptiveload.model.weights import inspect, load_wan, open_checkpoint

FIELD = "model.init_from"
_CHUNK = 1 << 24


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files whose content is a checkpoint's: its weight files in order and its
    config.json (what `checkpoint_digest` hashes; the pipeline's training jobs take them as
    inputs, so weights overwritten in place rerun training)."""
    try:
        ckpt = open_checkpoint(path)
    except UserError as exc:
        raise UserError(f"{FIELD}: {exc}") from None
    files = list(ckpt.files)
    if ckpt.path.is_dir() and (ckpt.path / "config.json").exists():
        files.append(ckpt.path / "config.json")
    return files


def checkpoint_digest(path: str | os.PathLike[str]) -> str:
    """sha256 (16 hex digits) of a checkpoint's content: its weight files in order and its
    config.json, each with its length; not its path or modification time (a copy of the same
    weights is the same run)."""
    sha = hashlib.sha256()
    for file in checkpoint_files(path):
        sha.update(f"{file.name}:{file.stat().st_size}\n".encode())
        with Path(file).open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                sha.update(chunk)
    return sha.hexdigest()[:16]


def _differences(want: WanConfig, got: WanConfig) -> list[str]:
    return [
        f"{f} {getattr(got, f)} (model.config: {getattr(want, f)})"
        for f in want.to_dict()
        if f != "name" and getattr(got, f) != getattr(want, f)
    ]


def load_pretrained(
    path: str | os.PathLike[str], config: str, ln_modulate_impl: str, checkpointing: bool
) -> WanModel:
    """The WanModel of the checkpoint at `path`, refused in one line unless it is the model
    `config` names (which fields differ, and the config to set)."""
    try:
        ckpt, found = inspect(path)
    except UserError as exc:
        raise UserError(f"{FIELD}: {exc}") from None
    want = get_config(config)
    diff = _differences(want, found)
    if diff:
        fix = (
            f"set model.config: {found.name}"
            if found.name != ckpt.path.stem
            else "set model.config to the checkpoint's model"
        )
        raise UserError(
            f"{FIELD}: {ckpt.path} is not a {config} checkpoint: {'; '.join(diff)}; {fix}"
        )
    return load_wan(
        path,
        found.name if found.name == config else None,
        ln_modulate_impl=ln_modulate_impl,
        activation_checkpointing=checkpointing,
    )


class FinetuneWarning(UserWarning):
    """A fine-tuning setting that is valid but unlikely to be what was meant."""


def prepare(model: WanModel, lora: LoraSpec | None, init_from: str) -> nn.Module:
    """The model as the run trains it: with LoRA adapters (base frozen) under `train.lora`,
    else whole. Adapters on a model from scratch train against frozen random weights: valid
    (a smoke test of the setup), said once."""
    if lora is None:
        return model
    if init_from == SCRATCH:
        warnings.warn(
            "train.lora with model.init_from: scratch: the adapters train on frozen random "
            "weights; set model.init_from to a pretrained checkpoint",
            FinetuneWarning,
            stacklevel=2,
        )
    return add_lora(model, lora)


def check_calibration(lora: LoraSpec | None, calibration: Calibration | None) -> None:
    """One warning when a LoRA run plans with a calibration that timed another step: full
    training's backward computes every weight's gradient and steps every weight's optimizer
    state, a LoRA step only the adapters', so the plan's costs and budgets are not of the
    step this run takes (`adaptiveload calibrate measure --config` on the experiment times
    its LoRA step)."""
    if lora is None or calibration is None:
        return
    timed = (calibration.extra.get("setup") or {}).get("lora")
    if timed == spec_record(lora):
        return
    what = "full training steps" if timed is None else f"LoRA steps of {timed}"
    warnings.warn(
        f"train.lora: the calibration ({calibration.source}, {calibration.device}) timed "
        f"{what}, not this run's "
        f"LoRA step {spec_record(lora)}; its costs and budgets are of another step. Measure "
        "one with `adaptiveload calibrate measure --config` on this experiment (it times the "
        "step of train.lora), or let the pipeline measure it (calibration.file: null)",
        FinetuneWarning,
        stacklevel=2,
    )


def trainable(model: nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: all of them, or the adapters of a LoRA run."""
    return [p for p in model.parameters() if p.requires_grad]


def saved_state(state: Mapping[str, torch.Tensor], lora: LoraSpec | None) -> dict:
    """What a checkpoint keeps of the model's state dict: all of it, or the adapters."""
    return dict(state) if lora is None else lora_state(state)


def restore_state(model: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    """Load a LoRA run's saved adapters into `model` (its base rebuilt as the run began);
    refused unless they are exactly the model's adapters."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if is_lora_key(k)]
    if missing or result.unexpected_keys:
        key = (missing or result.unexpected_keys)[0]
        raise UserError(
            f"{where}: adapter {key!r} {'missing' if missing else 'unexpected'}: "
            "the checkpoint is not of this run's train.lora; start a new run folder"
        )
