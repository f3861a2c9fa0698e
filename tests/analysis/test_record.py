"""The analysis run's metrics: a handful, of the measured setup, each policy's speedup with
its interval's ends as the statistics give them (no MLflow store needed)."""

from __future__ import annotations

import numpy as np
from analysis_synth import write_run

from adaptiveload.analysis.aggregate import aggregate, parse_index
from adaptiveload.analysis.landing import speedups
from adaptiveload.analysis.record import headline_metrics, headline_setup
from adaptiveload.analysis.stats import compare


def test_headline_metrics_are_the_measured_setups_speedups_with_intervals(tmp_path):
    index = []
    for seed in (0, 1):
        for policy, speedup in (("equal-token", 1.0), ("adaptiveload", 1.3)):
            for kernel in ("eager", "fused"):
                index.append(write_run(tmp_path / kernel, policy, seed, speedup=speedup,
                                       kernel=kernel, steps=6))
            index.append(write_run(tmp_path, policy, seed, setup="sim/h200", kernel="none",
                                   speedup=speedup, source="model", device="H200", steps=6))
    agg = aggregate(parse_index(index))
    stats = compare(agg.runs, seed=0)
    stats.loc[stats["kernel"] == "fused", ["ci_low", "ci_high"]] = np.nan  # no interval there
    assert headline_setup(agg.runs) == "train"
    metrics = headline_metrics(agg.runs, stats)
    per_policy = ("samples_per_s", "imbalance_rate")
    assert set(metrics) == {
        *(f"{p}/{k}/{m}" for p in ("equal-token", "adaptiveload") for k in ("eager", "fused")
          for m in per_policy),
        "adaptiveload/eager/speedup", "adaptiveload/eager/speedup_ci_low",
        "adaptiveload/eager/speedup_ci_high", "adaptiveload/fused/speedup",
    }  # several kernels: the kernel in the key; no interval, no key; no simulation
    ratio = speedups(stats).set_index(["setup", "kernel", "policy"])
    row = ratio.loc[("train", "eager", "adaptiveload")]
    assert metrics["adaptiveload/eager/speedup"] == row["estimate"]
    assert metrics["adaptiveload/eager/speedup_ci_low"] == row["ci_low"]
    runs = agg.runs[(agg.runs["setup"] == "train") & (agg.runs["kernel"] == "fused")]
    base = runs[runs["policy"] == "equal-token"]["samples_per_s"].mean()
    assert metrics["equal-token/fused/samples_per_s"] == base

