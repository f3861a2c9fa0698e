"""Benchmark: do the measured CPU rows reproduce when the machine is busy?

Run: .venv/bin/python tests/bench/bench_reproducibility.py [--config experiments/default.yaml]
     [--calibration FILE] [--seed 0] [--steps N|epoch] [--load-procs 2]
     [-o results/benchmarks/reproducibility.json]

The default experiment's training pair (equal-token and adaptiveload-balanced, one seed, the
exact `adaptiveload train` command of the pipeline's `train` rule, without MLflow and
checkpoints; the two side by side, as the pipeline runs them) runs twice: once with nothing
of ours beside it ("alone") and once beside `--load-procs` CPU-bound busy loops ("loaded";
each bounded by `timeout`, stopped by pid when the pair is done). Per condition: samples/s
and imbalance of both policies, by the run's timer (on a CPU the computing thread's CPU time)
and by the wall clock. Then, per clock:

    throughput_ratio_of_ratios = (balanced / equal-token samples/s, loaded)
                                 / (balanced / equal-token samples/s, alone)    target 1 +- 5%
    imbalance_change_pp        = balanced imbalance, loaded - alone             target +- 3 pp

The machine is shared: "alone" means without our busy loops, not without other people's jobs;
the load averages around every run are recorded so that a reader can judge. `--steps` shortens
the runs (default: the experiment's): both conditions run the same plan, so the same batches,
and only the clocks' response to the load is compared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import torch
from stamp import stamp

from adaptiveload.experiment import load
from adaptiveload.io import write_json
from adaptiveload.metrics import imbalance_rate

PAIR = ("equal-token", "adaptiveload-balanced")
RATIO_TARGET, IMBALANCE_TARGET_PP = 0.05, 3.0
BUSY_LOOP = "while True: pass"


def run_train(args: argparse.Namespace, policy: str, out: Path, world: int) -> dict:
    """One training run as the pipeline runs it; its summary plus wall-clock imbalance."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "adaptiveload", "train", "--config", args.config,
                    "--policy", policy, "--seed", str(args.seed), "--emulate-world-size",
                    str(world), "--calibration", args.calibration, "--out", str(out),
                    "--steps", str(args.steps), "--no-track", "--no-checkpoint"],
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                   text=True)
    duration = time.perf_counter() - t0
    summary = json.loads((out / "summary.json").read_text())
    steps = pd.read_parquet(out / "steps.parquet")
    timed = steps[steps["step"] >= summary["warmup_steps"]]
    wall = timed.pivot(index="step", columns="rank", values="compute_wall_s").to_numpy()
    return {
        "policy": policy,
        "timer": summary["timer"],
        "samples_per_s": summary["samples_per_s"],
        "samples_per_s_wall": summary["samples_per_s_wall"],
        "imbalance_rate": summary["imbalance_rate"],
        "imbalance_rate_wall": imbalance_rate(wall),
        "sim_rel_err_median": summary.get("sim_rel_err_median"),
        "run_wall_s": duration,
        "load_average_1m_before": load_before[0],
        "load_average_1m_after": os.getloadavg()[0],
    }


def run_pair(args: argparse.Namespace, work: Path, condition: str, world: int) -> dict:
    """Both policies under one condition; busy loops beside them when `condition` is loaded."""
    procs: list[subprocess.Popen] = []
    if condition == "loaded":
        procs = [subprocess.Popen(["timeout", "3600", sys.executable, "-c", BUSY_LOOP])
                 for _ in range(args.load_procs)]
        time.sleep(2.0)  # let them take the cores before training starts
    try:  # side by side, one core each, as the pipeline's `train` jobs run on a CPU
        with ThreadPoolExecutor(len(PAIR)) as pool:
            futures = {p: pool.submit(run_train, args, p, work / condition / p, world)
                       for p in PAIR}
            runs = {p: f.result() for p, f in futures.items()}
    finally:
        for proc in procs:  # only the processes started above, by pid
            proc.terminate()
            proc.wait()
    eq, bal = runs[PAIR[0]], runs[PAIR[1]]
    return {
        "busy_loops": len(procs),
        "runs": runs,
        "throughput_ratio": bal["samples_per_s"] / eq["samples_per_s"],
        "throughput_ratio_wall": bal["samples_per_s_wall"] / eq["samples_per_s_wall"],
    }


def compare(alone: dict, loaded: dict) -> dict:
    """The two conditions side by side, per clock, against the targets."""
    out = {}
    for clock, ratio_key, imb_key in (("timer", "throughput_ratio", "imbalance_rate"),
                                      ("wall", "throughput_ratio_wall", "imbalance_rate_wall")):
        ror = loaded[ratio_key] / alone[ratio_key]
        imb = {p: 100 * (loaded["runs"][p][imb_key] - alone["runs"][p][imb_key]) for p in PAIR}
        out[clock] = {
            "throughput_ratio_of_ratios": ror,
            "imbalance_change_pp": imb,
            "meets_targets": abs(ror - 1) <= RATIO_TARGET
            and all(abs(v) <= IMBALANCE_TARGET_PP for v in imb.values()),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="experiments/default.yaml")
    parser.add_argument("--calibration", default=None,
                        help="default: the default pipeline's, else one measured here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", default=None,
                        help="a count or 'epoch' (default: train.steps)")
    parser.add_argument("--load-procs", type=int, default=2)
    parser.add_argument("-o", "--out", default="results/benchmarks/reproducibility.json")
    args = parser.parse_args()
    exp = load(args.config)
    work = Path(tempfile.mkdtemp(prefix="bench_repro_"))
    if args.calibration is None:
        pipeline = Path(f"results/{exp['name']}/calibration/calibration.json")
        args.calibration = str(pipeline)
        if not pipeline.exists():
            args.calibration = str(work / "calibration.json")
            subprocess.run([sys.executable, "-m", "adaptiveload", "calibrate", "measure",
                            "--config", args.config, "-o", args.calibration, "--quiet"],
                           check=True)
    world = exp["train"]["world_size"]
    args.steps = args.steps or exp["train"]["steps"]
    conditions = {}
    for condition in ("alone", "loaded"):
        conditions[condition] = run_pair(args, work, condition, world)
        print(f"{condition}: balanced / equal-token samples/s = "
              f"{conditions[condition]['throughput_ratio']:.4f} (timer), "
              f"{conditions[condition]['throughput_ratio_wall']:.4f} (wall)", file=sys.stderr)
    result = {
        **stamp("reproducibility of the default training pair, alone vs beside busy loops",
                "measured",
                "Shared 2-core machine: 'alone' = without this benchmark's busy loops; other "
                "engineers' jobs may have run during both conditions (see the load averages "
                "per run). 'timer' is the runs' timer (CPU: thread CPU time of the one "
                "computing thread), 'wall' the wall clock of the same spans. Runs without "
                "MLflow tracking and checkpoints; otherwise the pipeline's command.",
                torch=torch.__version__),
        "config": args.config,
        "calibration": args.calibration,
        "seed": args.seed,
        "steps": args.steps,
        "warmup_steps": exp["train"]["warmup_steps"],
        "world_size": world,
        "targets": {"throughput_ratio_of_ratios": f"1 +- {RATIO_TARGET:.0%}",
                    "imbalance_change_pp": f"+- {IMBALANCE_TARGET_PP} pp"},
        "conditions": conditions,
        "comparison": compare(conditions["alone"], conditions["loaded"]),
    }
    write_json(args.out, result)
    print(json.dumps(result["comparison"], indent=1))


if __name__ == "__main__":
    main()
