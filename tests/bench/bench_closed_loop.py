"""Benchmark: the closed loop (train.refine) measured on this CPU, open loop against closed.

Run: nice -n 10 .venv/bin/python tests/bench/bench_closed_loop.py [--calibration FILE]
     [--seeds 0 1 2] [--parts a b] [--wrong perturbed|h200]
     [-o results/benchmarks/closed_loop_cpu.json]
(b) alone, on a quiet machine, keeping the file's (a):
     nice -n 10 .venv/bin/python tests/bench/bench_closed_loop.py --parts b

(a) A wrong cost model. The default experiment's data (tiny-cpu, tiny Wan 2.1, 4 emulated
    ranks), fewer samples, two whole epochs: open loop (the wrong model throughout), closed
    loop (train.refine every K steps from it) and the oracle (the CPU calibration itself, open
    loop), timed by each emulated rank's thread CPU time (docs/measurement.md). Two wrong
    models (--wrong):
    - `perturbed` (the default, key a_wrong_model): a stale calibration of this CPU, its fit
      with the simulator's prior error (`planning.closed_loop.perturbed`: p -0.3, c0 x0.5),
      with the CPU calibration's budgets, policy adaptiveload-balanced: the same batches in
      every arm, dealt by a model whose shape is wrong (it misorders batches of many short
      clips against batches of few long ones).
    - `h200` (key a_other_device): the analytic H200 prior of the same model (`adaptiveload
      calibrate prior`: on an H200 the tiny model's step is its fixed cost, so it prices a
      3,740-token clip 4% above a 221-token one, where this CPU takes 30x as long), with the
      same budgets and policy: sort-and-chunk dealing needs only the batches' cost ORDER,
      which a model wrong in scale keeps (the record of that run shows it: open = oracle).
    Beside the measured arms, each (a) records the model's prediction for the same samples
    (`planning.closed_loop.run` with this CPU's calibration as the true device, no noise):
    what a plan from the wrong model loses against the oracle, so a measured gain can be read
    against what there was to gain.
(b) A real straggler. torchrun with 2 processes, each pinned to its own core (taskset), and a
    CPU-bound process this benchmark starts on rank 1's core before the run and stops after
    it: rank 1 runs at about half speed. Open loop (the CPU calibration, which knows nothing
    of the straggler) against closed loop (train.refine every K steps), wall clock (what a
    step costs under torchrun).

Without --calibration the CPU calibration is measured first (`adaptiveload calibrate measure`
on the default experiment). Each run is `adaptiveload train` in a subprocess, untracked, and
is read back from its per-step table; the result file records the host's load before, during
and after.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
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
from stamp import device_name, stamp

from adaptiveload import metrics
from adaptiveload.analysis.stats import paired_effect
from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.mixtures import synthesize
from adaptiveload.io import read_json, write_json
from adaptiveload.planning import closed_loop
from adaptiveload.planning.budgets import Budgets
from adaptiveload.planning.closed_loop import TrueDevice, perturbed
from adaptiveload.planning.plan import build_plan
from adaptiveload.step_table import SP_DEGREE
from adaptiveload.training.inputs import DATA_SEED
from adaptiveload.training.refine import model_error

DEFAULT_POLICY = "adaptiveload-balanced"  # --policy: any policy that plans by cost
# (a): the default mixture, fewer samples (each run is two epochs), windows of K steps
SAMPLES_A, WORLD_A, EPOCHS_A, EVERY_A = 200, 4, 2, 4
# (b): 2 processes, one epoch of the same mixture
SAMPLES_B, WORLD_B, EPOCHS_B, EVERY_B = 160, 2, 2, 3
WARMUP = 2
# the wrong models of (a) and the result key of each (module docstring); every arm runs with
# the CPU calibration's budgets
WRONG = {
    "perturbed": {"key": "a_wrong_model", "p_shift": -0.3, "c0_scale": 0.5},
    "h200": {"key": "a_other_device", "rates": "h200"},
}
TORCHRUN = Path(sys.executable).parent / "torchrun"


def experiment(work: Path, name: str, cal: Calibration, policy: str, samples: int, world: int,
               epochs: int, refine: str | dict) -> Path:
    """The default experiment's data and model, with the CPU calibration's budgets given as
    numbers (so a wrong calibration changes the dealing, not the batches)."""
    exp = {
        "name": name,
        "policies": [policy],
        "data": {"mixture": "tiny-cpu", "num_samples": samples, "bucketing": "aspect",
                 "grid": "tiny"},
        "model": {"config": "wan2.1-tiny", "kernels": ["eager"]},
        "budgets": {"m_tok": float(cal.m_tok), "m_mem": float(cal.m_mem),
                    "m_comp": float(cal.m_comp), "p": float(cal.p)},
        "train": {"world_size": world, "steps": "epoch", "epochs": epochs,
                  "warmup_steps": WARMUP, "refine": refine, "checkpoint_every": 100000},
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(exp))
    return path


def train_command(exp: Path, cal: Path, policy: str, seed: int, out: Path) -> list[str]:
    return ["-m", "adaptiveload", "train", "--config", str(exp), "--policy", policy,
            "--seed", str(seed), "--calibration", str(cal), "--out", str(out), "--no-track"]


def read_run(out: Path, cal: Calibration, first_timed: int | None = None,
             planned: Calibration | None = None) -> dict[str, float]:
    """A run's numbers from its per-step table: over the timed window, and from run step
    `first_timed` on (the closed loop's first refit's next step), imbalance, step time and
    each rank's share of the work (its micro-batches priced by the CPU calibration `cal`:
    the work it was given, whatever its speed); for a run planned from one calibration
    throughout (`planned`), its model error at every step."""
    table = pd.read_parquet(out / "steps.parquet")
    summary = read_json(out / "summary.json")
    timed = table[table["step"] >= WARMUP]
    errors = {}
    if planned is not None:
        errors["model_error_median_by_step"] = [
            round(model_error(planned, rows)[0], 4)
            for _, rows in timed.assign(**{SP_DEGREE: timed.get(SP_DEGREE, 1)}).groupby("step")]
    row = {
        "samples_per_s": summary["samples_per_s"],
        "imbalance_rate": summary["imbalance_rate"],
        "step_time_s": float(timed.groupby("step")["step_time_s"].first().mean()),
        "host_load_mean": summary["host_load_mean"],
        "steps": int(timed["step"].nunique()),
        **errors,
        "imbalance_by_step": [
            round(metrics.imbalance_rate(row[None, :]), 4)
            for row in timed.pivot_table(index="step", columns="rank",
                                         values="compute_s").to_numpy()],
    }
    if "refit" in table.columns:
        ends = table[table["refit"].notna()].groupby("step").first()
        row["refits"] = len(ends)
        row["first_refit_step"] = int(ends.index.min())
        row["window_end_steps"] = [int(v) for v in ends.index]
        row["model_error_median_by_window"] = ends["model_error_median"].round(4).tolist()
        row["model_error_p90_by_window"] = ends["model_error_p90"].round(4).tolist()
        row["window_imbalance"] = ends["window_imbalance"].round(4).tolist()
        speeds = table[table["refit"].notna()].pivot_table(
            index="step", columns="rank", values="speed_factor")
        row["speed_factors_last"] = speeds.iloc[-1].round(3).tolist()
    if first_timed is not None:
        after = timed[timed["step"] >= first_timed]
        compute = after.pivot_table(index="step", columns="rank", values="compute_s")
        row["imbalance_after_first_refit"] = metrics.imbalance_rate(compute.to_numpy())
        row["step_time_after_first_refit_s"] = float(
            after.groupby("step")["step_time_s"].first().mean())
        work = after.assign(work=cal.cost.pack_time(after["samples"], after["tokens"],
                                                    after["tokens_sq"]))
        per_rank = work.groupby("rank")["work"].sum()
        row["work_share_by_rank_after_first_refit"] = (per_rank / per_rank.sum()).round(4).tolist()
    return row


def run(args: list[str], env: dict[str, str]) -> None:
    done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])


def wrong_calibration(work: Path, cal: Calibration, kind: str, env: dict[str, str]) -> Path:
    """The wrong model of (a) (`WRONG[kind]`), written beside the runs."""
    spec, path = WRONG[kind], work / f"wrong-{kind}.json"
    if "rates" in spec:
        run(["-m", "adaptiveload", "calibrate", "prior", "--rates", spec["rates"], "--config",
             "experiments/default.yaml", "-o", str(path)], env)
        return path
    tokens = samples_a()["tokens"].to_numpy(np.float64)
    cost = perturbed(cal.cost, tokens, spec["p_shift"], spec["c0_scale"])
    write_json(path, replace(cal, cost=cost, source="model").for_tokens(tokens).to_dict())
    return path


def samples_a() -> pd.DataFrame:
    """(a)'s samples, bucketed as its experiment's data section has them."""
    return bucketize(synthesize("tiny-cpu", SAMPLES_A, DATA_SEED), mode="aspect",
                     grid="tiny").samples


def predicted(cal: Calibration, wrong: Calibration, policy: str, seeds: list[int]) -> dict:
    """The model's open/oracle epoch time for (a)'s samples and budgets (docstring):
    `closed_loop.run` with this CPU's calibration as the true device, one epoch. (Its closed
    loop is not the trainer's: it derives budgets from each refit, where the trainer keeps
    the run's.)"""
    samples = samples_a()
    same = {k: getattr(cal, k) for k in ("p", "m_mem", "m_comp", "m_tok")}  # (a)'s budgets
    device = TrueDevice(cal.cost, np.ones(WORLD_A), 0.0)
    ratios = []
    for seed in seeds:
        steps = int(build_plan(samples, policy, Budgets(**same), WORLD_A, seed,
                               cost_model=cal).table["step"].max()) + 1
        got = closed_loop.run(samples, cal, replace(wrong, **same), device, policy, WORLD_A,
                              seed, max(2, -(-steps // EVERY_A)))
        ratios.append(got["open_s"] / got["oracle_s"])
    return {"source": "model", "open_over_oracle": ratios}


def part_a(work: Path, cal_path: Path, policy: str, seeds: list[int], env: dict[str, str],
           kind: str) -> dict:
    cal = Calibration.load(cal_path)
    wrong_path = wrong_calibration(work, cal, kind, env)
    wrong = Calibration.load(wrong_path)
    arms = {
        "open": (wrong_path, "off"),
        "closed": (wrong_path, {"every": EVERY_A}),
        "oracle": (cal_path, "off"),
    }
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    for seed in seeds:
        closed_first = None
        for arm in ("closed", "open", "oracle"):  # the closed run first: its refit step
            path, refine = arms[arm]
            exp = experiment(work, f"a-{arm}", cal, policy, SAMPLES_A, WORLD_A, EPOCHS_A,
                             refine)
            out = work / f"a-{arm}-{seed}"
            run(train_command(exp, path, policy, seed, out), env)
            planned = None if arm == "closed" else Calibration.load(path)
            row = read_run(out, cal, closed_first, planned)
            if arm == "closed":
                closed_first = row["first_refit_step"] + 1
                row = read_run(out, cal, closed_first)
            runs[arm].append({"seed": seed, **row})
            print(f"(a) seed {seed} {arm}: {row}", flush=True)
            shutil.rmtree(out)
    return {
        "device": device_name(),  # per part: a part run alone keeps the file's others
        "date": time.strftime("%Y-%m-%dT%H:%M UTC", time.gmtime()),
        "setup": {"mixture": "tiny-cpu", "num_samples": SAMPLES_A, "model": "wan2.1-tiny",
                  "world_size": WORLD_A, "launch": "emulated", "epochs": EPOCHS_A,
                  "warmup_steps": WARMUP, "policy": policy, "refine_every": EVERY_A,
                  "timer": "thread CPU time per emulated rank",
                  "wrong_model": {"kind": kind, "device": wrong.device, "source": wrong.source,
                                  "cost": vars(wrong.cost), "budgets": "cpu",
                                  **{k: WRONG[kind][k] for k in ("p_shift", "c0_scale")
                                     if k in WRONG[kind]},
                                  "effective_exponent_221_3740": [
                                      cal.cost.effective_exponent(221, 3740),
                                      wrong.cost.effective_exponent(221, 3740)]},
                  "cpu_calibration": {"cost": vars(cal.cost), "p": cal.p}},
        "runs": runs,
        "effects": effects(runs, "samples_per_s", "imbalance_after_first_refit"),
        "model": predicted(cal, wrong, policy, seeds),
    }


def burner(core: int) -> subprocess.Popen:
    """A CPU-bound process on `core` (its own session: stopped with its group)."""
    return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c",
                             "while True: pass"], start_new_session=True)


def part_b(work: Path, cal_path: Path, policy: str, seeds: list[int], env: dict[str, str]
           ) -> dict:
    cal = Calibration.load(cal_path)
    # each process on its own core: LOCAL_RANK's
    pin = work / "pinned.sh"
    pin.write_text(f'#!/bin/sh\nexec taskset -c "$LOCAL_RANK" {sys.executable} "$@"\n')
    pin.chmod(0o755)
    runs: dict[str, list[dict]] = {"open": [], "closed": []}
    for seed in seeds:
        closed_first = None
        for arm, refine in (("closed", {"every": EVERY_B}), ("open", "off")):
            exp = experiment(work, f"b-{arm}", cal, policy, SAMPLES_B, WORLD_B, EPOCHS_B, refine)
            out = work / f"b-{arm}-{seed}"
            slow = burner(1)
            try:
                done = subprocess.run(
                    [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                     "--master-port", str(29500 + seed), "--no-python", str(pin),
                     *train_command(exp, cal_path, policy, seed, out)],
                    env=env, capture_output=True, text=True)
            finally:
                os.killpg(slow.pid, signal.SIGTERM)
                slow.wait()
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            row = read_run(out, cal, closed_first)
            if arm == "closed":
                closed_first = row["first_refit_step"] + 1
                row = read_run(out, cal, closed_first)
            runs[arm].append({"seed": seed, **row})
            print(f"(b) seed {seed} {arm}: {row}", flush=True)
            shutil.rmtree(out)
    return {
        "device": device_name(),  # per part: a part run alone keeps the file's others
        "date": time.strftime("%Y-%m-%dT%H:%M UTC", time.gmtime()),
        "setup": {"mixture": "tiny-cpu", "num_samples": SAMPLES_B, "model": "wan2.1-tiny",
                  "world_size": WORLD_B, "launch": "torchrun, gloo, one core per process",
                  "straggler": "a CPU-bound process on rank 1's core during each run",
                  "epochs": EPOCHS_B, "warmup_steps": WARMUP, "policy": policy,
                  "refine_every": EVERY_B, "timer": "wall clock (the slowest process's step)",
                  "prior": "the CPU calibration (no rank speeds)"},
        "runs": runs,
        "effects": effects(runs, "step_time_s", "step_time_after_first_refit_s"),
    }


def effects(runs: dict[str, list[dict]], *keys: str) -> dict:
    """Closed over open (and over the oracle where there is one), paired by seed: the ratio's
    geometric mean and its 95% t interval (log scale), measured."""
    out = {}
    for key in keys:
        for base in ("open", "oracle"):
            if base not in runs:
                continue
            e = paired_effect(np.array([r[key] for r in runs["closed"]]),
                              np.array([r[key] for r in runs[base]]), ratio=True)
            out[f"{key}: closed / {base}"] = {"ratio": e.estimate, "ci95": [e.ci_low, e.ci_high],
                                              "n": e.n}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calibration", default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parts", nargs="+", default=["a", "b"], choices=["a", "b"])
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument("--wrong", default="perturbed", choices=sorted(WRONG))
    parser.add_argument("-o", "--out", default="results/benchmarks/closed_loop_cpu.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_closed_loop_"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cal = Path(args.calibration) if args.calibration else work / "calibration.json"
    if args.calibration is None:
        run(["-m", "adaptiveload", "calibrate", "measure", "--config",
             "experiments/default.yaml", "-o", str(cal), "--quiet"], env)
    result = stamp(
        "closed_loop_cpu", "measured",
        "train.refine measured on this CPU: (a) a wrong cost model, open vs closed loop vs "
        "the CPU-calibrated oracle, thread CPU time of emulated ranks; (b) torchrun with a "
        "straggler the benchmark starts on one process's core, wall clock. A loaded machine "
        "moves every time: load averages recorded.",
        torch=torch.__version__,
    )
    out = Path(args.out)
    if out.exists():  # a part not run now keeps its last result (b alone keeps the file's a)
        kept = read_json(out)
        result.update({k: kept[k] for k in ("a_wrong_model", "a_other_device",
                                            "load_average_after_a", "b_straggler") if k in kept})
    result["load_average_before"] = list(os.getloadavg())
    t0 = time.perf_counter()
    if "a" in args.parts:
        spec = WRONG[args.wrong]
        result[spec["key"]] = part_a(work, cal, args.policy, args.seeds, env, args.wrong)
        result["load_average_after_a"] = list(os.getloadavg())
        write_json(Path(args.out), result)  # (a) kept if (b) fails
    if "b" in args.parts:
        result["b_straggler"] = part_b(work, cal, args.policy, args.seeds, env)
    result["load_average_after"] = list(os.getloadavg())
    result["elapsed_s"] = time.perf_counter() - t0
    write_json(Path(args.out), result)
    shutil.rmtree(work)
    print(f"wrote {args.out} in {result['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
