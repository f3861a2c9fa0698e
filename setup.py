"""The one build step pyproject.toml cannot declare: a wheel carries a copy of the top-level
`kernels/` folder (the CUDA/C++ sources of the fused kernels, whose only copy in the tree is
there) inside the package, as `adaptiveload/kernels/`, where an installed package's
`adaptiveload kernel build` finds it (adaptiveload/ops/kernel_sources.py). Everything else
about the package is in pyproject.toml; MANIFEST.in puts kernels/ into the sdist.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PACKAGE = "adaptiveload"


def _kernel_sources() -> ModuleType:
    """adaptiveload/ops/kernel_sources.py, loaded by path: the folder's name and the file list
    have one home, and a build must not import the package (nor torch)."""
    path = ROOT / PACKAGE / "ops" / "kernel_sources.py"
    spec = importlib.util.spec_from_file_location("_adaptiveload_kernel_sources", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    """build_py, then kernels/ (its sources and README.md) copied into the built package.
    An editable install skips the copy: it runs from the checkout, which has kernels/."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        sources = _kernel_sources()
        src = ROOT / sources.KERNELS_DIR
        files = sources.source_files(src)
        if not files:
            raise SystemExit(f"{src}: no kernel sources to ship (an sdist without kernels/?)")
        dest = Path(self.build_lib) / PACKAGE / sources.KERNELS_DIR
        self.mkpath(str(dest))
        for path in [*files, src / "README.md"]:
            self.copy_file(str(path), str(dest / path.name))


setup(cmdclass={"build_py": BuildPyWithKernels})
