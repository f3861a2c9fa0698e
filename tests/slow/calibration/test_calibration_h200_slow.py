"""The cost model on measured H200 points (tests/fixtures/h200-2026-11-30/, copies of
results/reference/h200/2026-11-30/): leave-one-out error, agreement of two calibrations of the
same device, and that the collapse of the first run cannot happen silently again.

`pytest -s` prints the numbers (measured on an NVIDIA H200, refitted here)."""

from __future__ import annotations

import pytest
from repo_paths import H200_GRID7, H200_MEASURED, ROOT

from adaptiveload.costmodel import Calibration


def test_refit_cli_writes_the_shipped_file_and_refuses_another_model(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "cal.json"
    refs = [str(path) for path in H200_GRID7.values()]
    proc = subprocess.run(
        [sys.executable, "-m", "adaptiveload", "calibrate", "refit", *refs, "--mixture",
         "paper-mixed",
         "--num-samples", "20000", "-o", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "floored form, leave-one-out median" in proc.stderr
    fresh, shipped = Calibration.load(out), Calibration.load(H200_MEASURED)
    assert fresh.model == "wan2.1-t2v-1.3b" and fresh.p == pytest.approx(shipped.p, rel=1e-6)
    wrong = subprocess.run(
        [sys.executable, "-m", "adaptiveload", "calibrate", "refit", *refs, "--model",
         "wan2.1-t2v-14b",
         "--mixture", "paper-mixed", "-o", str(tmp_path / "x.json")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert wrong.returncode == 2 and "calibration is for 'wan2.1-t2v-1.3b'" in wrong.stderr
    assert not (tmp_path / "x.json").exists()
