"""Benchmark (measured, CPU, gloo): sequence-parallel training of the tiny Wan 2.1 under
torchrun, wall clock per step -> results/benchmarks/sp_training_cpu.json.

Run: .venv/bin/python tests/bench/bench_sp_training.py [--calibration FILE] [--samples 60]
     [--repeats 3] [-o results/benchmarks/sp_training_cpu.json]

Each run is one torchrun launch of this script's worker (`--worker`: one `Trainer`, the
default experiment's model (wan2.1-tiny) and data mixture on `--samples` samples, one whole
epoch after 2 warm-up steps, no checkpoints, one torch thread per process):

1. `d1` and `d2`, degrees 1 and 2 over the same samples: adaptiveload-packed's plan on ONE
   rank (each step's samples one pack), trained by 1 process (degree 1) and by 2 processes as
   one group of 2 (`training_setup.GroupedSteps`: the same packs in the same steps at
   degree 2).
2. `mixed`, 4 processes on adaptiveload-sp's plan for a pretend device of SP_CAPACITY_GB
   (the calibration's budgets derived again for it, `Calibration.for_tokens`), on which the
   longest clips need two ranks: the planner mixes groups of degree 2 with single ranks. Its
   per-step wall clock against the plan's prediction (`planning.simulate`: each micro-batch at
   its degree through the calibration's cost model with its comm section, the step's slowest
   rank plus the all-reduce).

The three runs are repeated `--repeats` times in turn (d1, d2, mixed, d1, ...), so a load
that drifts on a shared machine falls on all of them alike; each repeat is reported apart.
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

import numpy as np
import pandas as pd
import torch
import yaml
from stamp import stamp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))  # GroupedSteps, as the exactness test

from training_setup import GroupedSteps  # noqa: E402

from adaptiveload import experiment  # noqa: E402
from adaptiveload.costmodel import Calibration, SequenceParallel  # noqa: E402
from adaptiveload.io import read_json, write_json, write_parquet  # noqa: E402
from adaptiveload.planning.simulate import simulate  # noqa: E402
from adaptiveload.step_table import SP_DEGREE, timed  # noqa: E402
from adaptiveload.training.distributed import resolve_ranks  # noqa: E402
from adaptiveload.training.inputs import prepare_data  # noqa: E402
from adaptiveload.training.loop import Trainer  # noqa: E402
from adaptiveload.training.settings import from_experiment  # noqa: E402

TORCHRUN = Path(sys.executable).parent / "torchrun"
WARMUP = 2
# the pretend device of the mixed run: its 3,740-token clips (66 MB at degree 1 by the CPU
# calibration) fit it at degree 2 only; the default experiment's 0.15 GB holds them alone
SP_CAPACITY_GB = 0.06
# run -> (processes, policy, ranks of its plan, the steps' group degrees: empty, the plan's)
RUNS = {"d1": (1, "adaptiveload-packed", 1, ""), "d2": (2, "adaptiveload-packed", 1, "2"),
        "mixed": (4, "adaptiveload-sp", 4, "")}
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
    epoch 0's plan, every process the CPU seconds its training took (all its threads: the
    work, whatever else ran on the machine meanwhile)."""
    exp = experiment.load(args.config)
    ranks = resolve_ranks(None, exp["train"]["world_size"])
    cfg = from_experiment(exp, args.policy, 0, launch_mode="distributed",
                          world_size=ranks.world_size)
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
        cpu0 = time.process_time()
        steps = trainer.run().steps
        cpu_s = time.process_time() - cpu0
    finally:
        trainer.close()
    write_json(args.out / f"cpu_rank{ranks.process_rank}.json",
               {"cpu_s": cpu_s, "steps": int(steps["step"].max()) + 1})
    if ranks.is_main:
        write_parquet(args.out / "steps.parquet", steps)
        write_parquet(args.out / "plan.parquet", data.builder(0).table)


