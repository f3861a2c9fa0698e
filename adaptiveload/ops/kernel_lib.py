"""Finding and loading the built fused-kernel library, once per process.

The library is the shared object `adaptiveload kernel build` writes (default
`<repo>/build/kernels/adaptiveload_kernels.so`; the env var ADAPTIVELOAD_KERNEL_LIB names
another file). Loading registers `torch.ops.adaptiveload.ln_modulate_{fwd,bwd}` with their CUDA
kernels. A failed load is remembered with its reason, so callers fall back to the reference
implementation without retrying (or re-raising) on every call.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

ENV_VAR = "ADAPTIVELOAD_KERNEL_LIB"
LIB_NAME = "adaptiveload_kernels"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_BUILD_DIR = REPO_ROOT / "build" / "kernels"
RECORD_NAME = "build.json"  # written beside the library by the build


def default_library_path() -> Path:
    """Where the library is looked for: $ADAPTIVELOAD_KERNEL_LIB, else the default build dir."""
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else DEFAULT_BUILD_DIR / f"{LIB_NAME}.so"


@dataclass
class LoadState:
    loaded: bool = False
    path: Path | None = None
    reason: str = "not attempted"


_STATE: LoadState | None = None


def load() -> LoadState:
    """Load the library on first call; later calls return the remembered outcome."""
    global _STATE
    if _STATE is not None:
        return _STATE
    path = default_library_path()
    if not path.is_file():
        _STATE = LoadState(
            reason=f"{path} not found: run `adaptiveload kernel build` (or set {ENV_VAR})"
        )
    elif torch.version.cuda is None:
        _STATE = LoadState(path=path, reason="this torch build has no CUDA")
    elif mismatch := _torch_mismatch(path):
        _STATE = LoadState(path=path, reason=mismatch)
    else:
        try:
            torch.ops.load_library(str(path))
            _STATE = LoadState(loaded=True, path=path, reason="loaded")
        except (OSError, RuntimeError) as exc:
            _STATE = LoadState(path=path, reason=f"loading {path} failed: {exc}")
    return _STATE


def _torch_mismatch(library: Path) -> str:
    """'' unless the build record beside `library` names another torch (C++ ABI risk)."""
    record = library.parent / RECORD_NAME
    try:
        built_for = json.loads(record.read_text()).get("torch_version")
    except (OSError, ValueError):
        return ""  # no record (e.g. a library copied elsewhere): trust the loader
    if built_for and built_for != torch.__version__:
        return (
            f"{library} was built for torch {built_for}, this is torch {torch.__version__}: "
            "rebuild with `adaptiveload kernel build`"
        )
    return ""
