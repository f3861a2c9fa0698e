"""Where the CUDA/C++ sources of the fused kernels are, and their digest.

The sources have one home: `kernels/` at the top of the source tree. A built wheel carries a
copy inside the package (`adaptiveload/kernels/`, copied by setup.py's build step), so an
installed package builds the library as a checkout does. The folder is the first of:

1. `kernels/` of the checkout this package runs from (an editable install or PYTHONPATH: a
   pyproject.toml and a kernels/ folder one level above the package);
2. else `kernels/` inside the installed package.

Standard library only: the Snakefile reads the source list without importing torch, and
setup.py loads this file by path (a build imports neither the package nor torch) to know what
to copy where.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

KERNELS_DIR = "kernels"  # the folder's name at the top of the tree and inside the package
# what the library build and the resource check read, and what the digest covers (not the
# folder's README.md: editing prose rebuilds nothing)
SOURCE_SUFFIXES = (".h", ".cuh", ".cu", ".cpp")
PACKAGE_DIR = Path(__file__).resolve().parents[1]


def find_source_dir(package_dir: Path = PACKAGE_DIR) -> Path:
    """The kernels folder of the checkout above `package_dir`, else the packaged copy."""
    root = package_dir.parent
    if (root / "pyproject.toml").is_file() and (root / KERNELS_DIR).is_dir():
        return root / KERNELS_DIR
    return package_dir / KERNELS_DIR


SOURCE_DIR = find_source_dir()


def source_files(source_dir: Path = SOURCE_DIR) -> list[Path]:
    """The kernel sources in `source_dir`, in name order ([] where the folder is missing)."""
    if not source_dir.is_dir():
        return []
    return sorted(p for p in source_dir.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES)


def sources_digest(source_dir: Path = SOURCE_DIR) -> str:
    """sha256 over the names and bytes of every kernel source, in name order: what a build
    record stores and the loader compares."""
    h = hashlib.sha256()
    for path in source_files(source_dir):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]
