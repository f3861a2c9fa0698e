"""The simulated map of the choices the paper does not publish: a grid of settings, each
planned and simulated for the baseline and AdaptiveLoad.

The paper (arXiv 2605.17923) reports imbalance 39% -> 18.9%, peak VRAM utilization +22.7% and
throughput +27.2%, but not its metric definitions, data mix, p, budgets, reference bucket or how
batches reach ranks. This module plans and simulates a grid of those choices with the
project's own planner and simulator (``build_plan`` + ``simulate`` through a calibration's
cost model, so every number is ``model``); `adaptiveload.analysis.paper_map` then asks which
settings reproduce all four numbers.

Axes of a point (``paper_map`` section of an experiment file):

- ``mixture``: a named mixture or ``mixed-i<I>-l<L>`` (I% images, L% long clips);
- ``reference``: the reference-bucket rule of both policies' budgets (``REFERENCE_RULES``);
- ``m_comp_scale``: AdaptiveLoad's M_comp as a multiple of the derived one;
- ``calibration``: a calibration file, whose cost model times the plans and whose p the
  budgets use (the analytic prior vs measured H200 calibrations);
- ``world_size``: N;
- ``dealing``: how batches reach ranks, the same for both policies: ``open-sora`` (the
  shuffled batch list, slot j -> step j // N, rank j % N), ``sorted`` (the whole epoch sorted
  by the policy's proxy B*S^p and cut into steps: a planner without a calibration) or
  ``balanced`` (sorted by the calibrated step time within windows of 128 steps: the
  ``adaptiveload-balanced`` dealing);
- the imbalance ``definition`` (``metrics.IMBALANCE_DEFINITIONS``) costs nothing: every
  definition reads the same simulated per-rank times.

Budgets are derived per point by the calibration's rules (``costmodel.derive_budgets``) from
the point's own manifest, as ``adaptiveload calibrate`` does for a user's data, so at the
centre point (paper-mixed, heaviest reference) they equal the calibration file's.

Design: the axes one at a time around a centre point, plus a coarse full factorial over the
axes listed under ``factorial`` (the other axes at the centre). A full factorial over all
axes would be ~10^4 settings; the one-at-a-time axes give the tornado (which single choice
moves each number most), the factorial the interactions of the most influential ones.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.costmodel import Calibration, derive_budgets, reference_tokens
from adaptiveload.data.bucketing import Bucketed, bucketize
from adaptiveload.data.mixtures import synthesize
from adaptiveload.errors import UserError
from adaptiveload.planning.dealing import DEFAULT_WINDOW_STEPS
from adaptiveload.planning.plan import build_plan
from adaptiveload.planning.policies import (
    AdaptiveLoad,
    AdaptiveLoadBalanced,
    BalancedDeal,
    Budgets,
    EqualToken,
)
from adaptiveload.planning.simulate import simulate

AXES = ("mixture", "reference", "m_comp_scale", "calibration", "world_size", "dealing")
DEALINGS = ("open-sora", "sorted", "balanced")
MANIFEST_SEED = 0  # as the pipeline's simulations: runs vary by plan seed


class _EqualTokenBalanced(BalancedDeal, EqualToken):
    """The baseline's batches dealt by cost, so that a dealing axis compares like with like
    (not a registered policy: the paper's baseline is cost-blind)."""

    name = "equal-token-balanced"


# (baseline, AdaptiveLoad) policy objects and how build_plan deals them, per dealing
_DEALT = {
    "open-sora": ((EqualToken(), AdaptiveLoad()), False, None),
    "sorted": ((_EqualTokenBalanced(), AdaptiveLoadBalanced()), False, None),
    "balanced": ((_EqualTokenBalanced(), AdaptiveLoadBalanced()), True, DEFAULT_WINDOW_STEPS),
}


@dataclass(frozen=True)
class Point:
    """One setting of the unknowns (the imbalance definition is read off every point)."""

    mixture: str
    reference: str
    m_comp_scale: float
    calibration: str
    world_size: int
    dealing: str


def design(spec: dict[str, Any]) -> dict[Point, list[str]]:
    """Every point of `spec` (a ``paper_map`` config section) and the designs it belongs to:
    ``oat:<axis>`` for the one-at-a-time axes (the centre belongs to all), ``factorial``."""
    centre = Point(**spec["centre"])
    out: dict[Point, list[str]] = {centre: ["centre"]}
    for axis in AXES:
        for value in spec["axes"].get(axis) or [getattr(centre, axis)]:
            out.setdefault(Point(**{**asdict(centre), axis: value}), []).append(f"oat:{axis}")
    grid = {axis: spec.get("factorial", {}).get(axis) or [getattr(centre, axis)] for axis in AXES}
    if spec.get("factorial"):
        for values in itertools.product(*grid.values()):
            out.setdefault(Point(**dict(zip(AXES, values, strict=True))), []).append("factorial")
    for point in out:
        if point.dealing not in DEALINGS:
            raise UserError(f"paper_map: dealing {point.dealing!r}: expected one of "
                            f"{', '.join(DEALINGS)}")
    return out


class _Cache:
    """Bucketed manifests and calibrations, loaded once and shared by the points using them."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples
        self.bucketed: dict[str, Bucketed] = {}
        self.calibrations: dict[str, Calibration] = {}

    def samples(self, mixture: str) -> Bucketed:
        if mixture not in self.bucketed:
            frame = synthesize(mixture, self.num_samples, MANIFEST_SEED)
            self.bucketed[mixture] = bucketize(frame)  # the Wan 2.1 bucketing
        return self.bucketed[mixture]

    def calibration(self, path: str) -> Calibration:
        if path not in self.calibrations:
            cal = Calibration.load(path)
            if not cal.capacity_bytes:
                raise UserError(f"{path}: field 'capacity_bytes' is needed for VRAM utilization")
            self.calibrations[path] = cal
        return self.calibrations[path]


def point_budgets(cal: Calibration, tokens: np.ndarray, reference: str, scale: float) -> dict:
    """The calibration's budget rules applied to a manifest's tokens with reference rule
    `reference`; AdaptiveLoad's M_comp times `scale`."""
    first = derive_budgets(cal.cost, tokens, cal.capacity_bytes, cal.headroom)
    ref = reference_tokens(tokens, first.m_mem, reference)
    d = derive_budgets(cal.cost, tokens, cal.capacity_bytes, cal.headroom, ref_tokens=ref)
    return {"p": d.p, "m_mem": d.m_mem, "m_tok": d.m_tok, "m_comp": d.m_comp * scale,
            "ref_tokens": d.ref_tokens, "ref_batch": d.ref_batch}


def evaluate(point: Point, seeds: list[int], cache: _Cache, allreduce_gbps: float) -> dict:
    """Both policies at `point`, means over `seeds`: every imbalance definition, VRAM
    utilization and samples/s, and the changes of AdaptiveLoad vs the baseline."""
    cal = cache.calibration(point.calibration)
    bucketed = cache.samples(point.mixture)
    tokens = bucketed.samples["tokens"].to_numpy(np.float64)
    b = point_budgets(cal, tokens, point.reference, point.m_comp_scale)
    budgets = Budgets(m_tok=b["m_tok"], m_mem=b["m_mem"], m_comp=b["m_comp"], p=b["p"])
    policies, by_cost, window = _DEALT[point.dealing]
    made = f"measured on {cal.device}" if cal.source == "measured" else cal.device
    row: dict[str, Any] = {**asdict(point), "calibration_label": cal.label,
                           "source": f"model ({Path(point.calibration).stem}: {made})", **b}
    for role, policy in zip(("baseline", "adaptiveload"), policies, strict=True):
        runs = []
        for seed in seeds:
            plan = build_plan(bucketed, policy, budgets, point.world_size, seed,
                              cost_model=cal.cost if by_cost else None, window_steps=window)
            sim = simulate(plan.table, cal, allreduce_gbps=allreduce_gbps,
                           world_size=point.world_size)
            compute = sim.steps["compute_s"].to_numpy().reshape(-1, point.world_size)
            imbalance = {name: fn(compute)
                         for name, (_, fn) in metrics.IMBALANCE_DEFINITIONS.items()}
            runs.append({
                **{f"imbalance_{name}": value for name, value in imbalance.items()},
                "vram_utilization": sim.summary["vram_utilization_mean"],
                "idle_fraction": imbalance["idle"],  # the paper table's own column
                "samples_per_s": sim.summary["samples_per_s"],
                "tokens_per_s": sim.summary["tokens_per_s"],
                "steps": sim.summary["steps"],
            })
        for key, value in pd.DataFrame(runs).mean().items():
            row[f"{role}_{key}"] = float(value)
    row["vram_change"] = row["adaptiveload_vram_utilization"] / row["baseline_vram_utilization"] - 1
    row["throughput_change"] = row["adaptiveload_samples_per_s"] / row["baseline_samples_per_s"] - 1
    row["seeds"] = len(seeds)
    return row


def sweep(spec: dict[str, Any], progress: bool = False) -> pd.DataFrame:
    """Evaluate every point of `spec`; one row per (point, imbalance definition), tidy."""
    points = design(spec)
    cache = _Cache(spec["num_samples"])
    items = points.items()
    if progress:
        from adaptiveload.progress import progress_bar

        items = progress_bar(iterable=items, total=len(points), desc="paper map", unit="point")
    rows = []
    for point, designs in items:
        row = evaluate(point, spec["seeds"], cache, spec["allreduce_gbps"])
        for name, (formula, _) in metrics.IMBALANCE_DEFINITIONS.items():
            rows.append({
                **{k: v for k, v in row.items() if not k.endswith(tuple(
                    f"_imbalance_{d}" for d in metrics.IMBALANCE_DEFINITIONS))},
                "designs": ";".join(designs),
                "definition": name,
                "definition_formula": formula,
                "baseline_imbalance": row[f"baseline_imbalance_{name}"],
                "adaptiveload_imbalance": row[f"adaptiveload_imbalance_{name}"],
            })
    return pd.DataFrame(rows)
