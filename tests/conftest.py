"""Fixtures and helpers shared by the test modules."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

GPU_SCRIPTS = Path(__file__).resolve().parents[1] / "experiments" / "gpu"

# The test files that take longest, longest first (each over ~50 s in a 2-process run on the
# 2-core machine). They are collected first, and `make test` hands whole files to its pytest
# processes in collection order (--dist loadfile --no-loadscope-reorder), so the run ends on
# short files instead of one process running the pipeline test alone while the other idles:
# longest-processing-time-first, as the planner deals its packs. Other files follow in their
# usual order; the order of tests inside a file never changes.
LONGEST_FIRST = (
    "test_pipeline.py", "test_faults.py", "test_gpu_check.py", "test_install.py",
    "test_tracking.py", "test_run_state.py", "test_calibration.py", "test_train_packed.py",
    "test_routes.py", "test_sampler_docs.py", "test_train_distributed.py", "test_kernel_ops.py",
    "test_kernel_build.py", "test_train_resume.py", "test_kernel_check.py",
    "test_kernel_segments.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (LONGEST_FIRST); a stable sort, so nothing else moves."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def gpu_script() -> Callable[[str], ModuleType]:
    """Import a script of experiments/gpu/ by name (they import each other as siblings, the
    way they run: `python experiments/gpu/<name>.py`)."""

    def load(name: str) -> ModuleType:
        if str(GPU_SCRIPTS) not in sys.path:
            sys.path.insert(0, str(GPU_SCRIPTS))
        return importlib.import_module(name)

    return load
