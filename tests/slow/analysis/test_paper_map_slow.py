"""The paper map: its design, the consistency and tornado logic on planted points, and a tiny
real sweep through the CLI into the figure and the paper table."""

import json
import subprocess
import sys

import pandas as pd
import yaml
from analysis_synth import MAP_CENTRE, planted_runs
from repo_paths import H200_MEASURED

from adaptiveload.analysis import paper_map as pm
from adaptiveload.planning import paper_map as pmap

CLI = [sys.executable, "-m", "adaptiveload", "analyze"]


def _cli(*args):
    out = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out


def test_tiny_sweep_through_the_cli_into_figure_and_paper_table(tmp_path):
    spec = {"enabled": True, "num_samples": 800, "seeds": [0], "tolerance_pp": 5.0,
            "centre": MAP_CENTRE,
            "axes": {"dealing": list(pmap.DEALINGS),
                     "calibration": [MAP_CENTRE["calibration"], str(H200_MEASURED)]},
            "factorial": {"reference": ["heaviest", "most-common"], "m_comp_scale": [1.0, 2.0]}}
    config = tmp_path / "map.yaml"
    config.write_text(yaml.safe_dump({"name": "tiny_map", "paper_map": spec}))
    points, summary = tmp_path / "points.csv", tmp_path / "summary.json"
    _cli("paper-map", "--config", config, "--points", points, "--summary", summary)
    table = pd.read_csv(points)
    settings = 1 + 2 + 1 + 3  # centre, sorted + balanced, measured, 3 more factorial corners
    assert len(table) == settings * 4  # one row per imbalance definition
    assert set(table["definition"]) == {"range", "max-mean", "cv", "idle"}
    for col in ("baseline_imbalance", "adaptiveload_imbalance", "vram_change",
                "throughput_change", "p", "m_comp", "ref_tokens", "source", "designs"):
        assert table[col].notna().all(), col
    assert table["source"].str.startswith("model (").all()
    measured = "model (h200-wan2.1-t2v-1.3b-measured: measured on cuda:NVIDIA H200)"
    assert measured in set(table["source"])
    assert "model (h200-wan2.1-t2v-1.3b: NVIDIA H200 (analytic prior))" in set(table["source"])
    rng = table[table["definition"] == "range"].set_index("dealing")
    centre = rng[rng["designs"].str.contains("centre")].iloc[0]
    assert rng.loc["balanced", "baseline_imbalance"] < centre["baseline_imbalance"]
    result = json.loads(summary.read_text())
    assert result["region"]["settings"] == settings
    assert result["region"]["rows"] == settings * 4
    assert set(result["most_influential"]) <= set(pm.PAPER)

    png = tmp_path / "map.png"
    _cli("paper-map-figure", "--points", points, "--summary", summary, "-o", png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

    index = planted_runs(tmp_path / "runs", planted=True, seeds=(0,))
    runs, steps = tmp_path / "runs.parquet", tmp_path / "steps.parquet"
    (tmp_path / "run_index.json").write_text(json.dumps(index))
    _cli("aggregate", "--index", tmp_path / "run_index.json", "--runs-out", runs,
         "--steps-out", steps)
    stats = tmp_path / "stats.csv"
    _cli("stats", "--runs", runs, "--csv", stats, "--md", tmp_path / "stats.md")
    out = tmp_path / "tables"
    _cli("tables", "--runs", runs, "--steps", steps, "--stats", stats, "--out-dir", out,
         "--paper-map", summary)
    paper = pd.read_csv(out / "paper_table.csv")
    mapped = paper[paper["setup"].str.contains("the paper|paper-consistent")]
    assert len(mapped) >= 2 and set(mapped["policy"]) == {"equal-token", "adaptiveload"}
    assert mapped["label"].str.startswith("model").all()
    lines = [line for line in (out / "paper_table.md").read_text().splitlines()
             if "the paper (" in line or "paper-consistent (" in line]
    assert len(lines) == len(mapped) and not any("nan" in line for line in lines)
