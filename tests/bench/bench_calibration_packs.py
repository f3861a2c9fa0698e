"""How additive is the CPU default's step? Run the CPU default calibration (experiments/
default.yaml, as the pipeline runs it: one thread, thread CPU time, its mixed packs held out
of the fit) a few times and record each run's additivity (every pack's measured and
predicted seconds, median and worst relative error) and what the packs cost beside the grid.

    python tests/bench/bench_calibration_packs.py [--runs 2] [-o OUT.json]

OUT defaults to results/benchmarks/calibration_packs.json. The packs' cost is counted in the
calibration's own records: per point or pack, its warm-up steps (plus the probe step of one
under 50 ms) and its timed steps, each at its median pass.
docs/calibration.md (mixed packs) quotes this file.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from bench_calibration_load import run_calibration
from stamp import stamp

PROBE_BELOW_S = 0.05  # timing.measure_grid's min_seconds: faster points get a probe step


def step_seconds(record: dict, grid: dict) -> float:
    """Thread CPU seconds one point or pack spent in warm-up and timed steps."""
    each = record["cpu_s_median"] or 0.0
    probe = 1 if grid["warmup"] == 0 or each < PROBE_BELOW_S else 0
    return each * (grid["warmup"] + probe + grid["repeats"] * (record["steps_per_pass"] or 0))


def one_run(out: Path) -> dict:
    run = run_calibration(out)
    cal = run.pop("calibration", None)
    if not run["ok"]:
        return run
    add, grid = cal["additivity"], cal["grid"]
    run["additivity"] = {k: v for k, v in add.items() if k not in ("packs", "what")}
    run["packs"] = [{k: r[k] for k in ("pack", "tokens", "time_s", "predicted_s", "signed_err",
                                       "spread")} for r in add["packs"]]
    run["grid_step_cpu_s"] = sum(step_seconds(p, grid) for p in cal["points"])
    run["packs_step_cpu_s"] = sum(step_seconds(p, grid) for p in add["packs"])
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", default="results/benchmarks/calibration_packs.json")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [one_run(Path(tmp) / f"run{i}.json") for i in range(args.runs)]
    result = stamp(
        "calibration_packs", "measured",
        "CPU default calibration (experiments/default.yaml) with its mixed packs held out of "
        "the fit; signed_err = predicted / measured - 1 (thread CPU seconds, one thread)",
        torch=torch.__version__,
    )
    result["runs"] = runs
    Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps([{**r.get("additivity", {}), "packs_step_cpu_s": r.get("packs_step_cpu_s"),
                       "grid_step_cpu_s": r.get("grid_step_cpu_s")} for r in runs]))


if __name__ == "__main__":
    main()
