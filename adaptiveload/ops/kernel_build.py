"""Building the fused-kernel library with torch.utils.cpp_extension (ninja + nvcc + the host
compiler), and the JSON record of what was built.

Only the binding includes torch headers; the .cu files are plain CUDA, which keeps a build at
tens of seconds per architecture on a small machine. Without nvcc, ninja or a CUDA build of
torch the build is *skipped* (status "skipped" with the reason) rather than failed, so the
pipeline and CPU-only installs carry on with the reference implementation.

The CUDA sources are `kernels/` at the top of the checkout, and a copy inside the package of
a built wheel (kernel_sources), so an installed package builds as a checkout does; the
library goes to the build folder of kernel_lib (`--build-dir`, else $ADAPTIVELOAD_BUILD_DIR,
the checkout's build/kernels or the user cache).

Runnable without the CLI's dependencies (the GPU check script uses this):
    python -m adaptiveload.ops.kernel_build --build-dir DIR --arch "9.0;8.0"
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from adaptiveload.io import write_json
from adaptiveload.ops.kernel_lib import LIB_NAME, RECORD_NAME, default_build_dir, library_path
from adaptiveload.ops.kernel_sources import SOURCE_DIR, sources_digest

SOURCES = ("ln_modulate_fwd.cu", "ln_modulate_bwd.cu", "ln_modulate_binding.cpp")
DEFAULT_ARCH = "9.0"
# nvcc flags of ours (cpp_extension adds its COMMON_NVCC_FLAGS and -std=c++17); the resource
# check (kernel_resources.py) compiles with the same ones, so ptxas sees the same code
NVCC_FLAGS = ("-O3",)


def cuda_home() -> Path:
    return Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda")


def nvcc_path() -> Path | None:
    candidate = cuda_home() / "bin" / "nvcc"
    if candidate.is_file():
        return candidate
    found = shutil.which("nvcc")
    return Path(found).resolve() if found else None


def nvcc_version(nvcc: Path) -> str:
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if "release" in ln]
    return lines[0].strip() if lines else out.stdout.strip()


def cuobjdump_path() -> Path | None:
    """The CUDA toolkit's cuobjdump, else one on PATH, else the copy Triton bundles."""
    candidates = [cuda_home() / "bin" / "cuobjdump"]
    if found := shutil.which("cuobjdump"):
        candidates.append(Path(found))
    try:
        import triton.backends.nvidia as tnv

        candidates.append(Path(tnv.__file__).parent / "bin" / "cuobjdump")
    except ImportError:
        pass
    return next((c for c in candidates if c.is_file()), None)


def list_cubins(library: Path) -> list[str] | None:
    """Names of the device-code ELF images in `library` (e.g. '...sm_90.cubin'); None when
    no cuobjdump is available to look."""
    tool = cuobjdump_path()
    if tool is None:
        return None
    out = subprocess.run(
        [str(tool), "--list-elf", str(library)], capture_output=True, text=True, check=True
    )
    return [ln.split(":", 1)[1].strip() for ln in out.stdout.splitlines() if ":" in ln]


def skip_reason() -> str:
    """'' when this machine can build the library, else why not."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (no CUDA libraries to link)"
    if nvcc_path() is None:
        return f"nvcc not found (looked in {cuda_home()}/bin and on PATH)"
    if shutil.which("ninja") is None:  # what cpp_extension runs
        return "ninja not found (pip install ninja)"
    return ""


def build(
    out_dir: Path | None = None, arch: str = DEFAULT_ARCH, verbose: bool = False
) -> dict[str, Any]:
    """Build `<out_dir>/adaptiveload_kernels.so` (default: kernel_lib's build folder) for the
    `;`-separated arch list; write and return the record. Raises RuntimeError (after writing a
    'failed' record) if compiling fails.
    """
    out_dir = Path(out_dir) if out_dir is not None else default_build_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    record: dict[str, Any] = {
        "status": "skipped",
        "reason": skip_reason(),
        "arch_list": arch,
        "nvcc_version": None,
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "sources_digest": sources_digest(),
        "library": None,
        "seconds": 0.0,
    }
    if record["reason"]:
        write_json(out_dir / RECORD_NAME, record)
        return record
    nvcc = nvcc_path()
    assert nvcc is not None
    record["nvcc_version"] = nvcc_version(nvcc)
    # A child process compiles (cpp_extension.load also dlopens the result, which here could
    # clash with ops this process already defined) and so proves the library loads.
    # CUDA_HOME is pinned to the toolkit owning this nvcc: cpp_extension would otherwise
    # guess from PATH (e.g. /usr/local for a /usr/local/bin/nvcc wrapper).
    env = dict(os.environ, CUDA_HOME=str(nvcc.parent.parent), TORCH_CUDA_ARCH_LIST=arch)
    child = subprocess.run(
        [sys.executable, "-m", "adaptiveload.ops.kernel_build", "--compile-only", str(out_dir)]
        + (["--verbose"] if verbose else []),
        env=env, capture_output=not verbose, text=True, check=False,
    )
    library = library_path(out_dir)
    if child.returncode != 0:
        tail = (child.stderr or "")[-4000:]
        record.update(status="failed", reason=f"compiler exit {child.returncode}: {tail}")
        record["seconds"] = round(time.perf_counter() - t0, 1)
        write_json(out_dir / RECORD_NAME, record)
        raise RuntimeError(f"kernel build failed (see {out_dir / RECORD_NAME}):\n{tail}")
    record.update(
        status="built",
        reason="",
        library=str(library),
        seconds=round(time.perf_counter() - t0, 1),
        cubins=list_cubins(Path(library)),
    )
    write_json(out_dir / RECORD_NAME, record)
    return record


def _compile(out_dir: Path, verbose: bool) -> None:
    """The child's job: ninja-build the library with the env's CUDA_HOME and arch list."""
    from torch.utils import cpp_extension

    cpp_extension.load(
        name=LIB_NAME,
        sources=[str(SOURCE_DIR / s) for s in SOURCES],
        extra_include_paths=[str(SOURCE_DIR)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=list(NVCC_FLAGS),
        build_directory=str(out_dir),
        is_python_module=False,
        verbose=verbose,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, help="default: $ADAPTIVELOAD_BUILD_DIR, else "
                        "the checkout's build/kernels, else the user cache")
    parser.add_argument("--arch", default=os.environ.get("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH))
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--compile-only", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_only:
        _compile(args.compile_only, args.verbose)
        return 0
    try:
        record = build(args.build_dir, args.arch, args.verbose)
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"kernel build {record['status']}: {record['reason'] or record['library']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
