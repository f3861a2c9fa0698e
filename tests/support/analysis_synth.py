"""Synthetic run files in the trainer/simulator schema (the product's own: `STEP_COLUMNS`,
`SUMMARY_KEYS`), with effects planted on purpose.

Used by the analysis tests: a policy whose ranks are better balanced (smaller spread of
per-rank compute) and faster per step by a known factor, or identical to the baseline.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
from repo_paths import H200_PRIOR

from adaptiveload.analysis.aggregate import SUMMARY_KEYS
from adaptiveload.metrics import summarize
from adaptiveload.step_table import STEP_COLUMNS

# the centre of a paper map small enough to sweep in a test (4 ranks), on the shipped H200 prior
MAP_CENTRE = {"mixture": "paper-mixed", "reference": "heaviest", "m_comp_scale": 1.0,
              "calibration": str(H200_PRIOR), "world_size": 4,
              "dealing": "open-sora"}

def write_run(
    root: Path,
    policy: str,
    seed: int,
    *,
    setup: str = "train",
    variant: str = "base",
    speedup: float = 1.0,
    spread: float = 0.4,
    steps: int = 40,
    ranks: int = 4,
    warmup: int = 2,
    source: str = "measured",
    device: str = "cpu",
    kernel: str = "eager",
    calibration: str | None = None,
    samples_range: tuple[int, int] = (2, 6),
    timed_window: str = "steps",
    load: float | None = None,
) -> dict:
    """One run: per-rank compute ~ base * U(1 - spread, 1); step time = max over ranks;
    samples per rank-step drawn from [samples_range) whatever the compute; `load`: the host
    load it recorded (none: a run from before loads were recorded)."""
    rng = np.random.default_rng(zlib.crc32(f"{policy}|{seed}|{setup}|{variant}".encode()))
    base = rng.uniform(0.8, 1.2, size=(steps, 1)) / speedup
    compute = base * rng.uniform(1 - spread, 1.0, size=(steps, ranks))
    samples = rng.integers(*samples_range, size=(steps, ranks))
    tokens = samples * 256
    step_time = compute.max(axis=1) + 0.01
    wall = rng.uniform(1.0, 1.1, size=steps)  # a wall clock, a little slower
    rows = [
        dict(step=s, rank=r, compute_s=compute[s, r], compute_wall_s=compute[s, r] * wall[s],
             wait_s=step_time[s] - compute[s, r], samples=int(samples[s, r]),
             tokens=int(tokens[s, r]), frames=5, height=64, width=64, peak_bytes=None,
             peak_bytes_model=1e8 * samples[s, r], loss=0.5, step_time_s=step_time[s],
             step_wall_s=step_time[s] * wall[s], padding_samples=0, padding_tokens=0,
             host_load_1m=load)
        for s in range(steps) for r in range(ranks)
    ]
    out = root / setup.replace("/", "_") / variant / policy / f"seed{seed}"
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows, columns=list(STEP_COLUMNS)).to_parquet(out / "steps.parquet")
    timed = slice(warmup, steps)
    metrics = summarize(compute[timed], samples[timed].sum(), tokens[timed].sum(),
                        step_time[timed].sum())
    summary = dict(experiment="synthetic", policy=policy, seed=seed, kernel=kernel,
                   launch_mode="emulated", world_size=ranks, device=device, source=source,
                   warmup_steps=warmup, capacity_bytes=4e9, calibration=calibration,
                   timed_window=timed_window,
                   samples_per_s_wall=samples[timed].sum() / (step_time * wall)[timed].sum(),
                   **({"host_load_mean": load} if load is not None else {}),
                   **metrics.as_dict())
    assert set(SUMMARY_KEYS) <= set(summary)  # what the analysis requires of every summary
    (out / "summary.json").write_text(json.dumps(summary))
    return dict(setup=setup, variant=variant, summary=str(out / "summary.json"),
                steps=str(out / "steps.parquet"))


def planted_runs(root: Path, planted: bool, seeds=(0, 1, 2)) -> list[dict]:
    """Baseline vs `adaptiveload`: with `planted`, the policy is 1.3x faster and balanced."""
    index = []
    for seed in seeds:
        index.append(write_run(root, "equal-token", seed))
        if planted:
            index.append(write_run(root, "adaptiveload", seed, speedup=1.3, spread=0.1))
        else:
            index.append(write_run(root, "adaptiveload", seed))
    return index
