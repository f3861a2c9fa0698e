"""What a training experiment costs in GPU-hours on one GPU, from measured step times.

    python experiments/gpu/gpu_hours.py experiments/paper.yaml

The arithmetic (labelled `model`: measured step times, planned shapes):

- `t1(S)`: the measured time of one training step (forward, backward, optimizer) of ONE
  sample of S tokens, read from the B = 1 points of a measured calibration file, linear
  between them; above the largest measured S it follows the parabola through the last three
  points (attention makes the time grow ~S^2 there).
- A micro-batch costs `c + sum_i (t1(S_i) - c)` over its samples (B samples of S tokens:
  `c + B * (t1(S) - c)`, linear in B; a pack of several lengths sums its samples), with `c`
  the per-step part that does not grow with B, measured as `2 t1(S) - t2(S)` over the
  calibration's B = 2 points at S >= 7,200 tokens (below that the GPU is not saturated and a
  batch costs less than this; the estimate is an upper bound there).
- One step of N ranks emulated on one GPU runs the N ranks' micro-batches in turn, so it costs
  the sum over them; the planner gives those micro-batches (the experiment's mixture, policies
  and seeds, budgets from the same calibration). A run of `steps` steps repeats the mean step.
- Calibration: every (B, S) point of the experiment's grid within M_mem, a probe step, a
  warm-up step and `repeats` timed steps each.

Not counted: model start-up (~10 s a run), CPU-side synthetic-latent generation, checkpoint
writes, the kernel benchmark (minutes). The fused kernel is counted at the eager time.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[2]  # experiments/gpu/ of the checkout
# one H200, Wan 2.1 T2V-1.3B, bf16 autocast, per-block activation checkpointing (measured)
H200_CALIBRATION = REPO / "results/reference/h200/2026-11-30/grid7/calibration-grid7-run3.json"
# the batch-independent part is measured where the GPU is saturated (see the module docstring)
SATURATED_TOKENS = 7200


@dataclass(frozen=True)
class StepTimes:
    """Measured B = 1 step times t1(S) and the batch-independent part c, in seconds."""

    tokens: tuple[float, ...]
    seconds: tuple[float, ...]
    fixed_s: float
    source: str

    @classmethod
    def from_calibration(cls, path: Path) -> StepTimes:
        cal = json.loads(Path(path).read_text())
        points = [p for p in cal["points"] if p.get("status") == "ok"]
        one = sorted((p["tokens"], p["time_s"]) for p in points if p["batch"] == 1)
        two = {p["tokens"]: p["time_s"] for p in points if p["batch"] == 2}
        fixed = [2 * t - two[s] for s, t in one if s >= SATURATED_TOKENS and s in two]
        if len(one) < 3 or not fixed:
            raise ValueError(f"{path}: needs >= 3 B=1 points and a B=2 point at S >= "
                             f"{SATURATED_TOKENS}")
        source = f"measured ({cal['device']}), {Path(path).name}"
        return cls(tuple(float(s) for s, _ in one), tuple(float(t) for _, t in one),
                   max(0.0, float(np.mean(fixed))), source)

    def t1(self, tokens: np.ndarray | float) -> np.ndarray:
        """Seconds of a B = 1 step at `tokens` (extrapolated quadratically past the last point)."""
        s = np.asarray(tokens, dtype=float)
        inside = np.interp(s, self.tokens, self.seconds)
        quad = np.polyfit(self.tokens[-3:], self.seconds[-3:], 2)
        return np.where(s > self.tokens[-1], np.polyval(quad, s), inside)

    def micro_batch(self, batch: np.ndarray | int, tokens: np.ndarray | float) -> np.ndarray:
        """Seconds of one micro-batch of `batch` samples of `tokens` tokens each."""
        t1 = self.t1(tokens)
        return self.fixed_s + np.asarray(batch) * (t1 - self.fixed_s)


def mean_step_seconds(plan: pd.DataFrame, times: StepTimes) -> float:
    """Mean emulated step time of a plan table: every rank's micro-batches run in turn."""
    real = plan[~plan["is_padding"]]
    micro_batches = real.groupby(["step", "rank", "batch_id"]).ngroups
    per_sample = times.t1(real["tokens"].to_numpy()) - times.fixed_s
    return float((micro_batches * times.fixed_s + per_sample.sum()) / real["step"].nunique())


def experiment_cost(path: Path, calibration: Path = H200_CALIBRATION) -> dict:
    """GPU-hours of the experiment's training and calibration on one GPU (`model`)."""
    from adaptiveload.costmodel import Calibration
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.mixtures import synthesize
    from adaptiveload.experiment import load_layered
    from adaptiveload.planning.plan import build_plan
    from adaptiveload.planning.policies import Budgets
    from adaptiveload.step_table import run_steps

    cfg = load_layered(path)
    times = StepTimes.from_calibration(calibration)
    cal = Calibration.load(calibration)
    data, train = cfg["data"], cfg["train"]
    bucketed = bucketize(synthesize(data["mixture"], data["num_samples"], 0),
                         mode=data["bucketing"], grid=data["grid"],
                         max_frames=data["max_frames"])
    budgets = Budgets.resolve(*(str(cfg["budgets"][k]) for k in ("m_tok", "m_mem", "m_comp", "p")),
                              calibration=cal)
    runs = []
    for policy in cfg["policies"]:
        for seed in cfg["seeds"]:
            plan = build_plan(bucketed, policy, budgets, train["world_size"], seed,
                              cost_model=cal).table
            step_s = mean_step_seconds(plan, times)
            steps = run_steps(train["steps"], train["warmup_steps"],
                              int(plan["step"].max()) + 1)
            runs += [{"policy": policy, "seed": seed, "kernel": k, "step_s": step_s,
                      "steps": steps, "hours": step_s * steps / 3600}
                     for k in cfg["model"]["kernels"]]
    c = cfg["calibration"]
    per_point = 2 + c["repeats"]  # a probe step, a warm-up step, the timed steps
    cal_s = sum(per_point * float(times.micro_batch(b, s))
                for b in c["batch_sizes"] for s in c["tokens"]
                if b * s <= cal.m_mem)
    train_h = sum(r["hours"] for r in runs)
    return {
        "experiment": cfg["name"], "source": f"model from {times.source}",
        "runs": runs, "train_gpu_hours": train_h, "calibration_gpu_hours": cal_s / 3600,
        "gpu_hours": train_h + cal_s / 3600,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", type=Path)
    parser.add_argument("--calibration", type=Path, default=H200_CALIBRATION)
    parser.add_argument("--json", action="store_true", help="print the whole estimate as JSON")
    args = parser.parse_args(argv)
    if not args.calibration.is_file():  # the default is a measured file of the checkout
        print(f"{args.calibration}: calibration file not found; pass --calibration FILE "
              "(a measured calibration JSON)", file=sys.stderr)
        return 2
    cost = experiment_cost(args.experiment, args.calibration)
    if args.json:
        json.dump(cost, sys.stdout, indent=1)
        return 0
    for r in cost["runs"]:
        print(f"{r['policy']:>22} seed {r['seed']} {r['kernel']:>5}: {r['steps']} steps x "
              f"{r['step_s']:.0f} s = {r['hours']:.2f} GPU-h")
    print(f"{cost['experiment']}: {cost['gpu_hours']:.2f} GPU-hours on one GPU "
          f"(training {cost['train_gpu_hours']:.2f}, calibration "
          f"{cost['calibration_gpu_hours']:.2f}; {cost['source']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
