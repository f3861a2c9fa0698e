"""Tables and figures from synthetic run tables, through the real CLI commands."""

import json
import subprocess
import sys

import pandas as pd
from analysis_synth import planted_runs, write_run

from adaptiveload.analysis.figures import FIGURES

CLI = [sys.executable, "-m", "adaptiveload", "analyze"]


def _cli(*args):
    out = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out


def test_tables_and_figures_from_synthetic_runs(tmp_path):
    index = planted_runs(tmp_path / "runs", planted=True, seeds=(0, 1, 2, 3))
    for p in (1.0, 1.5, 2.0):  # a simulated p sweep, labelled `model`
        for policy, speed in (("equal-token", 1.0), ("adaptiveload", 1.0 + p / 10)):
            index.append(write_run(tmp_path / "runs", policy, 0, setup="sim/h200",
                                   variant=f"p={p}", speedup=speed, source="model",
                                   device="H200", steps=12))
    for policy, speed in (("equal-token", 1.0), ("adaptiveload", 1.2)):  # one seed, base
        index.append(write_run(tmp_path / "runs", policy, 0, setup="sim/h200", speedup=speed,
                               source="model", device="H200", steps=12))
    runs, steps = tmp_path / "runs.parquet", tmp_path / "steps.parquet"
    (tmp_path / "run_index.json").write_text(json.dumps(index))
    _cli("aggregate", "--index", tmp_path / "run_index.json", "--runs-out", runs,
         "--steps-out", steps)
    stats_csv, stats_md = tmp_path / "stats.csv", tmp_path / "stats.md"
    _cli("stats", "--runs", runs, "--csv", stats_csv, "--md", stats_md)
    tables = tmp_path / "tables"
    _cli("tables", "--runs", runs, "--steps", steps, "--stats", stats_csv, "--out-dir", tables)
    paper = pd.read_csv(tables / "paper_table.csv")
    assert set(paper.policy) == {"equal-token", "adaptiveload"}
    row = paper[(paper.policy == "adaptiveload") & (paper.setup == "train")].iloc[0]
    assert row.throughput_change > 0 and row.throughput_change_ci_low > 0
    assert row.imbalance_change < 0 and row.paper_throughput_change == "+27.2%"
    md = (tables / "paper_table.md").read_text()
    assert "measured (cpu)" in md and "18.9%" in md
    # what the numbers rest on: 40 measured steps a run, 12 simulated, each with 2 warm-up
    timed = paper.set_index("setup")[["timed_steps_min", "timed_steps_max"]]
    assert (timed.loc["train"] == 38).all().all() and (timed.loc["sim/h200"] == 10).all().all()
    assert "timed steps/seed" in md
    # the baseline leads every setup; each Δ names where its numbers come from: runs paired
    # by seed (measured), the range over seeds (a model: no CI, no p)
    assert paper.groupby("setup").policy.first().eq("equal-token").all()
    kinds = paper[paper.policy == "adaptiveload"].set_index("setup").ci_kind
    assert kinds["train"] == "replicates: runs paired by seed"
    assert kinds["sim/h200"] == "model: range over seeds"
    assert row.wall_throughput_change_ci_low > 0 and row.throughput_change_p == 2 / 2**4
    assert "CI and p from" in md and "samples/s (wall clock)" in md and "4/4 seeds" in md
    sim = paper[(paper.policy == "adaptiveload") & (paper.setup == "sim/h200")].iloc[0]
    assert pd.isna(sim.throughput_change_ci_low) and pd.isna(sim.throughput_change_p)
    headline = (tables / "headline.md").read_text()
    assert headline.index("**train**") < headline.index("**sim/h200**")
    assert "4/4 seeds" in headline and "model (H200)" in headline
    assert "not measured" in (tables / "kernel_table.md").read_text()
    figs = tmp_path / "figs"
    names = [n for n in FIGURES if n != "kernel_bandwidth"]  # drawn only from a measurement
    _cli("figures", "--runs", runs, "--steps", steps, "--stats", stats_csv, "--out-dir", figs,
         *[a for n in names for a in ("--figure", n)])
    for name in names:
        png = figs / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert png.stat().st_size > 5000, name
    kernel = subprocess.run([*CLI, "figures", "--runs", str(runs), "--steps", str(steps),
                             "--stats", str(stats_csv), "--out-dir", str(figs),
                             "--figure", "kernel_bandwidth"], capture_output=True, text=True)
    assert kernel.returncode == 2 and "nothing was measured" in kernel.stderr
    assert not (figs / "kernel_bandwidth.png").exists()


def test_unknown_figure_is_a_user_error(tmp_path):
    out = subprocess.run([*CLI, "figures", "--runs", "x", "--steps", "y", "--stats", "z",
                          "--out-dir", str(tmp_path), "--figure", "nope"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "unknown nope" in out.stderr
