"""The slow lane: every test in this folder is marked `slow` here, by where it lives, and by
nothing else (tests/repo/test_suite_layout.py checks). `make check` leaves these out; `make
test` and CI run them. What belongs here: tests that start the pipeline (Snakemake), torchrun,
installs, `make`, real MLflow servers, the CLI as a subprocess end to end, real faults, or run
for tens of seconds in-process."""

from __future__ import annotations

import pytest
from repo_paths import SLOW


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark `item` slow when it lives under tests/slow/ (pytest calls this hook of a conftest
    for the items of its own folder; the check keeps it so if that ever changes)."""
    if SLOW in item.path.parents:
        item.add_marker(pytest.mark.slow)
