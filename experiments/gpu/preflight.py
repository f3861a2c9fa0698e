"""Versions of everything the device check imports, and the imports themselves, before any
GPU work: a missing package fails here in seconds, not in a part after minutes.

    python experiments/gpu/preflight.py ENV_JSON DEVICE
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import platform
import sys
import tempfile

DISTS = {"torch": "torch", "triton": "triton", "numpy": "numpy", "pandas": "pandas",
         "pyarrow": "pyarrow", "scipy": "scipy", "typer": "typer", "click": "click",
         "yaml": "PyYAML", "jsonschema": "jsonschema", "tqdm": "tqdm",
         "safetensors": "safetensors", "pytest": "pytest", "flash_attn": "flash-attn"}
MODULES = ("adaptiveload.cli", "adaptiveload.experiment", "adaptiveload.calibration",
           "adaptiveload.training.session", "adaptiveload.training.loop",
           "adaptiveload.training.distributed", "adaptiveload.ops.kernel_build",
           "adaptiveload.ops.kernel_bench", "adaptiveload.calibration.kernel_e2e")


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for module, dist in DISTS.items():
        try:
            importlib.import_module(module)
            out[module] = md.version(dist)
        except ImportError:
            out[module] = None
        except md.PackageNotFoundError:
            out[module] = "present"
    return out


def main(out: str, device: str) -> int:
    import torch

    env = {"versions": versions(), "torch_cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(),
           "device": torch.cuda.get_device_name() if torch.cuda.is_available()
           else platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(total_memory=p.total_memory, sm_count=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}", gpus=torch.cuda.device_count())
    with open(out, "w") as fh:
        json.dump(env, fh, indent=1)
    print(json.dumps(env))
    for mod in MODULES:
        importlib.import_module(mod)
    for stage in importlib.import_module("adaptiveload.cli").STAGES:
        importlib.import_module(f"adaptiveload.cli.{stage}")
    # the run outputs are Parquet: the installed pandas must work with this pyarrow
    import pandas as pd

    from adaptiveload.io import write_parquet

    with tempfile.TemporaryDirectory() as tmp:
        frame = pd.DataFrame({"step": [0, 1], "peak_bytes": pd.array([1.0, None], "Float64")})
        write_parquet(os.path.join(tmp, "t.parquet"), frame)
        assert pd.read_parquet(os.path.join(tmp, "t.parquet")).equals(frame), "parquet round trip"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible", file=sys.stderr)
        return 1
    print("imports ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
