"""What every benchmark result file opens with: what was measured, on what, when, with which
versions, and the caveat. Imported by the bench scripts (run as scripts, so this folder is on
sys.path)."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload import __version__
from adaptiveload.provenance import cpu_model


def device_name() -> str:
    """This machine as a result file names it."""
    return f"CPU: {cpu_model()} ({os.cpu_count()} cores visible)"


def stamp(benchmark: str, source: str, note: str, **versions: str) -> dict[str, Any]:
    """The header of a result file; `source` is "measured" or "model", `versions` extra ones."""
    return {
        "benchmark": benchmark,
        "source": source,
        "device": device_name(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "versions": {
            "adaptiveload": __version__,
            "python": platform.python_version(),
            "numpy": np.__version__,
            "pandas": pd.__version__,
            **versions,
        },
        "note": note,
    }
