"""Where the paper's numbers lie among the choices it does not publish: a simulated map.

The paper (arXiv 2605.17923) reports imbalance 39% -> 18.9%, peak VRAM utilization +22.7% and
throughput +27.2%, but not its metric definitions, data mix, p, budgets, reference bucket or how
batches reach ranks. This module plans and simulates a grid of those choices with the
project's own planner and simulator (``build_plan`` + ``simulate`` through a calibration's
cost model, so every number is ``model``) and asks which settings reproduce all four numbers.

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
from adaptiveload.planning.policies import AdaptiveLoad, AdaptiveLoadBalanced, Budgets, EqualToken
from adaptiveload.planning.simulate import simulate

# the paper's four numbers (abstract): baseline and AdaptiveLoad imbalance, relative changes
PAPER = {"baseline_imbalance": 0.39, "adaptiveload_imbalance": 0.189,
         "vram_change": 0.227, "throughput_change": 0.272}  # fmt: skip
NUMBERS = {
    "baseline_imbalance": "baseline imbalance (%)",
    "adaptiveload_imbalance": "AdaptiveLoad imbalance (%)",
    "vram_change": "Δ VRAM utilization (relative, %)",
    "throughput_change": "Δ throughput (relative, %)",
}
AXES = ("mixture", "reference", "m_comp_scale", "calibration", "world_size", "dealing")
DEALINGS = ("open-sora", "sorted", "balanced")
DEFINITIONS = tuple(metrics.IMBALANCE_DEFINITIONS)
SETTINGS = (*AXES, "definition")  # what identifies one row of the map
CENTRE_DEFINITION = "range"  # the project's primary imbalance rate, (max - min) / max
MANIFEST_SEED = 0  # as the pipeline's simulations: runs vary by plan seed


class _EqualTokenBalanced(EqualToken):
    """The baseline's batches dealt by cost, so that a dealing axis compares like with like
    (not a registered policy: the paper's baseline is cost-blind)."""

    name = "equal-token-balanced"
    balanced = True


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
    headroom = float(cal.extra.get("headroom", 0.1))
    first = derive_budgets(cal.cost, tokens, cal.capacity_bytes, headroom)
    ref = reference_tokens(tokens, first.m_mem, reference)
    d = derive_budgets(cal.cost, tokens, cal.capacity_bytes, headroom, ref_tokens=ref)
    return {"p": d.p, "m_mem": d.m_mem, "m_tok": d.m_tok, "m_comp": d.m_comp * scale,
            "ref_tokens": d.ref_tokens, "ref_batch": d.ref_batch}  # fmt: skip


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
            })  # fmt: skip
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
            })  # fmt: skip
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- what the map says
def _short(value: Any) -> str:
    """A calibration path by its file stem, anything else as it is."""
    text = str(value)
    return Path(text).stem if text.endswith(".json") else text


def deviation_pp(points: pd.DataFrame) -> pd.DataFrame:
    """Each number's distance from the paper's, in percentage points (of the rate or of the
    relative change), and the worst of the four."""
    dev = pd.DataFrame({k: 100 * (points[k] - v).abs() for k, v in PAPER.items()})
    dev["worst"] = dev.max(axis=1)
    return dev


def consistent(points: pd.DataFrame, tolerance_pp: float) -> pd.Series:
    """True where all four numbers lie within `tolerance_pp` of the paper's at once."""
    return deviation_pp(points)["worst"] <= tolerance_pp


def region(points: pd.DataFrame, tolerance_pp: float) -> dict[str, Any]:
    """The consistent settings: how many, the values each axis takes among them, the ranges
    of the four numbers there; otherwise the nearest settings."""
    unique = points.drop_duplicates(subset=list(SETTINGS))
    dev = deviation_pp(unique)
    ok = unique[dev["worst"] <= tolerance_pp]
    within = {k: int((dev[k] <= tolerance_pp).sum()) for k in PAPER}
    nearest = unique.assign(worst_pp=dev["worst"]).nsmallest(5, "worst_pp")
    return {
        "tolerance_pp": tolerance_pp,
        "settings": len(unique.drop_duplicates(subset=list(AXES))),
        "rows": len(unique),  # settings x imbalance definitions
        "consistent": len(ok),  # rows (a setting may be consistent under two definitions)
        "consistent_settings_count": len(ok.drop_duplicates(subset=list(AXES))),
        "within_tolerance_per_number": within,
        "axis_values": {a: sorted(map(str, ok[a].unique())) for a in SETTINGS},
        "number_ranges": {k: [float(ok[k].min()), float(ok[k].max())] for k in PAPER}
        if len(ok) else {},
        "consistent_settings": _records(
            ok.assign(worst_pp=dev.loc[ok.index, "worst"]).sort_values("worst_pp")),
        "nearest": _records(nearest),
    }


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    keep = [*SETTINGS, "definition_formula", "calibration_label", "source", *PAPER,
            "worst_pp", "p", "m_mem", "m_tok", "m_comp", "ref_tokens", "ref_batch",
            "baseline_vram_utilization", "adaptiveload_vram_utilization",
            "baseline_samples_per_s", "adaptiveload_samples_per_s", "baseline_tokens_per_s",
            "adaptiveload_tokens_per_s", "baseline_idle_fraction", "adaptiveload_idle_fraction",
            "seeds"]  # fmt: skip
    return frame[[c for c in keep if c in frame.columns]].to_dict(orient="records")


