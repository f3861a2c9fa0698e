"""Benchmark: every policy against the epoch lower bound, at free and matched step counts, on
paper-mixed, long-clips and the planners' stress mixtures (plan quality, `model`).

20,000 samples of each mixture (manifest seed 0; `robotics` on the wan-long grid up to 161
frames, the others on the wan grid up to 81), planned with seeds 0, 1, 2 at N = 16, 64, 256,
1,024 through the measured H200 calibration of Wan 2.1 T2V-1.3B (shipped), each policy at
`steps_per_epoch` free (its own step count) and match (equal-token's). Per plan: steps, the
steps asked for (`steps_asked`) and whether the plan's warnings say so where they differ,
K_min (`min_steps_per_epoch`), `vs_epoch_lower_bound`, `vs_lower_bound`, imbalance, samples/s,
padding rows, micro-batches over a limit, `composition_digest`. Per (mixture, N): how many
distinct pack compositions the packed policy's three seeds give. No step is run.

Run: .venv/bin/python tests/bench/bench_epoch_bound.py [-o results/benchmarks/epoch_bound.json]
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np
from stamp import stamp

from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.mixtures import synthesize
from adaptiveload.io import write_json
from adaptiveload.planning.plan import STEP_MODES, build_plan, plan_warnings
from adaptiveload.planning.policies import POLICIES, Budgets

CALIBRATION = "h200-wan2.1-t2v-1.3b-measured"
# mixture: (grid, max_frames) it is bucketed with; reference-heavy and robotics are the
# planners' stress mixtures (adaptiveload.data.mixtures)
MIXTURES = {
    "paper-mixed": ("wan", 81),
    "long-clips": ("wan", 81),
    "reference-heavy": ("wan", 81),
    "robotics": ("wan-long", 161),
}
WORLD_SIZES = (16, 64, 256, 1024)
SEEDS = (0, 1, 2)
SAMPLES = 20_000
PACKED, BALANCED = "adaptiveload-packed", "adaptiveload-balanced"
KEYS = (
    "steps",
    "steps_asked",
    "min_steps_per_epoch",
    "predicted_vs_epoch_lower_bound",
    "predicted_vs_lower_bound",
    "predicted_imbalance_rate",
    "predicted_samples_per_s",
    "num_padding",
    "constraint_violations",
    "composition_digest",
)
IMBALANCE_MAX = {16: 0.005, 256: 0.01, 1024: 0.02}
# where imbalance is a target: on the stress mixtures a step that must hold the costliest
# samples (one 720p x 161-frame clip is a pack of its own) idles its other ranks whatever the
# plan, and the epoch bound, which counts that, is the measure
IMBALANCE_MIXTURES = ("paper-mixed", "long-clips")
NOTE = (
    "Plan quality is `model`: predictions of the measured H200 calibration of Wan 2.1 T2V-1.3B "
    "(shipped h200-wan2.1-t2v-1.3b-measured) for plans of each mixture; no step was run. "
    "samples/s counts what the ranks process (padding repeats included) as the simulator "
    "does at this commit. The epoch bound is taken under the packed policy's limits for every "
    "policy (docs/definitions.md), so the ratios of one (mixture, N) compare directly."
)


def run_point(bucketed, n: int, cal: Calibration, budgets: Budgets) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in STEP_MODES:
        for policy in POLICIES:
            rows = []
            for seed in SEEDS:
                plan = build_plan(
                    bucketed, policy, budgets, n, seed, cost_model=cal, steps_per_epoch=mode
                )
                row = {k.removeprefix("predicted_"): plan.summary[k] for k in KEYS}
                row["warned_steps"] = any(
                    "steps_per_epoch" in w for w in plan_warnings(plan.summary)
                )
                rows.append(row)
            numeric = [k for k, v in rows[0].items() if isinstance(v, (int, float))]
            mean = {k: float(np.mean([r[k] for r in rows])) for k in numeric}
            out[f"{mode}/{policy}"] = {**mean, "per_seed": rows}
    out["packed_distinct_compositions_of_3_seeds"] = len(
        {r["composition_digest"] for r in out[f"free/{PACKED}"]["per_seed"]}
    )
    return out


def targets(points: dict[str, dict[str, Any]]) -> dict[str, bool]:
    t = {}
    for key, point in points.items():
        n = int(key.split("/N=")[1])
        free, match = point[f"free/{PACKED}"], point[f"match/{PACKED}"]
        t[f"{key}: packed free steps <= 1.02 K_min"] = all(
            r["steps"] <= 1.02 * r["min_steps_per_epoch"] for r in free["per_seed"]
        )
        limit = 1.01 if n <= 256 else 1.02
        t[f"{key}: packed free vs_epoch_lower_bound <= {limit}"] = all(
            r["vs_epoch_lower_bound"] <= limit for r in free["per_seed"]
        )
        if n in IMBALANCE_MAX and key.split("/")[0] in IMBALANCE_MIXTURES:
            t[f"{key}: packed imbalance <= {IMBALANCE_MAX[n]}"] = (
                free["imbalance_rate"] <= IMBALANCE_MAX[n]
            )
        t[f"{key}: no micro-batch over a limit"] = all(
            point[k]["constraint_violations"] == 0 for k in point if "/" in k
        )
        for mode in STEP_MODES:
            t[f"{key}: packed samples/s >= balanced ({mode})"] = (
                point[f"{mode}/{PACKED}"]["samples_per_s"]
                >= point[f"{mode}/{BALANCED}"]["samples_per_s"]
            )
        t[f"{key}: packed matched steps == equal-token's"] = (
            match["steps"] == point["free/equal-token"]["steps"]
        )
        t[f"{key}: every matched plan reaches its steps or says so"] = all(
            r["steps"] == r["steps_asked"] or r["warned_steps"]
            for k in point if k.startswith("match/") for r in point[k]["per_seed"]
        )
        t[f"{key}: >= 2 of 3 seeds differ in pack composition"] = (
            point["packed_distinct_compositions_of_3_seeds"] >= 2
        )
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-o", "--out", default="results/benchmarks/epoch_bound.json")
    args = parser.parse_args()
    cal = Calibration.load(CALIBRATION)
    budgets = Budgets.resolve(calibration=cal)
    load_before = os.getloadavg()
    points = {}
    for mixture, (grid, max_frames) in MIXTURES.items():
        bucketed = bucketize(synthesize(mixture, SAMPLES, seed=0), grid=grid,
                             max_frames=max_frames)
        for n in WORLD_SIZES:
            points[f"{mixture}/N={n}"] = run_point(bucketed, n, cal, budgets)
            print(
                mixture,
                n,
                {
                    k: round(v["steps"], 1)
                    for k, v in points[f"{mixture}/N={n}"].items()
                    if isinstance(v, dict)
                },
                flush=True,
            )
    out = stamp(
        "epoch lower bound and matched steps: every policy, paper-mixed, long-clips and the "
        "stress mixtures",
        "model",
        NOTE,
    )
    out.update(
        calibration=CALIBRATION,
        calibration_label=cal.label,
        samples=SAMPLES,
        manifest_seed=0,
        plan_seeds=list(SEEDS),
        mixtures={m: {"grid": g, "max_frames": f} for m, (g, f) in MIXTURES.items()},
        budgets=budgets.as_dict(),
        load_average_before=load_before,
        load_average_after=os.getloadavg(),
        points=points,
    )
    out["targets"] = targets(points)
    write_json(args.out, out)
    failed = [k for k, ok in out["targets"].items() if not ok]
    print("targets missed:", failed or "none")


if __name__ == "__main__":
    main()
