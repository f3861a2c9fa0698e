"""What the simulated map of the paper's unpublished choices says: how far each setting lies
from the paper's four numbers, the settings consistent with all of them, the tornado (which
single choice moves each number most), the paper-table rows and the figure.

The map itself (the design, the plans and simulations of every setting) is
`adaptiveload.planning.paper_map`; docs/paper_map.md has the why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from adaptiveload import metrics
from adaptiveload.planning.paper_map import AXES

# the paper's four numbers (abstract): baseline and AdaptiveLoad imbalance, relative changes
PAPER = {"baseline_imbalance": 0.39, "adaptiveload_imbalance": 0.189,
         "vram_change": 0.227, "throughput_change": 0.272}
NUMBERS = {
    "baseline_imbalance": "baseline imbalance (%)",
    "adaptiveload_imbalance": "AdaptiveLoad imbalance (%)",
    "vram_change": "Δ VRAM utilization (relative, %)",
    "throughput_change": "Δ throughput (relative, %)",
}
DEFINITIONS = tuple(metrics.IMBALANCE_DEFINITIONS)
SETTINGS = (*AXES, "definition")  # what identifies one row of the map
CENTRE_DEFINITION = "range"  # the project's primary imbalance rate, (max - min) / max


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
            "seeds"]
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
                         "span": hi[number] - lo[number]})
    frame = pd.DataFrame(rows)
    if frame.empty:
        return frame
    return frame.sort_values(["number", "span"], ascending=[True, False], ignore_index=True)


def summarize(points: pd.DataFrame, spec: dict[str, Any]) -> dict[str, Any]:
    """The map's answer: the consistent region (or nearest settings) and the tornado."""
    torn = tornado(points)
    centre = points[points["designs"].str.contains("centre")]
    most = {n: torn[torn["number"] == n].iloc[0].to_dict() for n in PAPER
            if len(torn) and (torn["number"] == n).any()}
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
    }


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
            })
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
              ("throughput_change", "vram_change", "reference", "cost_model"))
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
