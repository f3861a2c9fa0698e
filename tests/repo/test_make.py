"""`make clean` removes what the pipeline writes and keeps what is committed under results/."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from repo_paths import ROOT


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_clean(tmp_path):
    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    made = ["results/default/runs/x", "results/tables/t.md", "results/figures/f.png",
            "results/mlflow.db", "results/mlartifacts/default/r/artifacts/a.csv",
            "results/p_sweep/tables/t.md", "results/kernels/bench.csv", "logs/default/a.log",
            "benchmarks/default/a.tsv", ".snakemake/log/x"]
    # committed: exactly what .gitignore lets through under results/
    kept = [line[len("!results/"):].strip("/") for line in
            (ROOT / ".gitignore").read_text().splitlines() if line.startswith("!results/")]
    assert kept, "no committed results folders in .gitignore"
    for rel in made + [f"results/{k}/keep.json" for k in kept]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    subprocess.run(["make", "clean"], cwd=tmp_path, check=True, capture_output=True)
    assert all(not (tmp_path / rel).exists() for rel in made)
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == sorted(kept)
    assert not (tmp_path / "logs").exists() and not (tmp_path / ".snakemake").exists()