def launch(run: str, config: Path, calibration: Path, out: Path) -> float:
    """One run of RUNS in a fresh torchrun, into folder `out`; its wall clock end to end."""
    procs, policy, base_world, groups = RUNS[run]
    cfg = yaml.safe_load(config.read_text())
    cfg["train"]["world_size"] = procs
    out.mkdir(parents=True)
    path = out / "experiment.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, OMP_NUM_THREADS="1", MLFLOW_ENABLE_TELEMETRY="false")
    t0 = time.perf_counter()
    subprocess.run(
        [TORCHRUN, "--nproc-per-node", str(procs), "--master-addr", "127.0.0.1",
         "--master-port", str(29600 + procs), __file__, "--worker", "--config", str(path),
         "--calibration", str(calibration), "--policy", policy, "--base-world", str(base_world),
         "--groups", groups, "--out", str(out)],
        env=env, check=True, cwd=ROOT,
    )
    return time.perf_counter() - t0


def per_step(out: Path) -> pd.DataFrame:
    """A run's timed steps: the step's wall clock and each rank's compute, one row a step
    (samples and tokens count a group's once, on its first rank's row)."""
    steps = pd.read_parquet(out / "steps.parquet")
    steps = steps[timed(steps["step"], WARMUP)]
    return steps.groupby("step").agg(wall_s=("step_wall_s", "first"),
                                     compute_max_s=("compute_s", "max"),
                                     samples=("samples", "sum"), tokens=("tokens", "sum"),
                                     padding=("padding_samples", "sum"))


def cpu_per_step(out: Path, processes: int) -> list[float]:
    """Each process's CPU seconds per step of its run (warm-up steps included)."""
    parts = [read_json(out / f"cpu_rank{r}.json", "cpu record") for r in range(processes)]
    return [p["cpu_s"] / p["steps"] for p in parts]


def stats(values: pd.Series) -> dict[str, float]:
    return {"median": float(values.median()), "mean": float(values.mean()),
            "sum": float(values.sum()), "steps": int(values.size)}


def predicted(out: Path, calibration: Calibration, world: int) -> tuple[pd.DataFrame, list]:
    """The plan's prediction (model): `simulate` of epoch 0's plan, each micro-batch at its
    degree. Per timed step (epoch 0 replayed from its first step after the warm-up) its step
    time; per rank its compute per step over the whole run (the warm-up's steps included),
    what its CPU seconds per step compare with."""
    plan = pd.read_parquet(out / "plan.parquet")
    plan.attrs["plan"] = {"world_size": world}
    sim = simulate(plan, calibration, world_size=world).steps
    by_step = sim.groupby("step").agg(predicted_s=("step_time_s", "first"),
                                      predicted_compute_max_s=("compute_s", "max"))
    by_step.index = by_step.index + WARMUP
    run = pd.concat([sim[sim["step"] < WARMUP], sim])
    per_rank = run.groupby("rank")["compute_s"].sum() / (sim["step"].nunique() + WARMUP)
    return by_step, per_rank.tolist()


def same_packs_model(out: Path, calibration: Calibration) -> dict[str, float]:
    """The model's seconds per step of the d1/d2 packs (mean over epoch 0's steps): at degree
    1, at degree 2 without the all-to-alls (`CostModel.at_degree`) and with them
    (`SequenceParallel.cost_at`, the calibration's comm section): what the exchanges cost by
    the model beside the compute they split."""
    plan = pd.read_parquet(out / "plan.parquet")
    tokens = plan["tokens"].astype(np.float64)
    cells = plan.assign(sq=tokens**2).groupby("step").agg(
        n=("tokens", "size"), s=("tokens", "sum"), sq=("sq", "sum"))
    cost = calibration.cost
    at = {"degree_1": cost, "degree_2_compute": cost.at_degree(2),
          "degree_2": SequenceParallel.of(calibration).cost_at(cost, 2)}
    out_ = {k: float(np.mean(m.pack_time(cells["n"], cells["s"], cells["sq"])))
            for k, m in at.items()}
    out_["degree_2_all_to_all"] = out_["degree_2"] - out_["degree_2_compute"]
    return out_


def sp_device(calibration: Path, config: Path, work: Path) -> Path:
    """`calibration` with its budgets derived again for the mixed run's pretend device
    (SP_CAPACITY_GB) and the bench's samples."""
    exp = experiment.load(config)
    cal = Calibration.load(calibration)
    cfg = from_experiment(exp, "adaptiveload-packed", 0, launch_mode="emulated", world_size=1)
    tokens = prepare_data(exp, cfg, cal).builder.samples["tokens"].to_numpy()
    path = work / "sp_device.json"
    write_json(path, cal.for_tokens(tokens, capacity_bytes=SP_CAPACITY_GB * 1e9).to_dict())
    return path


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


