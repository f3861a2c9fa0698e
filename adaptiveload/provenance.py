"""What every measured number is stamped with: the device, the code version, the host."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import subprocess
from functools import cache
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: str) -> str:
    """'cuda:<GPU name>' or 'cpu:<CPU model>': the device in `measured (<device>)` labels."""
    import torch

    if str(device).startswith("cuda") and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"
    return f"cpu:{cpu_model()}"


def measurement_provenance(device: str) -> dict[str, Any]:
    """Where and when a measurement on `device` ran: the device's name, torch and CUDA
    versions, host, torch's CPU threads, the machine's load and the date (UTC)."""
    import torch

    return {
        "device": device_name(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpu_threads": torch.get_num_threads(),
        "load_average_1m": os.getloadavg()[0],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def git_commit() -> str:
    """The commit of the checkout this package runs from, or 'unknown' outside git.

    Only when git tracks this very file: an installed copy inside some other work tree (a
    virtualenv in a checkout) would otherwise report that checkout's commit as its own."""
    here = Path(__file__).resolve()
    try:
        out = subprocess.run(
            ["git", "ls-files", "--error-unmatch", here.name],
            capture_output=True, text=True, timeout=10, cwd=here.parent,
        )
        if out.returncode != 0:
            return "unknown"
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, cwd=here.parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@cache
def code_version() -> str:
    """'<package version>+<hash of the package's Python sources>': changes with any edit of
    the code, committed or not, so a checkpoint of other code is never resumed."""
    from adaptiveload import __version__

    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return f"{__version__}+{digest.hexdigest()[:12]}"
