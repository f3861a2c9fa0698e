"""Fixtures and hooks shared by every test folder (the helpers to import live in
tests/support/; tests/slow/conftest.py marks the slow lane)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from repo_paths import GPU_SCRIPTS
from suite_order import end_to_end, longest_first


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (suite_order.LONGEST_FIRST); nothing else moves."""
    longest_first(items)


@pytest.fixture(autouse=True)
def _fast_lane_starts_no_end_to_end_run(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test outside tests/slow/ that starts the pipeline, torchrun, an MLflow server or an
    install fails at that call, naming the program: such a test belongs in the slow lane."""
    if request.node.get_closest_marker("slow"):
        return
    start = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen, args: object, *rest: object, **kw: object) -> None:
        program = end_to_end(args)
        if program:
            raise AssertionError(f"{request.node.nodeid} starts {program}: the fast lane "
                                 "starts no end-to-end run; move the test under tests/slow/")
        start(self, args, *rest, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)


@pytest.fixture(scope="session")
def gpu_script() -> Callable[[str], ModuleType]:
    """Import a script of experiments/gpu/ by name (they import each other as siblings, the
    way they run: `python experiments/gpu/<name>.py`)."""

    def load(name: str) -> ModuleType:
        if str(GPU_SCRIPTS) not in sys.path:
            sys.path.insert(0, str(GPU_SCRIPTS))
        return importlib.import_module(name)

    return load


@pytest.fixture(scope="module")
def plan_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What `adaptiveload plan` reads (tests/cli/ and tests/slow/cli/): an 800-sample
    paper-mixed manifest and a 1.3B H200 calibration of known coefficients, in a folder the
    tests write their plans to."""
    from adaptiveload.data.manifest import write_manifest
    from adaptiveload.data.mixtures import synthesize

    root = tmp_path_factory.mktemp("plan_cli")
    manifest = root / "manifest.parquet"
    write_manifest(manifest, synthesize("paper-mixed", 800, seed=0))
    calibration = root / "cal.json"
    calibration.write_text(
        json.dumps(
            {
                "model": "wan2.1-t2v-1.3b",
                "device": "H200",
                "source": "model",
                "cost": {
                    "c0": 0.02,
                    "a": 1.6e-5,
                    "b": 1.1e-9,
                    "m_static": 2e10,
                    "m_tok": 1.5e6,
                    "m_seq": 1e6,
                },
                "p": 1.36,
                "m_mem": 80_000,
                "m_comp": 75_600**1.36,
                "capacity_bytes": 1.4e11,
                "num_params": 1.3e9,
            }
        )
    )
    return {"root": root, "manifest": manifest, "calibration": calibration}
