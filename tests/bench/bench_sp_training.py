"""Benchmark (measured, CPU, gloo): sequence-parallel training of the tiny Wan 2.1 under
torchrun, wall clock per step -> results/benchmarks/sp_training_cpu.json.

Run: .venv/bin/python tests/bench/bench_sp_training.py [--calibration FILE] [--samples 60]
     [-o results/benchmarks/sp_training_cpu.json]

Each run is one torchrun launch of this script's worker (`--worker`: one `Trainer`, the
default experiment's model, data mixture and budgets, policy adaptiveload-packed, one whole
epoch after 2 warm-up steps, no checkpoints, one torch thread per process):

1. `d1` and `d2`, degrees 1 and 2 over the same samples: the packed plan on ONE rank (each
   step's samples one pack), trained by 1 process (degree 1) and by 2 processes as one group
   of 2 (the same packs in the same steps at degree 2).
2. `mixed`, a 4-process run whose plan mixes degrees 1 and 2: the packed plan on 3 ranks
   regrouped into steps of groups {1, 1, 2} and {2, 1, 1} (`training_setup.GroupedSteps`, as
   the exactness test), its per-step wall clock against the plan's prediction through the
   calibration (`planning.simulate`: each micro-batch at its degree, the calibration's comm
   section for the all-to-alls, the step's slowest rank plus the all-reduce).

Without --calibration the CPU calibration is measured first (`adaptiveload calibrate measure`
on the default experiment, then `calibrate comm` under torchrun with 4 processes into it).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
import yaml
from stamp import stamp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # GroupedSteps, as the exactness test

from training_setup import GroupedSteps  # noqa: E402

from adaptiveload import experiment  # noqa: E402
from adaptiveload.costmodel import Calibration  # noqa: E402
from adaptiveload.io import write_json, write_parquet  # noqa: E402
from adaptiveload.planning.simulate import simulate  # noqa: E402
from adaptiveload.step_table import SP_DEGREE, timed  # noqa: E402
from adaptiveload.training.distributed import resolve_ranks  # noqa: E402
from adaptiveload.training.inputs import prepare_data  # noqa: E402
from adaptiveload.training.loop import Trainer  # noqa: E402
from adaptiveload.training.settings import from_experiment  # noqa: E402

TORCHRUN = Path(sys.executable).parent / "torchrun"
POLICY = "adaptiveload-packed"
WARMUP = 2
# run -> (processes, ranks of the base plan, the steps' group degrees; empty: the base plan)
RUNS = {"d1": (1, 1, ""), "d2": (2, 1, "2"), "mixed": (4, 3, "1,1,2;2,1,1")}
NOTE = (
    "Measured: wall clock per step under torchrun with gloo on the 2-core development machine "
    "(one torch thread per process; other jobs beside it: the load averages below), the step's "
    "wall on its slowest process (forward, backward, the all-reduce and the optimizer). d1 and "
    "d2 train the same packs in the same steps on 1 and 2 processes; mixed runs 4 processes on "
    "2 cores, so two processes share each core and its wall clock is not a rank's time. The "
    "prediction is model: the calibration's cost model (measured by one thread's CPU time, on "
    "this machine) at each micro-batch's degree with its comm section (gloo, measured)."
)


def worker(args: argparse.Namespace) -> None:
    """One run under torchrun: `Trainer` over the (regrouped) plan; rank 0 writes its steps and
    epoch 0's plan."""
    exp = experiment.load(args.config)
    ranks = resolve_ranks(None, exp["train"]["world_size"])
    cfg = from_experiment(exp, POLICY, 0, launch_mode="distributed", world_size=ranks.world_size)
    calibration = Calibration.load(args.calibration)
    base = prepare_data(exp, replace(cfg, world_size=args.base_world, launch_mode="emulated"),
                        calibration)
    data = base
    if args.groups:
        b = base.builder
        compositions = tuple(tuple(int(d) for d in c.split(",")) for c in args.groups.split(";"))
        data = replace(base, builder=GroupedSteps(b.samples, b.policy, b.budgets, cfg.world_size,
                                                  b.seed, base=b, compositions=compositions))
    torch.set_num_threads(1)
    trainer = Trainer(cfg, data, None, ranks, progress=False, identity="bench")
    try:
        steps = trainer.run().steps
    finally:
        trainer.close()
    if ranks.is_main:
        write_parquet(args.out / "steps.parquet", steps)
        write_parquet(args.out / "plan.parquet", data.builder(0).table)


def launch(run: str, config: Path, calibration: Path, out: Path) -> float:
    """One run of RUNS in a fresh torchrun; its wall clock end to end."""
    procs, base_world, groups = RUNS[run]
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["world_size"] = procs
    path = out / f"{run}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_ENABLE_TELEMETRY="false")
    t0 = time.perf_counter()
    subprocess.run(
        [TORCHRUN, "--nproc-per-node", str(procs), "--master-addr", "127.0.0.1",
         "--master-port", str(29600 + procs), __file__, "--worker", "--config", str(path),
         "--calibration", str(calibration), "--base-world", str(base_world),
         "--groups", groups, "--out", str(out / run)],
        env=env, check=True, cwd=ROOT,
    )
    return time.perf_counter() - t0


