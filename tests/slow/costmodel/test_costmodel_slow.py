"""Cost model: fit recovers known coefficients; exponent; budget rules; analytic counts."""

from __future__ import annotations

import pytest
from repo_paths import H200_MEASURED


def test_budgets_cli_sizes_the_device_for_an_m_mem():
    """`adaptiveload budgets --m-mem`: the capacity at which M_mem is the given tokens, and the
    budgets there (what experiments/gpu/train_budgets.py gives a short device run)."""
    import json
    import subprocess
    import sys

    cal = str(H200_MEASURED)
    args = [sys.executable, "-m", "adaptiveload", "budgets", "--calibration", cal,
            "--mixture", "paper-mixed", "--num-samples", "500", "--max-frames", "5"]
    done = subprocess.run([*args, "--m-mem", "18000"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["m_mem"] == pytest.approx(18000, rel=1e-12)
    assert (out["ref_tokens"], out["ref_batch"]) == (7200, 2) and out["m_tok"] == 14400
    assert 0 < out["capacity_gb"] < 141
    both = subprocess.run([*args, "--m-mem", "1", "--capacity-gb", "1"], capture_output=True,
                          text=True)
    assert both.returncode == 2 and "not both" in both.stderr and not both.stdout