def one_run(run: str, out: Path) -> dict:
    """What one launch of `run` measured (its folder `out`)."""
    steps = per_step(out)
    plan = pd.read_parquet(out / "plan.parquet")
    cells = plan.groupby(["step", "rank"])
    degrees = (cells[SP_DEGREE].first() if SP_DEGREE in plan
               else pd.Series(1, index=range(cells.ngroups)))
    return {
        "epoch0_micro_batches_by_degree": {
            int(d): int(k) for d, k in degrees.value_counts().sort_index().items()},
        "step_wall_s": stats(steps["wall_s"]),
        "cpu_s_per_step_by_process": cpu_per_step(out, RUNS[run][0]),
        "rank_compute_max_s": stats(steps["compute_max_s"]),
        "real_samples": int((steps["samples"] - steps["padding"]).sum()),
        "planned_samples": int((~plan["is_padding"]).sum()),
        "tokens": int(steps["tokens"].sum()),
    }


def compared(folders: dict[str, Path], device: Calibration) -> dict:
    """One repeat's comparisons: d2's steps over d1's, the mixed run against its prediction."""
    same = per_step(folders["d1"]).join(per_step(folders["d2"]), rsuffix="_d2")
    model, rank_model = predicted(folders["mixed"], device, 4)
    mixed = per_step(folders["mixed"]).join(model)
    return {
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
            "predicted_compute_s_per_step_by_rank": rank_model,
            "per_step": mixed.reset_index().round(5).to_dict(orient="records"),
        },
    }


def bench_config(args: argparse.Namespace, work: Path) -> Path:
    """The default experiment on `--samples` samples, one whole epoch after the warm-up."""
    cfg = yaml.safe_load(args.config.read_text())
    cfg["data"]["num_samples"] = args.samples
    cfg["train"].update(steps="epoch", warmup_steps=WARMUP, val_every=0)
    cfg["policies"] = sorted({policy for _, policy, _, _ in RUNS.values()})
    config = work / "bench.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, default=ROOT / "experiments/default.yaml")
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--policy", default="adaptiveload-packed", help=argparse.SUPPRESS)
    parser.add_argument("--base-world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--groups", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-o", "--output", type=Path,
                        default=ROOT / "results/benchmarks/sp_training_cpu.json")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    work = Path(tempfile.mkdtemp(prefix="bench_sp_training_"))
    load_before = os.getloadavg()
    calibration_path = args.calibration or calibrate(work)
    calibration = Calibration.load(calibration_path)
    config = bench_config(args, work)
    device = sp_device(calibration_path, config, work)
    repeats = []
    for k in range(args.repeats):  # d1, d2, mixed in turn, so drifting load hits them alike
        folders, measured = {}, {}
        for run in RUNS:
            folders[run] = work / f"repeat{k}" / run
            launch_s = launch(run, config, device if run == "mixed" else calibration_path,
                              folders[run])
            measured[run] = {"launch_wall_s": launch_s, **one_run(run, folders[run])}
        repeats.append({"load_average": os.getloadavg(), "runs": measured,
                        **compared(folders, Calibration.load(device))})
    result = {
        **stamp("SP training under torchrun (gloo): degrees 1 and 2 over the same samples; a "
                "4-process plan of degrees 1 and 2 against its prediction", "measured", NOTE,
                torch=torch.__version__),
        "model": yaml.safe_load(config.read_text())["model"]["config"], "samples": args.samples,
        "warmup_steps": WARMUP, "calibration": calibration.label,
        "sp_capacity_gb": SP_CAPACITY_GB, "comm": calibration.extra.get("comm", {}).get("links"),
        "runs": {run: {"processes": procs, "policy": policy}
                 for run, (procs, policy, _, _) in RUNS.items()},
        "same_packs_model_s_per_step": same_packs_model(folders["d1"], calibration),
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "repeats": repeats,
    }
    write_json(args.output, result)
    for k, rep in enumerate(repeats):
        print(k, {run: (round(m["step_wall_s"]["median"], 3), m["cpu_s_per_step_by_process"])
                  for run, m in rep["runs"].items()}, rep["d2_over_d1_step_wall"])
    return None


if __name__ == "__main__":
    main()
