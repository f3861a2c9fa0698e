"""The convergence experiment's measured run, summed up -> results/benchmarks/convergence.json:
its cost (CPU-seconds per job from Snakemake's benchmark files, the whole run's wall clock and
CPU-seconds as measured outside it, the idle 2-core estimate), each run's validation-loss drop,
and the comparison table (`adaptiveload analyze convergence`) per step mode.

Run the experiment from a clean tree, timed, then this:

    /usr/bin/time -f "%e %U %S" -o /tmp/conv.time .venv/bin/snakemake \
        --profile workflow/profiles/default --cores 2 --configfile experiments/convergence.yaml
    .venv/bin/python tests/bench/bench_convergence.py --time /tmp/conv.time --load "..."
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pandas as pd
from stamp import stamp

from adaptiveload.analysis.convergence import curves
from adaptiveload.io import write_json
from adaptiveload.provenance import git_commit

ROOT = Path("results/convergence")
BENCH = Path("benchmarks/convergence")
CORES = 2
# the jobs that run alone on the critical path (nothing else is ready beside them): their CPU
# time is not shared with a second core
ALONE = ("calibrate", "aggregate", "record")
NOTE = (
    "Measured on the shared 2-core development machine, other engineers' jobs beside it "
    "(load averages below): wall clock is inflated by them; CPU-seconds much less so (each "
    "training job is one thread). Idle 2-core estimate = the jobs run alone at their CPU "
    "time, the rest of the run's CPU time shared by 2 cores. Losses: held-out validation "
    "loss of the tiny Wan 2.1 on synthetic learnable scenes, emulated ranks."
)


def job_costs() -> pd.DataFrame:
    """One row per job: rule, its benchmark file, wall seconds and CPU seconds."""
    rows = []
    for path in sorted(BENCH.rglob("*.tsv")):
        last = pd.read_csv(path, sep="\t").iloc[-1]
        rule = path.relative_to(BENCH).parts[0].removesuffix(".tsv")
        rows.append({"rule": rule, "file": str(path), "wall_s": last["s"],
                     "cpu_s": last["cpu_time"]})
    return pd.DataFrame(rows)


def cost(jobs: pd.DataFrame, time_file: Path | None) -> dict:
    """The budget arithmetic: per rule and in all; with the run's `/usr/bin/time` record (wall,
    user, system seconds of Snakemake and every job), the whole run's and the idle estimate."""
    by_rule = jobs.groupby("rule").agg(jobs=("file", "size"), wall_s=("wall_s", "sum"),
                                       cpu_s=("cpu_s", "sum"))
    train = jobs[jobs["rule"] == "train"]["cpu_s"]
    out = {
        "cores": CORES,
        "jobs": len(jobs),
        "by_rule": by_rule.round(2).to_dict(orient="index"),
        "train_cpu_s_per_run": {"mean": train.mean(), "min": train.min(), "max": train.max()},
        "jobs_cpu_s": float(jobs["cpu_s"].sum()),
    }
    alone = float(jobs[jobs["rule"].isin(ALONE)]["cpu_s"].sum())
    total = out["jobs_cpu_s"]
    if time_file is not None:
        wall, user, system = map(float, time_file.read_text().split()[:3])
        total = user + system
        out.update(run_wall_s=wall, run_cpu_s=total)
    out["alone_cpu_s"] = alone
    out["idle_estimate_s"] = alone + (total - alone) / CORES
    return out


def drops(curve: pd.DataFrame) -> list[dict]:
    """Per run: its first and last validation loss and the drop between them."""
    rows = []
    for (variant, policy, seed), run in curve.groupby(["variant", "policy", "seed"]):
        first, last = float(run["val_loss"].iloc[0]), float(run["val_loss"].iloc[-1])
        rows.append({"variant": variant, "policy": policy, "seed": int(seed),
                     "optimizer_steps": int(run["optimizer_steps"].max()), "first": first,
                     "last": last, "drop": 1 - last / first})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--time", type=Path, help="the run's /usr/bin/time record (%%e %%U %%S)")
    parser.add_argument("--load", default="", help="the load average during the run, in words")
    parser.add_argument("-o", "--out", default="results/benchmarks/convergence.json")
    args = parser.parse_args()
    out = stamp("experiments/convergence.yaml end to end: cost and time to quality",
                "measured", NOTE)
    out["commit"] = git_commit()
    out["load_average_during_run"] = args.load
    out["cost"] = cost(job_costs(), args.time)
    curve = curves(pd.read_parquet(ROOT / "analysis" / "steps.parquet"))
    out["runs"] = drops(curve)
    out["min_drop"] = min(r["drop"] for r in out["runs"])
    table = pd.read_csv(ROOT / "tables" / "convergence.csv")
    table["ci_width"] = table["ci_high"] - table["ci_low"]
    out["comparisons"] = table.drop(columns=["setup", "kernel", "source"]).to_dict("records")
    out["load_average_at_write"] = os.getloadavg()
    write_json(args.out, out)
    print(args.out)


if __name__ == "__main__":
    main()
