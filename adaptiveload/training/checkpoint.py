"""Atomic training checkpoints: everything needed to continue a run as if it never stopped.

A checkpoint holds the model and optimizer (full, unsharded state dicts, so DDP, FSDP2 and
emulated runs all read each other's), every rank's sampler state, the RNG states (torch,
CUDA, numpy, python), the number of completed steps, the per-step rows measured so far and
the tracking state (the MLflow run id). Files are `ckpt-<step>.pt`, each written to a
temporary name and renamed, so a SIGKILL leaves the previous checkpoint intact; the newest
`keep` are kept.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaptiveload.errors import UserError
from adaptiveload.io import atomic_path

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def path_for(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    state = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(directory: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` (plus format, step, RNG) as checkpoint `step`; prune older ones."""
    path = path_for(directory, step)
    payload = {"format": FORMAT_VERSION, "step": step, "rng": rng_state(), **state}
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)
    for old in sorted(_existing(directory))[:-keep]:
        old[1].unlink(missing_ok=True)
    return path


def _existing(directory: Path) -> list[tuple[int, Path]]:
    if not Path(directory).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest(directory: Path, fingerprint: str | None = None) -> dict[str, Any] | None:
    """The newest checkpoint under `directory` that loads, or None (fresh start).

    With `fingerprint`, a checkpoint of a different configuration is a UserError: resuming
    it would silently mix two runs.
    """
    for _, path in reversed(_existing(directory)):
        try:
            payload = torch.load(path, map_location="cpu", weights_only=False)
        except Exception:  # a file from another torch version or otherwise unreadable
            continue
        if payload.get("format") != FORMAT_VERSION:
            continue
        if fingerprint is not None and payload.get("fingerprint") != fingerprint:
            raise UserError(
                f"{path}: checkpoint of a different configuration (experiment, policy, seed, "
                "launch mode, world size or hyper-parameters changed); use another --out "
                "or delete that run directory to start over"
            )
        payload["path"] = str(path)
        return payload
    return None
