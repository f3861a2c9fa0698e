"""Benchmark of the batch sampler as a user builds it: `PlanBatchSampler.from_manifest` on a
1,000,000-sample paper-mixed manifest for 64 ranks (validation, bucketing, the plan, its
digests), one rank's epoch of batches (each a PlanBatch with its BatchInfo), and a resume
(state_dict, load_state_dict with its digest check) -> results/benchmarks/sampler.json.

Run: .venv/bin/python tests/bench/bench_sampler.py [--samples N] [--world-size N] [--repeats R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from stamp import stamp

from adaptiveload.costmodel import Calibration
from adaptiveload.data.mixtures import synthesize
from adaptiveload.io import write_json
from adaptiveload.planning.policies import Budgets
from adaptiveload.planning.sampler import PlanBatchSampler, PlanWarning

NOTE = (
    "Shared development machine: 2 CPU cores used by ~6 engineers at once, so timings are "
    "noisy upper bounds; the load average at the start and end of the run is recorded. Single "
    "process; wall clock (perf_counter); best and median of the repeats."
)


def timed(fn: Any, repeats: int) -> tuple[dict[str, float], Any]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return {"best_s": round(min(times), 3), "median_s": round(statistics.median(times), 3)}, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--world-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-o", "--output", type=Path,
                        default=Path("results/benchmarks/sampler.json"))
    args = parser.parse_args()
    import torch

    load_before = os.getloadavg()
    manifest = synthesize("paper-mixed", args.samples, seed=0)
    budgets = Budgets.resolve(calibration=Calibration.load("h200-wan2.1-t2v-1.3b"))

    def build() -> PlanBatchSampler:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PlanWarning)
            return PlanBatchSampler.from_manifest(
                manifest, "adaptiveload-balanced", budgets, args.world_size, 0, seed=0
            )

    build_t, sampler = timed(build, args.repeats)
    epoch_t, batches = timed(lambda: list(sampler), args.repeats)
    state = sampler.state_dict(consumed_steps=len(batches) // 2)
    resume_t, _ = timed(lambda: build().load_state_dict(state), 1)
    write_json(args.output, {
        **stamp("PlanBatchSampler.from_manifest + one epoch", "measured", NOTE,
                torch=torch.__version__),
        "samples": args.samples, "world_size": args.world_size,
        "policy": "adaptiveload-balanced", "budgets_from": "h200-wan2.1-t2v-1.3b",
        "from_manifest": build_t,
        "epoch_one_rank": {**epoch_t, "batches": len(batches)},
        "rebuild_and_load_state_dict_s": resume_t["best_s"],
        "load_average": {"start": [round(x, 2) for x in load_before],
                         "end": [round(x, 2) for x in os.getloadavg()]},
    })
    print(f"{args.output}: from_manifest best {build_t['best_s']} s, one rank's epoch "
          f"({len(batches)} batches) best {epoch_t['best_s']} s")


if __name__ == "__main__":
    main()
