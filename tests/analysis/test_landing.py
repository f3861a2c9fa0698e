"""The report's landing text: generated from a tiny synthetic experiment's statistics, it names
every policy with its numbers, measured first, and says why the kernel has no figure."""

from __future__ import annotations

import numpy as np
import pandas as pd
from analysis_synth import write_run
from cli_runner import run

from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.analysis.landing import PAPER_TEXT, speedups
from adaptiveload.analysis.stats import compare
from adaptiveload.io import write_parquet

POLICIES = {"equal-token": 1.0, "adaptiveload": 1.2, "adaptiveload-packed": 1.5}


def test_landing_names_every_policy_with_its_generated_numbers(tmp_path, monkeypatch, capsys):
    index = []
    for seed in (0, 1):
        for policy, speedup in POLICIES.items():
            index.append(write_run(tmp_path, policy, seed, speedup=speedup, steps=8))
            index.append(write_run(tmp_path, policy, seed, setup="sim/h200", kernel="none",
                                   speedup=speedup, source="model", device="H200", steps=6))
    agg = aggregate(parse_index(index))
    stats = compare(agg.runs, seed=0)
    stats.loc[stats["setup"] == "sim/h200", ["ci_low", "ci_high"]] = np.nan  # no CI: seeds
    files = {"runs": tmp_path / "runs.parquet", "stats": tmp_path / "stats.csv",
             "template": tmp_path / "workflow.rst", "bench": tmp_path / "bench.csv"}
    write_parquet(files["runs"], agg.runs)
    stats.to_csv(files["stats"], index=False)
    files["template"].write_text("Experiment **{{ snakemake.config['name'] }}**.\n")
    pd.DataFrame([{"source": "skipped", "note": "no CUDA device"}]).to_csv(files["bench"])
    out = tmp_path / "landing.rst"
    code, _, err = run(monkeypatch, capsys, "analyze", "landing", "--runs", str(files["runs"]),
                       "--stats", str(files["stats"]), "--template", str(files["template"]),
                       "--kernel-bench", str(files["bench"]), "-o", str(out))
    assert code == 0, err
    text = out.read_text(encoding="utf-8")
    assert text.startswith("Experiment **{{ snakemake.config['name'] }}**.")  # the template
    bullets = [line for line in text.splitlines() if line.startswith("- ``")]
    assert [b.split("``")[1] for b in bullets] == ["train / eager", "sim/h200"]  # measured 1st
    ratios = speedups(stats).set_index(["setup", "policy"])["estimate"]
    for bullet, setup in zip(bullets, ("train", "sim/h200"), strict=True):
        assert all(f"**{policy}**" in bullet for policy in POLICIES)
        assert "**equal-token**" in bullet.split(";")[0] and "(baseline)" in bullet
        for policy in ("adaptiveload", "adaptiveload-packed"):
            assert f"×{ratios[(setup, policy)]:.2f}" in bullet
    assert "[95% CI " in bullets[0] and "(seeds " in bullets[1] and "95% CI" not in bullets[1]
    assert PAPER_TEXT in text and "×1.272" in PAPER_TEXT and "39% → 18.9%" in PAPER_TEXT
    assert "not measured (no CUDA device)" in text and "tables/stats.csv" in text

    code, _, err = run(monkeypatch, capsys, "analyze", "landing", "--runs", str(files["runs"]),
                       "--stats", str(files["stats"]), "--template", str(tmp_path / "none"),
                       "-o", str(tmp_path / "other.rst"))
    assert code == 2 and "--template" in err and not (tmp_path / "other.rst").exists()