def tornado(points: pd.DataFrame) -> pd.DataFrame:
    """Per number and axis (the definition included): the range over that axis's one-at-a-time
    values with everything else at the centre; sorted by span within each number."""
    at_centre = points["definition"] == CENTRE_DEFINITION
    rows = []
    for axis in (*AXES, "definition"):
        if axis == "definition":
            sel = points[points["designs"].str.contains("centre")]
        else:
            sel = points[points["designs"].str.contains(f"oat:{axis}") & at_centre]
        if sel[axis].nunique() < 2:
            continue
        for number in PAPER:
            lo, hi = sel.loc[sel[number].idxmin()], sel.loc[sel[number].idxmax()]
            if hi[number] - lo[number] < 1e-9:  # this axis does not move this number
                continue
            rows.append({"number": number, "axis": axis, "low": lo[number], "high": hi[number],
                         "low_at": _short(lo[axis]), "high_at": _short(hi[axis]),
                         "span": hi[number] - lo[number]})  # fmt: skip
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    return frame.sort_values(["number", "span"], ascending=[True, False], ignore_index=True)


def summarize(points: pd.DataFrame, spec: dict[str, Any]) -> dict[str, Any]:
    """The map's answer: the consistent region (or nearest settings) and the tornado."""
    torn = tornado(points)
    centre = points[points["designs"].str.contains("centre")]
    most = {n: torn[torn["number"] == n].iloc[0].to_dict() for n in PAPER
            if len(torn) and (torn["number"] == n).any()}  # fmt: skip
    return {
        "paper": PAPER,
        "centre": spec["centre"],
        "centre_numbers": _records(centre.assign(worst_pp=deviation_pp(centre)["worst"])),
        "region": region(points, spec["tolerance_pp"]),
        "most_influential": most,
        "tornado": torn.to_dict(orient="records"),
        "sources": sorted(set(points["source"])),
        "design": {"points": int(points.drop_duplicates(subset=list(AXES)).shape[0]),
                   "seeds": spec["seeds"], "num_samples": spec["num_samples"],
                   "factorial_axes": sorted(spec.get("factorial") or {})},
    }  # fmt: skip


