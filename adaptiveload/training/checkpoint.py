"""Atomic, safe-to-load training checkpoints: everything needed to continue a run as if it
never stopped, and nothing that runs code when read.

A checkpoint holds the model and optimizer (full, unsharded state dicts, so DDP, FSDP2 and
emulated runs all read each other's), every rank's sampler state, the RNG states (torch,
CUDA, numpy, python), the number of completed steps, the per-step rows measured so far, the
tracking state (the MLflow run id) and the run's identity (`training.inputs.run_identity`).
Everything is a tensor or a plain Python type, so files load with
`torch.load(weights_only=True)`: a crafted pickle placed in a run folder is refused, not run.

Files are `ckpt-<step>.pt`, each written to a temporary name and renamed, so a SIGKILL leaves
the previous checkpoint intact (`find` removes the temporaries such a kill leaves); the
newest `keep` are kept.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from adaptiveload.errors import UserError, notice
from adaptiveload.io import atomic_path, remove_temporaries

FORMAT_VERSION = 2  # 2: weights_only-loadable (RNG states as tensors), run identity
_NAME = re.compile(r"^ckpt-(\d{8})\.pt$")


def path_for(directory: Path, step: int) -> Path:
    return Path(directory) / f"ckpt-{step:08d}.pt"


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain numbers (what `weights_only` loading accepts)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"].tolist()), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(directory: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` (plus format, step, RNG) as checkpoint `step`; prune older ones."""
    path = path_for(directory, step)
    payload = {"format": FORMAT_VERSION, "step": step, "rng": rng_state(), **state}
    with atomic_path(path) as tmp, tmp.open("wb") as fh:
        # to a file object, not a path: a full disk is then Python's OSError (ENOSPC), which
        # atomic_path reports in one line, not torch's "enforce fail at inline_container.cc"
        torch.save(payload, fh)
    for old in sorted(_existing(directory))[:-keep]:
        old[1].unlink(missing_ok=True)
    return path


def _existing(directory: Path) -> list[tuple[int, Path]]:
    if not Path(directory).is_dir():
        return []
    found = [(int(m.group(1)), p) for p in Path(directory).iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


@dataclass
class Found:
    """What `find` decided: `state` to resume (None: start from step 0); `stale`, the newest
    checkpoint of another run identity (its `tracking` entry names the MLflow run it fed)."""

    state: dict[str, Any] | None = None
    stale: dict[str, Any] | None = None


def _load(path: Path) -> dict[str, Any]:
    """Load one checkpoint safely; ValueError says why it cannot be used."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated, foreign, or holding objects that would run code
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"unreadable or unsafe to load: {first[:120]}") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT_VERSION:
        raise ValueError(f"not a format-{FORMAT_VERSION} adaptiveload checkpoint")
    return payload


def load_one(path: Path) -> dict[str, Any]:
    """The checkpoint file `path`, loaded safely; UserError (one line) if it cannot be used."""
    try:
        return _load(Path(path))
    except (ValueError, OSError) as exc:
        raise UserError(f"{path}: {exc}; give a ckpt-<step>.pt of a training run") from None


def find(directory: Path, identity: str, tidy: bool = True, last: int | None = None) -> Found:
    """The newest usable checkpoint under `directory` of the run `identity`, of at most
    `last` steps (the run's end) when given.

    Unusable checkpoints (corrupt, truncated, unsafe, of another format) are skipped; one of
    another identity means the run's inputs or code changed, so the run starts over instead
    of resuming stale state. Checkpoints past `last` (a longer run of the same identity, say
    one started by hand into this folder) are passed over: this run ends at `last`, and its
    results must be those of `last` steps. Each is said in one line on stderr. With `tidy`
    (the one process that owns the folder), passed-over, skipped and stale files and the
    temporaries of killed writes are removed, so they cannot be mistaken for this run's later.
    """
    directory = Path(directory)
    if tidy:
        remove_temporaries(directory, "ckpt-*")
    skipped: list[str] = []
    found = Found()
    existing = _existing(directory)
    past = [(step, path) for step, path in existing if last is not None and step > last]
    if past:
        notice(
            f"{directory}: checkpoint(s) of step {', '.join(str(s) for s, _ in past)} go past "
            f"this run's {last} steps (a longer run in this folder): not resumed"
            + (", removed" if tidy else "")
        )
        for _, path in past if tidy else ():
            path.unlink(missing_ok=True)
        existing = existing[: len(existing) - len(past)]
    for _, path in reversed(existing):
        try:
            payload = _load(path)
        except (ValueError, OSError) as exc:
            skipped.append(f"{path.name} ({exc})")
            if tidy:
                path.unlink(missing_ok=True)
            continue
        if payload.get("identity") == identity:
            payload["path"] = str(path)
            found.state = payload
        else:
            found.stale = payload
        break
    if found.stale is not None:
        if tidy:
            for _, path in existing:
                path.unlink(missing_ok=True)
        skipped_note = f" (skipped unusable {', '.join(skipped)})" if skipped else ""
        notice(
            f"{directory}: checkpoint of step {found.stale.get('step')} belongs to another run "
            "(configuration, budgets, calibration, data, plan or code changed): starting over "
            f"from step 0{skipped_note}"
        )
    elif skipped and found.state is not None:
        notice(
            f"{directory}: skipped unusable checkpoint(s) {', '.join(skipped)}; resuming from "
            f"step {found.state['step']}"
        )
    elif skipped:
        notice(
            f"{directory}: no usable checkpoint ({', '.join(skipped)}): starting over from step 0"
        )
    return found
