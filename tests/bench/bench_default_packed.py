"""The measured CPU default, packed vs equal-token and vs balanced dealing: whole-epoch
training runs of the default experiment, its seeds, thread CPU time, compared by the analysis'
own replicate-level inference (runs paired by seed)
-> results/benchmarks/default_packed_training.json.

Run the training jobs first (the default experiment's calibration, plans and runs):

    .venv/bin/snakemake --cores 2 results/default/runs/{equal-token,adaptiveload-balanced,\
adaptiveload-packed}/seed{0,1,2}/eager/summary.json
    .venv/bin/python tests/bench/bench_default_packed.py

(A full `snakemake --cores all` makes the same runs and the paper table with all four
policies; this reads only the nine it needs.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml
from stamp import stamp

from adaptiveload.analysis.stats import PAIRED
from adaptiveload.io import read_json, write_json

POLICIES = ("equal-token", "adaptiveload-balanced", "adaptiveload-packed")
SEEDS = tuple(yaml.safe_load(Path("experiments/default.yaml").read_text())["seeds"])
RUNS = Path("results/default/runs")
FIELDS = ("samples_per_s", "imbalance_rate", "idle_fraction", "steps", "sim_rel_err_median",
          "batch_layout", "timer", "timed_window")
NOTE = (
    "Measured: each run is one thread on the 2-core development machine, timed by that "
    "thread's CPU time (docs/measurement.md); other engineers' jobs ran beside them (load "
    "averages in the runs' own records). Compare the policies of this file, not machines."
)


def analyze(cmd: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "adaptiveload", "analyze", *cmd],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-o", "--out", default="results/benchmarks/default_packed_training.json")
    args = parser.parse_args()
    index = [{"setup": "train", "variant": "base",
              "summary": str(RUNS / p / f"seed{s}" / "eager" / "summary.json"),
              "steps": str(RUNS / p / f"seed{s}" / "eager" / "steps.parquet")}
             for p in POLICIES for s in SEEDS]
    out = stamp("default experiment, measured: packed vs equal-token and balanced", "measured",
                NOTE)
    out["runs"] = [{"policy": p, "seed": s, **{k: read_json(Path(i["summary"]), "run summary")
                    .get(k) for k in FIELDS}}
                   for i, (p, s) in zip(index, [(p, s) for p in POLICIES for s in SEEDS],
                                        strict=True)]
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        pd.Series(index).to_json(t / "index.json", orient="records")
        analyze(["aggregate", "--index", str(t / "index.json"), "--runs-out",
                 str(t / "runs.parquet"), "--steps-out", str(t / "steps.parquet")])
        for baseline in ("equal-token", "adaptiveload-balanced"):
            analyze(["stats", "--runs", str(t / "runs.parquet"), "--csv",
                     str(t / "stats.csv"), "--md", str(t / "stats.md"), "--baseline", baseline])
            stats = pd.read_csv(t / "stats.csv")
            rows = stats[(stats["policy"] == "adaptiveload-packed") & (stats["test"] == PAIRED)]
            out[f"packed_vs_{baseline}"] = {
                r.metric: {"estimate": r.estimate, "ci_low": r.ci_low, "ci_high": r.ci_high,
                           "p": r.p_value} for r in rows.itertuples()
            }
    out["load_average_at_write"] = os.getloadavg()
    write_json(args.out, out)
    print(args.out)


if __name__ == "__main__":
    main()
