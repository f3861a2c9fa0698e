"""Fixtures and helpers shared by the test modules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

GPU_SCRIPTS = Path(__file__).resolve().parents[1] / "experiments" / "gpu"


@pytest.fixture(scope="session")
def gpu_script() -> Callable[[str], ModuleType]:
    """Import a script of experiments/gpu/ by name (they import each other as siblings, the
    way they run: `python experiments/gpu/<name>.py`)."""

    def load(name: str) -> ModuleType:
        if str(GPU_SCRIPTS) not in sys.path:
            sys.path.insert(0, str(GPU_SCRIPTS))
        return importlib.import_module(name)

    return load
