"""Mixed packs in a calibration: named sets of samples of different lengths, each timed as ONE
packed forward+backward of the real model and held out of the fit (`additivity`): a real CPU
measurement on the micro model, the file round trip, old files, the report, the flags and
the schema."""

from __future__ import annotations

import json
import subprocess
import sys

from repo_paths import ROOT


def test_pack_flags_replace_the_config_packs_and_the_report_shows_them(tmp_path):
    """`calibrate measure --pack NAME=S1,...` (repeatable) over an experiment file's packs;
    the report's additivity block; a bad --pack exits 2 before anything is written."""
    exp = tmp_path / "exp.yaml"
    exp.write_text(json.dumps({
        "name": "packs", "model": {"config": "wan2.1-micro"},
        "data": {"mixture": "tiny-cpu", "num_samples": 50, "grid": "tiny"},
        "calibration": {"batch_sizes": [1, 2], "tokens": [16, 64, 256, 1024], "repeats": 2,
                        "capacity_gb": 0.05, "threads": 1, "timer": "cpu", "max_loo_error": 10,
                        "packs": [{"name": "from-file", "tokens": [256, 16]}]},
    }))
    out = tmp_path / "cal.json"
    base = [sys.executable, "-m", "adaptiveload", "calibrate", "measure", "--config", str(exp),
            "--quiet", "-o", str(out)]
    bad = subprocess.run([*base, "--pack", "x=64,64"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "at least 2 different token counts" in bad.stderr
    assert "Traceback" not in bad.stderr and not out.exists()
    proc = subprocess.run([*base, "--pack", "mix=221,64,16", "--pack", "pair=1024,64"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [p["name"] for p in data["grid"]["packs"]] == ["mix", "pair"]
    assert [p["pack"] for p in data["additivity"]["packs"]] == ["mix", "pair"]
    block = proc.stderr[proc.stderr.index("additivity:"):].splitlines()
    assert block[0].startswith("additivity: 2 of 2 mixed packs held out of the fit (thread CPU")
    assert block[1].startswith("  mix: 221 + 64 + 16 = 301 tokens: measured ")
    assert block[2].startswith("  pair: 1024 + 64 = 1088 tokens: measured ")