def per_step(out: Path) -> pd.DataFrame:
    """A run's timed steps: the step's wall clock and each rank's compute, one row a step."""
    steps = pd.read_parquet(out / "steps.parquet")
    steps = steps[timed(steps["step"], WARMUP)]
    return steps.groupby("step").agg(wall_s=("step_wall_s", "first"),
                                     compute_max_s=("compute_s", "max"),
                                     samples=("samples", "sum"), tokens=("tokens", "sum"))


def stats(values: pd.Series) -> dict[str, float]:
    return {"median": float(values.median()), "mean": float(values.mean()),
            "sum": float(values.sum()), "steps": int(values.size)}


def predicted(out: Path, calibration: Calibration, world: int) -> pd.DataFrame:
    """The plan's per-step prediction (model): `simulate` of epoch 0's plan, each micro-batch
    at its degree; the timed steps replay epoch 0 from its first step after the warm-up."""
    plan = pd.read_parquet(out / "plan.parquet")
    plan.attrs["plan"] = {"world_size": world}
    sim = simulate(plan, calibration, world_size=world).steps
    if SP_DEGREE in plan and SP_DEGREE not in sim:
        raise SystemExit("planning.simulate does not cost sequence-parallel groups here")
    by_step = sim.groupby("step").agg(predicted_s=("step_time_s", "first"),
                                      predicted_compute_max_s=("compute_s", "max"))
    by_step.index = by_step.index + WARMUP
    return by_step


def calibrate(work: Path) -> Path:
    """The CPU calibration of the default experiment with a comm section (4 processes)."""
    cal = work / "calibration.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "adaptiveload", "calibrate", "measure", "--config",
                    "experiments/default.yaml", "-o", str(cal), "--quiet"],
                   check=True, cwd=ROOT, env=env)
    subprocess.run([TORCHRUN, "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
                    "--master-port", "29650", "-m", "adaptiveload", "calibrate", "comm",
                    "--calibration", str(cal), "--quiet"], check=True, cwd=ROOT, env=env)
    return cal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=ROOT / "experiments/default.yaml")
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--base-world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--groups", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("-o", "--output", type=Path,
                        default=ROOT / "results/benchmarks/sp_training_cpu.json")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="bench_sp_training_"))
    load_before = os.getloadavg()
    calibration_path = args.calibration or calibrate(work)
    calibration = Calibration.load(calibration_path)
    cfg = yaml.safe_load(args.config.read_text())
    cfg["data"]["num_samples"] = args.samples
    cfg["train"].update(steps="epoch", warmup_steps=WARMUP, val_every=0)
    config = work / "bench.yaml"
    config.write_text(yaml.safe_dump(cfg))
    runs = {}
    for run in RUNS:
        launch_s = launch(run, config, calibration_path, work)
        steps = per_step(work / run)
        runs[run] = {"processes": RUNS[run][0], "groups": RUNS[run][2] or "one rank each",
                     "launch_wall_s": launch_s, "step_wall_s": stats(steps["wall_s"]),
                     "rank_compute_max_s": stats(steps["compute_max_s"]),
                     "samples": int(steps["samples"].sum()), "tokens": int(steps["tokens"].sum())}
    same = per_step(work / "d1").join(per_step(work / "d2"), rsuffix="_d2")
    mixed = per_step(work / "mixed").join(predicted(work / "mixed", calibration, 4))
    result = {
        **stamp("SP training under torchrun (gloo): degrees 1 and 2 over the same samples; a "
                "4-process plan of degrees 1 and 2 against its prediction", "measured", NOTE,
                torch=torch.__version__),
        "model": cfg["model"]["config"], "policy": POLICY, "samples": args.samples,
        "warmup_steps": WARMUP, "calibration": calibration.label,
        "comm": calibration.extra.get("comm", {}).get("links"),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "runs": runs,
        "d2_over_d1_step_wall": {
            "median_of_steps": float((same["wall_s_d2"] / same["wall_s"]).median()),
            "epoch": float(same["wall_s_d2"].sum() / same["wall_s"].sum()),
        },
        "mixed_vs_prediction": {
            "source_prediction": "model",
            "measured_over_predicted_median_of_steps":
                float((mixed["wall_s"] / mixed["predicted_s"]).median()),
            "measured_epoch_s": float(mixed["wall_s"].sum()),
            "predicted_epoch_s": float(mixed["predicted_s"].sum()),
            "per_step": mixed.reset_index().round(5).to_dict(orient="records"),
        },
    }
    write_json(args.output, result)
    print(yaml.safe_dump({k: result[k] for k in ("d2_over_d1_step_wall", "runs")}))
    return None


if __name__ == "__main__":
    main()