def paper_table_rows(summary: dict[str, Any]) -> pd.DataFrame:
    """Rows for the paper table (its `numbers` columns): the consistent settings, else the
    nearest one, each as a baseline and an AdaptiveLoad row, labelled as such."""
    reg = summary["region"]
    found = pd.DataFrame(reg["consistent_settings"] or reg["nearest"][:1])
    # one row pair per setting of the axes (its closest definition), at most three
    settings = found.drop_duplicates(subset=list(AXES)).head(3).to_dict(orient="records")
    what = "paper-consistent" if reg["consistent_settings"] else "nearest to the paper"
    rows = []
    for s in settings:
        name = (f"{what} (±{reg['tolerance_pp']:g} pp): {s['mixture']}, ref {s['reference']}, "
                f"M_comp×{s['m_comp_scale']:g}, {Path(s['calibration']).stem}, "
                f"N={s['world_size']}, {s['dealing']}, imbalance={s['definition']}")
        for policy, role in (("equal-token", "baseline"), ("adaptiveload", "adaptiveload")):
            is_al = role == "adaptiveload"
            rows.append({
                "setup": name, "kernel": "none", "policy": policy, "label": s["source"],
                "world_size": s["world_size"], "seeds": s["seeds"],
                "imbalance_rate": s[f"{role}_imbalance"],
                "vram_utilization": s[f"{role}_vram_utilization"], "vram_source": "model",
                "samples_per_s": s[f"{role}_samples_per_s"],
                "tokens_per_s": s[f"{role}_tokens_per_s"],
                "idle_fraction": s[f"{role}_idle_fraction"],
                "throughput_change": s["throughput_change"] if is_al else np.nan,
                "imbalance_change": (s["adaptiveload_imbalance"] - s["baseline_imbalance"]
                                     if is_al else np.nan),
                "vram_change": s["vram_change"] if is_al else 0.0,
            })  # fmt: skip
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- the figure
def figure(points: pd.DataFrame, summary: dict[str, Any]):
    """Where the paper's four numbers lie: the two planes of the map with the paper's point and
    its tolerance box, the consistent settings ringed, and one tornado panel per number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    reg, tol = summary["region"], summary["region"]["tolerance_pp"]
    ok = consistent(points, tol)
    points = points.assign(cost_model=points["calibration"].map(_short))
    fig = plt.figure(figsize=(17, 10.5))
    grid = fig.add_gridspec(2, 4, height_ratios=[1.15, 1], hspace=0.45, wspace=0.9)
    planes = (("baseline_imbalance", "adaptiveload_imbalance", "definition", "dealing"),
              ("throughput_change", "vram_change", "reference", "cost_model"))  # fmt: skip
    for k, (x, y, hue, style) in enumerate(planes):
        ax = fig.add_subplot(grid[0, 2 * k: 2 * k + 2])
        sns.scatterplot(data=points, x=100 * points[x], y=100 * points[y], hue=hue,
                        style=style, s=18, alpha=0.6, ax=ax)
        ax.scatter(100 * points.loc[ok, x], 100 * points.loc[ok, y], s=70, facecolors="none",
                   edgecolors="k", lw=1.2, label="consistent (all four)")
        px, py = 100 * PAPER[x], 100 * PAPER[y]
        ax.add_patch(matplotlib.patches.Rectangle((px - tol, py - tol), 2 * tol, 2 * tol,
                                                  fill=False, ls="--", color="crimson"))
        ax.plot(px, py, marker="*", ms=16, color="crimson", ls="", label="paper")
        ax.set(xlabel=NUMBERS[x], ylabel=NUMBERS[y])
        ax.legend(fontsize=7, ncol=2, loc="upper left")
        ax.set_title(f"{NUMBERS[y]} vs {NUMBERS[x]}\nevery setting [model], paper ★ "
                     f"with ±{tol:g} pp box", fontsize=9)
    torn = pd.DataFrame(summary["tornado"])
    for k, number in enumerate(PAPER):
        ax = fig.add_subplot(grid[1, k])
        sel = torn[torn["number"] == number] if len(torn) else torn
        if sel.empty:
            ax.axis("off")
            continue
        sel = sel.iloc[::-1]
        pos = np.arange(len(sel))
        ax.barh(pos, 100 * sel["span"], left=100 * sel["low"], color="0.55")
        centre = summary["centre_numbers"]
        if centre:
            at = [c for c in centre if c["definition"] == CENTRE_DEFINITION]
            ax.axvline(100 * at[0][number], color="k", lw=0.8, label="centre")
        ax.axvline(100 * PAPER[number], color="crimson", ls="--", lw=1, label="paper")
        ax.set_yticks(pos, [f"{r.axis}\n{r.low_at} … {r.high_at}" for r in sel.itertuples()],
                      fontsize=6.5)
        ax.set_xlabel(NUMBERS[number], fontsize=8)
        ax.set_title(f"what moves it [model]: {sel.iloc[-1]['axis']} most", fontsize=9)
        ax.legend(fontsize=6, loc="best")
    if reg["consistent"]:
        ranges = ", ".join(f"{NUMBERS[k].split(' (')[0]} {100 * lo:.1f}–{100 * hi:.1f}%"
                           for k, (lo, hi) in reg["number_ranges"].items())
        verdict = (f"{reg['consistent_settings_count']} of {reg['settings']} settings "
                   f"({reg['consistent']} of {reg['rows']} setting × definition pairs) agree "
                   f"with all four numbers within ±{tol:g} pp: {ranges}")
    else:
        near = reg["nearest"][0]
        verdict = (f"no setting of {reg['settings']} (× {len(DEFINITIONS)} definitions) "
                   f"agrees with all four within ±{tol:g} pp; "
                   f"nearest ({near['worst_pp']:.1f} pp off): " + ", ".join(
                       f"{a}={_short(near[a])}" for a in SETTINGS))
    models = "; ".join(s.removeprefix("model (").removesuffix(")")
                       for s in sorted(set(points["source"])))
    fig.suptitle(f"Where the paper's (39%, 18.9%, +22.7%, +27.2%) lies among unpublished "
                 f"choices: every number [model], simulated through the cost models of\n"
                 f"{models}\n{verdict}", fontsize=10)
    return fig
