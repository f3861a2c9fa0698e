"""Print, as JSON, the plan digests of plans whose choices hang on equal values and on
powers of non-integer exponents: the packed policy on reference-heavy (a third of the samples
share one token count: LPT meets equal loads), the fixed SP degree on long clips through the
14B's prior (p = 1.9), balanced dealing beside them. A test runs it in processes that differ
in hash seed and in the CPU features numpy may use (NPY_DISABLE_CPU_FEATURES): every rank
plans alone, so each must print the same."""

from __future__ import annotations

import json

from adaptiveload.costmodel import Calibration
from adaptiveload.data.bucketing import bucketize
from adaptiveload.data.mixtures import synthesize
from adaptiveload.planning.plan import build_plan
from adaptiveload.planning.policies import Budgets

CASES = (
    # (mixture, grid, max_frames, calibration, policy, world size)
    ("reference-heavy", "wan", 81, "h200-wan2.1-t2v-1.3b-measured", "adaptiveload-packed", 16),
    ("reference-heavy", "wan", 81, "h200-wan2.1-t2v-1.3b-measured", "adaptiveload-balanced", 16),
    ("long-clips-121", "wan-long", 121, "h200-wan2.1-t2v-14b", "adaptiveload-sp-fixed", 64),
    ("long-clips-121", "wan-long", 121, "h200-wan2.1-t2v-14b", "adaptiveload-sp", 64),
)


def main() -> None:
    out = {}
    for mixture, grid, frames, name, policy, n in CASES:
        samples = bucketize(synthesize(mixture, 3000, seed=0), grid=grid, max_frames=frames)
        cal = Calibration.load(name)
        plan = build_plan(samples, policy, Budgets.resolve(calibration=cal), n, seed=0,
                          cost_model=cal)
        out[f"{mixture}/{policy}/{n}"] = plan.summary["plan_digest"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
