"""Where the fused-kernel library is built and found, and loading it once per process.

The library is the shared object `adaptiveload kernel build` writes into its build folder,
beside `build.json`, the record of the build. One folder serves both the build and the loader:

1. $ADAPTIVELOAD_BUILD_DIR, when set (the pipeline sets it for its jobs);
2. else `build/kernels/` of the checkout this package runs from (a source tree with its
   pyproject.toml one level above the package);
3. else `adaptiveload/kernels/` in the user's cache folder ($XDG_CACHE_HOME, else ~/.cache),
   for an installed package, whose own folder may not be writable.

`adaptiveload kernel build --build-dir DIR` builds elsewhere; set $ADAPTIVELOAD_BUILD_DIR to the
same DIR for the processes that should load it. The build record names the torch it was
built for and a digest of the CUDA sources it was built from (`sources_digest`): a library of
another torch (a C++ ABI risk) or of other kernel sources (an older kernel under the same op
names, which would run silently in place of the code beside it) is not loaded, and the reason
says to rebuild. Loading registers
`torch.ops.adaptiveload.ln_modulate_{fwd,bwd,seg_fwd,seg_bwd}` with their CUDA kernels. A
failed load is remembered with its reason, so callers fall back to the reference
implementation without retrying (or re-raising) on every call.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from adaptiveload.ops.kernel_sources import PACKAGE_DIR, SOURCE_DIR, sources_digest

BUILD_DIR_ENV = "ADAPTIVELOAD_BUILD_DIR"
LIB_NAME = "adaptiveload_kernels"
RECORD_NAME = "build.json"  # written beside the library by the build


def _checkout_root() -> Path | None:
    """The source tree this package runs from (editable install or PYTHONPATH), else None."""
    root = PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() else None


def default_build_dir() -> Path:
    """The build folder of the library: see the module docstring for the order."""
    if env := os.environ.get(BUILD_DIR_ENV):
        return Path(env)
    if (root := _checkout_root()) is not None:
        return root / "build" / "kernels"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "adaptiveload" / "kernels"


def library_path(build_dir: Path | None = None) -> Path:
    """The library file in `build_dir` (default: `default_build_dir()`)."""
    return (build_dir or default_build_dir()) / f"{LIB_NAME}.so"


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
    path = library_path()
    if not path.is_file():
        _STATE = LoadState(
            reason=f"{path} not found: run `adaptiveload kernel build` (or set {BUILD_DIR_ENV})"
        )
    elif torch.version.cuda is None:
        _STATE = LoadState(path=path, reason="this torch build has no CUDA")
    elif mismatch := _record_mismatch(path):
        _STATE = LoadState(path=path, reason=mismatch)
    else:
        try:
            torch.ops.load_library(str(path))
            _STATE = LoadState(loaded=True, path=path, reason="loaded")
        except (OSError, RuntimeError) as exc:
            _STATE = LoadState(path=path, reason=f"loading {path} failed: {exc}")
    return _STATE


def _record_mismatch(library: Path) -> str:
    """'' unless the build record beside `library` names another torch or other sources."""
    record = library.parent / RECORD_NAME
    try:
        built = json.loads(record.read_text())
    except (OSError, ValueError):
        return ""  # no record (e.g. a library copied elsewhere): trust the loader
    built_for = built.get("torch_version")
    if built_for and built_for != torch.__version__:
        return (
            f"{library} was built for torch {built_for}, this is torch {torch.__version__}: "
            "rebuild with `adaptiveload kernel build`"
        )
    built_from = built.get("sources_digest")
    if built_from is None or built_from != sources_digest():
        return (
            f"{library} was built from other kernel sources than {SOURCE_DIR} "
            f"({RECORD_NAME}: sources_digest {built_from!r}, the sources: {sources_digest()!r}): "
            "rebuild with `adaptiveload kernel build`"
        )
    return ""
