"""Per-micro-batch validation (`--validate K`): time micro-batches drawn from the policies'
plans and compare them with the cost model's prediction (docs/calibration.md)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from adaptiveload.calibration.mix import TokenMix
from adaptiveload.calibration.settings import Grid, PlanValidation
from adaptiveload.calibration.timing import measure_grid
from adaptiveload.costmodel import Calibration
from adaptiveload.model.wan import WanModel


def draw_micro_batches(
    cal: Calibration, mix: TokenMix, k: int, world_size: int, max_seconds: float | None,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], int, int]:
    """`k` micro-batches (policy, B, S) drawn from one epoch's plan of every homogeneous policy.

    Each policy is planned with the calibration's own budgets on the mix's samples at
    `world_size` ranks (what the simulations run); its real (non-padding) micro-batches are
    the population, and k is split evenly over the policies (seeded). Micro-batches predicted
    above `max_seconds` are left out of the population; their number is returned, and the
    number of micro-batches in all plans.
    """
    from adaptiveload.planning.plan import build_plan
    from adaptiveload.planning.policies import POLICIES, Budgets

    budgets = Budgets.resolve(calibration=cal)
    rng = np.random.default_rng(seed)
    drawn, too_slow, population = [], 0, 0
    # the grid times micro-batches of one shape; packs (several shapes) are left out, and so
    # are the field's methods (`peer`): what the project's policies plan is what is checked
    names = [name for name, cls in POLICIES.items() if not (cls.packed or cls.peer)]
    for i, name in enumerate(names):
        table = build_plan(mix.samples, name, budgets, world_size, seed, cost_model=cal).table
        real = table[~table["is_padding"]]
        batches = real.groupby("batch_id").agg(
            batch=("sample_id", "size"), tokens=("tokens", "first")
        )
        pred = cal.cost.step_time(batches["batch"], batches["tokens"])
        population += len(batches)
        if max_seconds is not None:
            too_slow += int((pred > max_seconds).sum())
            batches = batches[pred <= max_seconds]
        share = k // len(names) + (i < k % len(names))
        if batches.empty or share == 0:
            continue
        pick = rng.choice(len(batches), size=share, replace=len(batches) < share)
        for j in sorted(pick):
            row = batches.iloc[j]
            drawn.append({"policy": name, "batch": int(row["batch"]), "tokens": int(row["tokens"])})
    return drawn, too_slow, population


def validate_plans(
    model: WanModel, cal: Calibration, mix: TokenMix, device: torch.device,
    validation: PlanValidation, grid: Grid, seed: int, timer: str, progress: bool,
) -> dict[str, Any]:
    """Time `validation.micro_batches` planned micro-batches (`draw_micro_batches`) like grid
    points; compare.

    The error of each is |predicted - measured| / measured, measured as a grid point is (the
    minimum over the grid's `repeats` passes, after one untimed step of the shape), so that
    the validation checks the cost model on the shapes the planner really makes, not on the
    grid it was fitted to.
    """
    k, world_size, max_seconds = (validation.micro_batches, validation.world_size,
                                  validation.max_seconds)
    drawn, too_slow, population = draw_micro_batches(cal, mix, k, world_size, max_seconds, seed)
    shapes = sorted({(d["batch"], d["tokens"]) for d in drawn}, key=lambda bs: bs[0] * bs[1])
    # the model is warm from the grid: a new shape's untimed probe step is its warm-up (the
    # grid's packs were timed with it)
    passes = replace(grid, warmup=0, packs=())
    points, _ = measure_grid(model, shapes, device, passes, seed, progress=progress, timer=timer)
    measured = {(p["batch"], p["tokens"]): p for p in points}
    rows = []
    for d in drawn:
        point = measured[d["batch"], d["tokens"]]
        pred = float(cal.cost.step_time(d["batch"], d["tokens"]))
        meas = point["time_s"]
        rows.append({
            **d, "predicted_s": pred, "measured_s": meas, "spread": point["spread"],
            "status": point["status"],
            "rel_err": abs(pred - meas) / meas if meas else None,
        })
    errors = np.array([r["rel_err"] for r in rows if r["rel_err"] is not None])
    return {
        "k": k,
        "world_size": world_size,
        "manifest": mix.origin,
        "max_seconds": max_seconds,
        "planned_micro_batches": population,
        "excluded_over_max_seconds": too_slow,
        "num_measured": int(errors.size),
        "median_rel_err": float(np.median(errors)) if errors.size else None,
        "p95_rel_err": float(np.percentile(errors, 95)) if errors.size else None,
        "micro_batches": rows,
    }
