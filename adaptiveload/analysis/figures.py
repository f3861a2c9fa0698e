"""The figures: one message each, titled, units on axes, every panel labelled `measured (device)`
or `model estimate (device)`. Seaborn on the Agg backend (no display needed).

What makes a figure stand alone, here for all of them: one colour per policy in every figure
(`POLICY_COLORS`, the one home of the palette); measured and modelled numbers never share a
panel, and "model estimate" is in the title of anything modelled; no figure is wider than
`MAX_ASPECT` times its height (wide rows of panels wrap); a speedup axis keeps to its
estimates and to SPEEDUP_WINDOW, marking the intervals that run past it instead of stretching
to them; the paper's own numbers (`paper_map.PAPER`) drawn as references where a figure
shows the same quantity.

Each figure is a function of `FigureInputs` registered in `FIGURES`. A figure whose data do
not exist in this experiment (no measured calibration points, no sweep) is still written,
saying what is missing and why, so the pipeline's outputs are fixed; the kernel figure is the
exception, drawn only where the kernel was measured (`kernel_measured`; the pipeline asks for
it only then, and the kernel table says why otherwise).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from adaptiveload.analysis.aggregate import per_step
from adaptiveload.analysis.landing import (
    PAPER_SPEEDUP,
    group_name,
    policy_order,
    seed_spread,
    speedups,
)
from adaptiveload.analysis.paper_map import PAPER
from adaptiveload.analysis.stats import headline
from adaptiveload.analysis.tables import kernel_measurements
from adaptiveload.costmodel import CostModel
from adaptiveload.errors import UserError
from adaptiveload.planning.policies import POLICIES
from adaptiveload.step_table import SP_DEGREE

# the one colour of each policy, in every figure (a policy not in POLICIES: OTHER_COLOR)
POLICY_COLORS = dict(zip(POLICIES, sns.color_palette("colorblind", len(POLICIES)), strict=True))
OTHER_COLOR = (0.5, 0.5, 0.5)
# the widest a figure may be for its height; a row of panels wider than this wraps
MAX_ASPECT = 3.0
# what a panel of modelled numbers says in its title
MODEL_ESTIMATE = "model estimate"


def policy_color(policy: str) -> tuple[float, float, float]:
    return POLICY_COLORS.get(policy, OTHER_COLOR)


def _palette(policies) -> dict:
    """The colours of `policies` for seaborn's `palette=`."""
    return {p: policy_color(p) for p in policies}


@dataclass
class FigureInputs:
    runs: pd.DataFrame
    steps: pd.DataFrame
    stats: pd.DataFrame
    describe: dict | None = None
    calibration: dict | None = None
    kernel_bench: Path | None = None
    mixture: str | None = None  # the data's name: a synthetic mixture or a manifest file

    def __post_init__(self) -> None:
        self.step_table = per_step(self.steps)


def _placeholder(title: str, why: str) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(7, 2.5))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, f"not available in this run:\n{why}", ha="center", va="center", wrap=True)
    return fig


def _base(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[frame["variant"] == "base"]


def _setups(frame: pd.DataFrame) -> list[str]:
    return sorted(set(frame["setup"]), key=lambda s: (not s.startswith("train"), s))


def _label(frame: pd.DataFrame) -> str:
    return ", ".join(sorted(set(frame["label"])))


def _wrap(text: str, width: int = 48) -> str:
    """Panel titles wrapped to their panel's width, so neighbours' titles never overlap."""
    return "\n".join(textwrap.fill(line, width) for line in text.splitlines())


def _kind(source: str) -> str:
    """How a panel of `source` numbers is titled: measured, or a model estimate."""
    return "measured" if _measured(source) else MODEL_ESTIMATE


def _measured(source: str) -> bool:
    """A source ("measured", or a label such as "measured (cpu)") of measured numbers."""
    return str(source).startswith("measured")


def _panel_grid(n: int, width: float, height: float, **kw) -> tuple[plt.Figure, list[plt.Axes]]:
    """`n` panels of `width` x `height` inches, as many per row as keep the figure within
    MAX_ASPECT (a row of many setups wraps instead of becoming a strip); row-major order."""
    cols = n
    while cols > 1 and cols * width > MAX_ASPECT * math.ceil(n / cols) * height:
        cols -= 1
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * width, rows * height), squeeze=False,
                             layout="constrained", **kw)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        fig.delaxes(ax)
    return fig, flat[:n]


def _first_in_row(ax: plt.Axes) -> bool:
    return ax.get_subplotspec().is_first_col()


def _box_panels(table: pd.DataFrame, y: pd.Series, ylabel: str, subtitle,
                reference=None) -> plt.Figure:
    """One box plot of `y` by policy per setup, measured setups first, each titled measured
    or model estimate; the y label on the leftmost panel of each row. `reference(ax, sel)`
    draws the paper's numbers on a panel."""
    setups = _setups(table)
    fig, axes = _panel_grid(len(setups), 4.8, 4.4)
    for ax, setup in zip(axes, setups, strict=True):
        sel = table[table["setup"] == setup]
        policies = policy_order(sel["policy"])
        sns.boxplot(data=sel, x="policy", y=y[sel.index], order=policies, hue="policy",
                    palette=_palette(policies), saturation=1, ax=ax, showfliers=False,
                    legend=False)
        modelled = not sel["source"].map(_measured).all()
        if modelled:  # hatched as well as titled: a model's boxes read apart at a glance
            for patch in ax.patches:
                patch.set_hatch("//")
        if reference is not None:
            reference(ax, sel)
        ax.set_ylabel(ylabel if _first_in_row(ax) else "")
        ax.set_xlabel("")
        ax.tick_params(axis="x", rotation=15)
        kind = MODEL_ESTIMATE if modelled else "measured"
        ax.set_title(_wrap(f"{setup} ({kind})\n{subtitle(sel)}"), fontsize=9)
    return fig


def mixture_tokens(inp: FigureInputs) -> plt.Figure:
    """Sequence-length distribution of the bucketed mixture, bucket token counts marked."""
    if not inp.describe or not inp.describe.get("buckets"):
        return _placeholder("Sequence lengths of the mixture", "no manifest description")
    buckets = pd.DataFrame(inp.describe["buckets"])
    fig, ax = plt.subplots(figsize=(8, 4))
    bins = np.geomspace(max(1, buckets["tokens"].min() / 1.5), buckets["tokens"].max() * 1.5, 40)
    ax.hist(buckets["tokens"], bins=bins, weights=buckets["count"], color="0.35")
    for tokens in sorted(set(buckets["tokens"])):
        ax.axvline(tokens, color="tab:orange", lw=0.6, alpha=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("sequence length S (tokens per sample, log scale)")
    ax.set_ylabel("samples")
    n, excl = inp.describe.get("num_samples"), inp.describe.get("num_excluded", 0)
    name = inp.mixture or Path(inp.describe.get("manifest", "the manifest")).name
    ax.set_title(f"Mixture {name}: S spans {buckets['tokens'].min():,}–"
                 f"{buckets['tokens'].max():,} tokens\n({n} samples, {excl} excluded; "
                 "orange lines = bucket sizes)", fontsize=11)
    return fig


def compute_heatmap(inp: FigureInputs) -> plt.Figure:
    """Each rank's compute at every step of one run per policy (first setup, base variant,
    first kernel and seed), as a share of the step's slowest rank: 1 is the step's straggler,
    lower values are ranks that wait. Each panel spans its own policy's steps (their counts
    differ); the warm-up steps, outside every number of the tables, are shaded and named."""
    steps = _base(inp.steps)
    setup = _setups(steps)[0]
    steps = steps[steps["setup"] == setup]
    kernel = sorted(set(steps["kernel"]))[0]
    steps = steps[(steps["kernel"] == kernel) & (steps["seed"] == steps["seed"].min())]
    steps = steps.assign(share=steps["compute_s"]
                         / steps.groupby(["policy", "step"])["compute_s"].transform("max"))
    policies = policy_order(steps["policy"])
    height = 1.6 + 1.3 * len(policies)
    fig, axes = plt.subplots(len(policies), 1, figsize=(min(11.0, MAX_ASPECT * height), height),
                             squeeze=False, layout="constrained")
    for ax, policy in zip(axes[:, 0], policies, strict=True):
        sel = steps[steps["policy"] == policy]
        grid = sel.pivot(index="rank", columns="step", values="share")
        first, last = int(grid.columns.min()), int(grid.columns.max())
        mesh = ax.imshow(grid.to_numpy(np.float64), aspect="auto", cmap="viridis", vmin=0,
                         vmax=1, interpolation="nearest",
                         extent=(first - 0.5, last + 0.5, grid.index.max() + 0.5,
                                 grid.index.min() - 0.5))
        ax.grid(False)
        warm = sorted(set(sel.loc[~sel["timed"].astype(bool), "step"]))
        if warm:
            ax.axvspan(min(warm) - 0.5, max(warm) + 0.5, facecolor="none", hatch="xx",
                       edgecolor="white", lw=0, label="warm-up")
            ax.axvline(max(warm) + 0.5, color="white", lw=1.5)
        timed = sel[sel["timed"].astype(bool)]
        imb = per_step(timed)["imbalance"].mean() if not timed.empty else float("nan")
        ax.set_ylabel("rank")
        ax.set_xlabel("step")
        ax.set_title(f"{policy}: {last - first + 1} steps ({len(warm)} warm-up, hatched), "
                     f"mean imbalance of the timed steps {100 * imb:.1f}%", fontsize=9,
                     loc="left", color=policy_color(policy))
    fig.colorbar(mesh, ax=axes[:, 0].tolist(),
                 label="compute / the step's slowest rank (1 = straggler)")
    kind = _kind(steps["source"].iloc[0])
    fig.suptitle(f"Per-rank compute at every step ({kind}), {setup}, seed "
                 f"{steps['seed'].min()} [{_label(steps)}]\nbright = the step's straggler, "
                 "dark = a rank waiting for it", fontsize=11)
    return fig


def _paper_imbalance(ax: plt.Axes, sel: pd.DataFrame) -> None:
    """The paper's imbalance of equal-token and of AdaptiveLoad, in those policies' colours."""
    for policy, key in (("equal-token", "baseline_imbalance"),
                        ("adaptiveload", "adaptiveload_imbalance")):
        ax.axhline(100 * PAPER[key], color=policy_color(policy), ls="--", lw=1,
                   label=f"the paper's {policy}: {100 * PAPER[key]:.1f}%")


def imbalance_distribution(inp: FigureInputs) -> plt.Figure:
    """Per-step imbalance rate by policy, one panel per setup, the paper's numbers dashed."""
    table = _base(inp.step_table)
    fig = _box_panels(table, 100 * table["imbalance"], "per-step imbalance rate (%)",
                      lambda sel: f"[{_label(sel)}]", reference=_paper_imbalance)
    handles, labels = fig.axes[0].get_legend_handles_labels()  # below the panels, not on boxes
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8)
    fig.suptitle("Imbalance rate per step, (max − min)/max of rank compute: lower = ranks "
                 "finish together (dashed: the paper's, Wan 2.1 on 16 GPUs)")
    return fig


# interval ends beyond these multiples of the baseline's samples/s do not widen a speedup
# axis (one interval of a few steps would otherwise flatten every other row): they are clipped
SPEEDUP_WINDOW = (0.5, 2.0)


def _axis_range(rows: pd.DataFrame) -> tuple[float, float]:
    """A speedup axis over the estimates, the baseline (1.0), the paper's speedup and the
    interval ends within SPEEDUP_WINDOW."""
    ends = pd.concat([rows["ci_low"], rows["ci_high"]]).dropna()
    ends = ends[ends.between(*SPEEDUP_WINDOW)]
    values = pd.concat([rows["estimate"], ends, pd.Series([1.0, PAPER_SPEEDUP])])
    lo, hi = values.min(), values.max()
    pad = 0.05 * (hi - lo)
    return max(0.0, lo - pad), hi + pad


def throughput(inp: FigureInputs) -> plt.Figure:
    """Samples/s of each policy as a speedup over the baseline (×, the baseline at 1.0, the
    paper's ×1.272 dashed): measured comparisons in the top panel with their 95% intervals,
    model estimates below (seeds' min-max where the statistics give no interval)."""
    sel = speedups(inp.stats)
    if sel.empty:
        return _placeholder("Throughput vs baseline", "no baseline comparison")
    sel = sel.assign(measured=sel["source"].map(_measured))
    panels = [(kind, part) for kind, part in ((True, sel[sel["measured"]]),
                                              (False, sel[~sel["measured"]])) if not part.empty]
    policies = policy_order(sel["policy"])
    rows = [len(part) + part["group"].nunique() for _, part in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False, layout="constrained",
                             height_ratios=rows, figsize=(9, 1.6 + 0.32 * sum(rows)))
    lo, hi = _axis_range(sel)
    for ax, (measured, part) in zip(axes[:, 0], panels, strict=True):
        _speedup_panel(ax, part, policies, lo, hi)
        kind = "measured" if measured else MODEL_ESTIMATE
        with_ci = part[["ci_low", "ci_high"]].notna().all(axis=1)
        interval = ("95% CI" if with_ci.all() else "no CI: seeds' min–max" if not with_ci.any()
                    else "95% CI, else seeds' min–max")
        ax.set_title(f"{kind} ({interval})", loc="left", fontsize=10)
    axes[-1, 0].set_xlabel(f"samples/s speedup over {sel['baseline'].iloc[0]} (×; 1.0 = "
                           "baseline)")
    fig.suptitle("Training throughput vs the baseline (dashed: the paper's ×"
                 f"{PAPER_SPEEDUP:.3f}, Wan 2.1 on 16 GPUs; ▶/◀: interval beyond the axis)",
                 fontsize=11)
    return fig


def _speedup_panel(ax: plt.Axes, part: pd.DataFrame, policies: list[str], lo: float,
                   hi: float) -> None:
    """One dot per group and policy at its speedup, its interval as a line clipped to
    [lo, hi] with an arrow where it runs past; groups down the y axis, measured first."""
    groups = sorted(set(part["group"]), key=lambda g: (not g.startswith("train"), g))
    y, ticks = 0.0, []
    for group in groups:
        mine = part[part["group"] == group]
        start = y
        for policy in [p for p in policies if p in set(mine["policy"])]:
            row = mine[mine["policy"] == policy].iloc[0]
            low, high = row["ci_low"], row["ci_high"]
            if np.isnan(low) or np.isnan(high):
                low, high = seed_spread(row)
            color = policy_color(policy)
            if not (np.isnan(low) or np.isnan(high)):
                ax.plot([max(low, lo), min(high, hi)], [y, y], color=color, lw=2)
                if high > hi:
                    ax.plot(hi, y, marker=">", color=color, ms=7, clip_on=False)
                if low < lo:
                    ax.plot(lo, y, marker="<", color=color, ms=7, clip_on=False)
            ax.plot(row["estimate"], y, "o", color=color, ms=7, label=policy)
            ax.annotate(f"×{row['estimate']:.2f}", (min(row["estimate"], hi), y),
                        xytext=(0, 5), textcoords="offset points", ha="center", fontsize=7)
            y += 1
        ticks.append(((start + y - 1) / 2, group))
        y += 1  # a gap between groups
    ax.axvline(1.0, color="k", lw=0.8)
    ax.axvline(PAPER_SPEEDUP, color=policy_color("adaptiveload"), ls="--", lw=1)
    ax.set_xlim(lo, hi)
    ax.set_ylim(y - 1, -1)
    ax.set_yticks([t for t, _ in ticks], [_wrap(g, 30) for _, g in ticks], fontsize=8)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"×{v:.2f}"))
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))


def _memory_note(runs: pd.DataFrame, sel: pd.DataFrame) -> str:
    """How much of a setup's modelled memory is extrapolated: its micro-batches beyond the
    largest the calibration measured memory for (the runs' summaries count them)."""
    mine = runs[runs["setup"].isin(set(sel["setup"])) & (runs["variant"] == "base")]
    beyond = mine.get("micro_batches_beyond_measured_memory", pd.Series(dtype=float)).dropna()
    if beyond.empty:
        return ""
    total = sel["micro_batches"].sum() if "micro_batches" in sel else np.nan
    share = f" ({100 * beyond.sum() / total:.0f}% of them)" if total and total > 0 else ""
    return (f"\nEXTRAPOLATED: {int(beyond.sum())} micro-batches beyond measured memory"
            f"{share}" if beyond.sum() > 0 else "\nwithin measured memory")


def vram_utilization(inp: FigureInputs) -> plt.Figure:
    """Per-step mean VRAM utilization by policy: measured where it exists, else the model's
    (titled model estimate, boxes hatched, extrapolated memory flagged); 0 to 100% at least."""
    table = _base(inp.step_table).copy()
    measured = table["vram_util_measured"].notna()
    table["vram"] = np.where(measured, table["vram_util_measured"], table["vram_util_model"])
    table["source"] = np.where(measured, "measured", "model")
    table = table[table["vram"].notna()]
    if table.empty:
        return _placeholder("VRAM utilization", "neither measured peaks nor a capacity to "
                            "compare the model's estimate with")
    micro = (inp.steps[inp.steps["samples"] > 0].groupby("setup").size()
             .rename("micro_batches").reset_index())
    table = table.merge(micro, on="setup", how="left")
    counted = table.drop_duplicates("setup")
    fig = _box_panels(
        table, 100 * table["vram"], "peak memory / device capacity (%)",
        lambda sel: f"runs: {_label(sel)}"
                    + _memory_note(inp.runs, counted[counted["setup"].isin(set(sel["setup"]))]),
    )
    for ax in fig.axes:
        ax.set_ylim(0, max(100.0, ax.get_ylim()[1]))
    kind = "measured" if measured.all() else (
        MODEL_ESTIMATE if not measured.any() else f"measured, else {MODEL_ESTIMATE}")
    fig.suptitle(f"VRAM utilization per step ({kind}): higher = memory budget used, not wasted")
    return fig


def calibration_fit(inp: FigureInputs) -> plt.Figure:
    """The cost model against what it was fitted to and what it predicts.

    Left: measured against fitted step time per grid point (y = x is a perfect fit), and the
    mixed packs held out of the fit against the cost of a set (`additivity`). Middle:
    the fitted curves t(B, S) against the measured points over S, one per batch size, with
    the small-batch floor visible as the flat part. Right: the per-micro-batch validation
    (micro-batches drawn from the policies' plans), if the calibration has one.
    """
    cal = inp.calibration or {}
    points = pd.DataFrame(cal.get("points") or cal.get("measurements") or [])
    needed = {"batch", "tokens", "time_s"}
    if not points.empty and needed <= set(points.columns):
        points = points[points["time_s"].notna()]
    if points.empty or not needed <= set(points.columns):
        return _placeholder("Calibration fit", "the calibration has no measured points "
                            f"({cal.get('source', 'no calibration')})")
    cost = CostModel(**cal["cost"])
    pred = pd.Series(cost.step_time(points["batch"], points["tokens"]), index=points.index)
    fit = cal.get("fit") or {}
    if "r2" in fit:  # the calibration's own goodness of fit (its fitting objective)
        r2 = fit["r2"]
    else:
        resid = points["time_s"] - pred
        r2 = 1 - (resid**2).sum() / ((points["time_s"] - points["time_s"].mean()) ** 2).sum()
    worst = fit.get("max_rel_err")
    fig, (ax, curve_ax, val_ax) = plt.subplots(1, 3, figsize=(15, 5.2))
    sns.scatterplot(x=pred, y=points["time_s"], hue=points["batch"].astype(str),
                    size=points["tokens"], ax=ax)
    additivity = cal.get("additivity") or {}
    packs = pd.DataFrame(additivity.get("packs") or [], columns=["predicted_s", "time_s",
                                                                 "rel_err"])
    packs = packs[packs["rel_err"].notna()]
    if not packs.empty:  # held out of the fit: the cost of a set, set_time
        ax.scatter(packs["predicted_s"], packs["time_s"], marker="X", s=60, color="black",
                   zorder=3, label="mixed packs (held out)")
    both = (pd.concat([pred, packs["predicted_s"]]), pd.concat([points["time_s"], packs["time_s"]]))
    lim = [min(v.min() for v in both) * 0.8, max(v.max() for v in both) * 1.2]
    ax.plot(lim, lim, "k--", lw=0.8, label="y = x")
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim,
           xlabel="fitted t(B,S) = max(t_floor, c0 + B(c_seq + aS + bS²)); packs: t(set) (s)",
           ylabel="measured step time (s)")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(title="batch B / tokens S", fontsize=7)
    worst_txt = f", worst point {100 * worst:.0f}% off" if worst is not None else ""
    loo_txt = (f"\nleave-one-out median {100 * fit['loo_median']:.1f}%, max "
               f"{100 * fit['loo_max']:.1f}%" if fit.get("loo_max") is not None else "")
    pack_txt = (f"\nmixed packs held out ({additivity['num_measured']}): median "
                f"{100 * additivity['median_rel_err']:.1f}%, worst "
                f"{100 * additivity['max_rel_err']:.1f}%" if not packs.empty else "")
    ax.set_title(f"Calibration of {cal.get('model')} on {cal.get('device')} "
                 f"[{cal.get('source')}]\nR² = {r2:.3f}{worst_txt}; derived p = "
                 f"{cal.get('p', float('nan')):.2f}{loo_txt}{pack_txt}", fontsize=8)
    _fit_curves(curve_ax, cost, points, cal)
    _validation_panel(val_ax, cal)
    fig.tight_layout()
    return fig


def _fit_curves(ax: plt.Axes, cost: CostModel, points: pd.DataFrame, cal: dict) -> None:
    """Measured points over S and the fitted t(B, S) of each measured batch size."""
    s = np.geomspace(points["tokens"].min() * 0.8, points["tokens"].max() * 1.25, 200)
    colors = sns.color_palette("colorblind", points["batch"].nunique())
    for color, (batch, sel) in zip(colors, points.groupby("batch"), strict=True):
        ax.plot(s, cost.step_time(batch, s), color=color, lw=1.2, label=f"fit, B = {batch}")
        ax.scatter(sel["tokens"], sel["time_s"], color=color, s=22, zorder=3,
                   label=f"measured, B = {batch}")
    if cost.t_floor > 0:
        ax.axhline(cost.t_floor, color="grey", lw=0.8, ls=":",
                   label=f"floor {cost.t_floor:.3g} s")
    ax.set(xscale="log", yscale="log", xlabel="tokens per sample S",
           ylabel="step time (s)",
           title=f"fitted curves against the points\n[{cal.get('source')} "
                 f"({cal.get('device')})]")
    ax.title.set_fontsize(8)
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=7)


def _validation_panel(ax: plt.Axes, cal: dict) -> None:
    """Predicted against measured time of micro-batches drawn from the plans (if any)."""
    rows = pd.DataFrame((cal.get("validation") or {}).get("micro_batches") or [])
    if rows.empty or rows["measured_s"].isna().all():
        ax.axis("off")
        ax.text(0.5, 0.5, "no per-micro-batch validation in this calibration\n"
                "(adaptiveload calibrate measure --validate K)", ha="center", va="center",
                fontsize=9)
        return
    rows = rows[rows["measured_s"].notna()]
    val = cal["validation"]
    for policy, sel in rows.groupby("policy"):
        ax.scatter(sel["predicted_s"], sel["measured_s"], color=policy_color(policy), s=22,
                   label=policy)
    lim = np.array([min(rows["predicted_s"].min(), rows["measured_s"].min()) * 0.8,
                    max(rows["predicted_s"].max(), rows["measured_s"].max()) * 1.2])
    ax.plot(lim, lim, "k--", lw=0.8, label="y = x")
    ax.fill_between(lim, lim / 1.1, lim * 1.1, color="grey", alpha=0.15, label="±10%")
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="predicted (s)",
           ylabel=f"measured (s) [{cal.get('source')} ({cal.get('device')})]")
    ax.set_title(f"{val['num_measured']} micro-batches from the plans ({val['world_size']} "
                 f"ranks)\n|pred-meas|/meas median {100 * val['median_rel_err']:.1f}%, "
                 f"p95 {100 * val['p95_rel_err']:.1f}%", fontsize=8)
    ax.legend(fontsize=7)


def _sweep_figure(inp: FigureInputs, axis: str, xlabel: str, logx: bool = False) -> plt.Figure:
    """A sweep of simulations: imbalance (top) and samples/s speedup over the baseline
    (bottom, ×, the baseline at 1.0) per point, one column per setup."""
    runs = inp.runs[inp.runs["sweep_axis"] == axis]
    title = f"Sweep over {xlabel}"
    if runs.empty:
        return _placeholder(title, f"this experiment has no `{axis}` sweep")
    numeric = axis != "mixture"
    runs = runs.assign(x=runs["sweep_value"].astype(float) if numeric else runs["sweep_value"])
    stats = headline(inp.stats)
    ratio = stats[(stats["metric"] == "samples_per_s ratio")
                  & (stats["variant"].str.startswith(f"{axis}="))]
    ratio = ratio.assign(x=ratio["variant"].str.split("=").str[1])
    if numeric:
        ratio = ratio.assign(x=ratio["x"].astype(float))
    setups = _setups(runs)
    fig, axes = plt.subplots(2, len(setups), figsize=(max(8, 5 * len(setups)), 7),
                             squeeze=False, sharex="col")
    for col, setup in enumerate(setups):
        sel = runs[runs["setup"] == setup]
        policies = policy_order(sel["policy"])
        ax = axes[0, col]
        sns.lineplot(data=sel, x="x", y=100 * sel["imbalance_rate"], hue="policy",
                     hue_order=policies, palette=_palette(policies), marker="o", ax=ax,
                     errorbar=("pi", 100) if sel["seed"].nunique() > 1 else None)
        ax.set_ylabel("imbalance rate (%)" if col == 0 else "")
        kind = _kind(sel["source"].iloc[0])
        ax.set_title(_wrap(f"{setup} ({kind}) [{_label(sel)}]", 60), fontsize=9)
        ax = axes[1, col]
        rsel = ratio[ratio["setup"] == setup]
        for policy in policy_order(rsel["policy"]):
            part = rsel[rsel["policy"] == policy].sort_values("x")
            err = np.array([part["estimate"] - part["ci_low"], part["ci_high"] - part["estimate"]])
            ax.errorbar(part["x"], part["estimate"], yerr=np.nan_to_num(err), marker="o",
                        capsize=3, color=policy_color(policy), label=policy)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"×{v:.2f}"))
        ax.set_ylabel("samples/s speedup (×)" if col == 0 else "")
        ax.set_xlabel(xlabel)
        if logx:
            ax.set_xscale("log", base=2)
        if not numeric:
            ax.tick_params(axis="x", rotation=20)
        ax.legend(fontsize=7)
    kinds = set(runs["source"])
    kind = MODEL_ESTIMATE if "measured" not in kinds else ", ".join(map(_kind, sorted(kinds)))
    fig.suptitle(f"{title} ({kind})\nimbalance (top; band = range over seeds) and samples/s "
                 "speedup over the baseline (bottom; 1.0 = baseline)", fontsize=11)
    fig.tight_layout()
    return fig


def p_sweep(inp: FigureInputs) -> plt.Figure:
    return _sweep_figure(inp, "p", "exponent p of the compute budget B·S^p ≤ M_comp")


def m_comp_sweep(inp: FigureInputs) -> plt.Figure:
    return _sweep_figure(inp, "m_comp", "M_comp as a multiple of the calibrated budget",
                         logx=True)


def world_size_scaling(inp: FigureInputs) -> plt.Figure:
    return _sweep_figure(inp, "world_size", "world size N (ranks, log scale)", logx=True)


def mixture_sweep(inp: FigureInputs) -> plt.Figure:
    return _sweep_figure(inp, "mixture", "data mixture")


def kernel_bandwidth(inp: FigureInputs) -> plt.Figure:
    """Achieved bandwidth of each LN-modulate implementation against the copy ceiling.
    Nothing measured (no CUDA) is no figure: a UserError with the reason, which the kernel
    table gives instead."""
    title = "Fused LayerNorm-Modulate (dense batches): achieved bandwidth vs copy ceiling"
    bench, reason = kernel_measurements(inp.kernel_bench)
    if bench is None:
        raise UserError(f"kernel_bandwidth: nothing was measured ({reason}); the kernel "
                        "table says so, draw this figure only from a measured benchmark")
    bench = bench[bench["gbps"].notna()]
    if "layout" in bench.columns:  # the packed (segment) shapes are in the table, not here
        bench = bench[bench["layout"].fillna("dense") == "dense"]
    dims = sorted(set(bench["D"]))
    phases = [p for p in ("fwd", "bwd", "fwd_bwd") if p in set(bench["phase"])]
    copy = bench[bench["phase"] == "copy"]
    impls = sorted(set(bench["impl"]) - {"copy"})  # one colour per implementation throughout
    impl_colors = dict(zip(impls, sns.color_palette("dark", len(impls)), strict=True))
    fig, axes = plt.subplots(len(dims), len(phases), squeeze=False, sharey=True,
                             figsize=(4.5 * len(phases), 4.6 * len(dims)))
    for i, dim in enumerate(dims):
        for j, phase in enumerate(phases):
            ax = axes[i, j]
            sel = bench[(bench["D"] == dim) & (bench["phase"] == phase)]
            sns.lineplot(data=sel, x="S", y="gbps", hue="impl", marker="o", ax=ax,
                         hue_order=[i for i in impls if i in set(sel["impl"])],
                         palette=impl_colors)
            ceiling = copy[copy["D"] == dim]["gbps"]
            if not ceiling.empty:
                ax.axhline(ceiling.max(), color="k", ls="--", lw=0.8, label="copy ceiling")
            ax.set(xscale="log", xlabel="tokens S", ylabel="achieved GB/s",
                   title=f"D={dim}, {phase.replace('_', '+')}")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.legend(fontsize=7)
    device = bench["device"].iloc[0] if "device" in bench.columns else "unknown device"
    fig.suptitle(f"{title} [measured ({device})]")
    fig.tight_layout()
    return fig


# the world sizes `load_vs_lower_bound` compares: a step of few ranks, and one of many
BOUND_WORLD_SIZES = (16, 256)


def load_vs_lower_bound(inp: FigureInputs) -> plt.Figure:
    """Each rank's predicted compute per step against the step's lower bound, one panel per
    policy and world size (N = 16 and 256): the simulation of each N that comes first
    (measured calibrations first), its first seed, steps sorted by their bound."""
    title = f"Per-rank predicted load per step vs the step's lower bound ({MODEL_ESTIMATE})"
    runs = inp.runs[inp.runs["setup"].str.startswith("sim/")]
    runs = runs[runs["world_size"].isin(BOUND_WORLD_SIZES)]
    steps = inp.steps[inp.steps["lower_bound_s"].notna()]
    if runs.empty or steps.empty:
        sizes = " or ".join(map(str, BOUND_WORLD_SIZES))
        return _placeholder(title, f"no simulation at N = {sizes}")
    runs = runs.assign(measured=runs["label"].str.contains("measured calibration"))
    picked = (runs.sort_values(["measured", "setup", "variant"], ascending=[False, True, True])
              .drop_duplicates("world_size").sort_values("world_size"))
    policies = policy_order(runs["policy"])
    fig, axes = plt.subplots(len(policies), len(picked), squeeze=False, sharey="col",
                             figsize=(6 * len(picked), max(1.2 + 2.1 * len(policies),
                                                           6 * len(picked) / MAX_ASPECT)))
    for col, group in enumerate(picked.itertuples()):
        for row, policy in enumerate(policies):
            ax = axes[row, col]
            mine = runs[(runs["setup"] == group.setup) & (runs["variant"] == group.variant)
                        & (runs["policy"] == policy)]
            if mine.empty:
                ax.axis("off")
                continue
            run = mine.sort_values("seed").iloc[0]
            sel = steps[(steps["setup"] == run["setup"]) & (steps["variant"] == run["variant"])
                        & (steps["policy"] == policy) & (steps["seed"] == run["seed"])]
            _load_panel(ax, sel, run)
            ax.set_title(_wrap(f"{policy}, N = {group.world_size}: {group.setup} "
                               f"{'' if group.variant == 'base' else group.variant} "
                               f"[{run['label']}]\n{ax.get_title()}", 60), fontsize=8)
            ax.set_ylabel("compute per rank (s)" if col == 0 else "")
        axes[-1, col].set_xlabel("step (sorted by its lower bound)")
    fig.suptitle(f"{title}: dots = ranks, line = bound (no packing of the step's samples "
                 "is faster), seed of each first run", fontsize=11)
    fig.tight_layout()
    return fig


def _load_panel(ax: plt.Axes, steps: pd.DataFrame, run: pd.Series) -> None:
    """One run's ranks per step (dots) against the step bound (line), steps in bound order;
    the title says how far the summed critical path is above the summed bound."""
    bound = steps.groupby("step")["lower_bound_s"].first().sort_values()
    x = pd.Series(np.arange(bound.size), index=bound.index)
    ax.scatter(x[steps["step"]], steps["compute_s"], s=3, alpha=0.35,
               color=policy_color(run["policy"]), linewidths=0)
    ax.plot(x.to_numpy(), bound.to_numpy(), color="k", lw=1.0)
    ratio = steps.groupby("step")["compute_s"].max().sum() / bound.sum()
    ax.set_title(f"{bound.size} steps, critical path {ratio:.3f}x the bound, imbalance "
                 f"{100 * run['imbalance_rate']:.1f}%")
    ax.set_ylim(bottom=0)


# the steps `sp_groups` draws of each run (the first ones: a plan's steps are shuffled)
GROUP_STEPS = 48


def sp_groups(inp: FigureInputs) -> plt.Figure:
    """Which ranks run together and how long, per step: for the first simulation whose plans
    hold sequence-parallel groups, at its smallest world size, one column per policy (its
    first seed): each rank's group degree (top) and its predicted compute (bottom) over the
    first GROUP_STEPS steps, ranks across."""
    title = (f"Sequence-parallel groups: each rank's degree and predicted load per step "
             f"({MODEL_ESTIMATE})")
    steps = inp.steps
    if SP_DEGREE not in steps.columns or not (steps[SP_DEGREE] > 1).any():
        return _placeholder(title, "no simulation planned sequence-parallel groups")
    grouped = steps.loc[steps[SP_DEGREE] > 1, ["setup", "variant"]].drop_duplicates()
    with_groups = inp.runs.merge(grouped, on=["setup", "variant"])
    first = with_groups.sort_values(["setup", "world_size", "variant"]).iloc[0]
    sel = steps[(steps["setup"] == first["setup"]) & (steps["variant"] == first["variant"])]
    runs = inp.runs[(inp.runs["setup"] == first["setup"])
                    & (inp.runs["variant"] == first["variant"])]
    policies = policy_order(runs["policy"])
    fig, axes = plt.subplots(2, len(policies), squeeze=False, sharey=True, layout="constrained",
                             figsize=(min(4.6 * len(policies), MAX_ASPECT * 8), 8))
    top = float(sel["compute_s"].max())
    for col, policy in enumerate(policies):
        run = runs[runs["policy"] == policy].sort_values("seed").iloc[0]
        mine = sel[(sel["policy"] == policy) & (sel["seed"] == run["seed"])]
        mine = mine[mine["step"] < GROUP_STEPS]
        degree = mine.pivot(index="step", columns="rank", values=SP_DEGREE).fillna(1)
        load = mine.pivot(index="step", columns="rank", values="compute_s")
        shown = axes[0, col].imshow(np.log2(degree.to_numpy(np.float64)), aspect="auto",
                                    cmap="viridis", vmin=0, vmax=3, interpolation="nearest")
        axes[0, col].set_title(_wrap(f"{policy}\n[{run['label']}]", 44), fontsize=9)
        heat = axes[1, col].imshow(load.to_numpy(np.float64), aspect="auto", cmap="magma",
                                   vmin=0, vmax=top, interpolation="nearest")
        axes[1, col].set_title(f"imbalance {100 * run['imbalance_rate']:.1f}%, "
                               f"{run['samples_per_s']:.3g} samples/s", fontsize=9)
        for row in (0, 1):
            axes[row, col].set_xlabel("rank")
            axes[row, col].grid(False)
        axes[0, col].set_ylabel("step" if col == 0 else "")
        axes[1, col].set_ylabel("step" if col == 0 else "")
    bar = fig.colorbar(shown, ax=axes[0, :].tolist(), ticks=[0, 1, 2, 3])
    bar.ax.set_yticklabels(["1", "2", "4", "8"])
    bar.set_label("degree of the rank's group")
    fig.colorbar(heat, ax=axes[1, :].tolist()).set_label("predicted compute per rank (s)")
    fig.suptitle(f"{title}: {first['setup']}, N = {first['world_size']}", fontsize=11)
    return fig


FIGURES: dict[str, Callable[[FigureInputs], plt.Figure]] = {
    "mixture_tokens": mixture_tokens,
    "compute_heatmap": compute_heatmap,
    "imbalance_distribution": imbalance_distribution,
    "throughput": throughput,
    "vram_utilization": vram_utilization,
    "calibration_fit": calibration_fit,
    "p_sweep": p_sweep,
    "m_comp_sweep": m_comp_sweep,
    "world_size_scaling": world_size_scaling,
    "mixture_sweep": mixture_sweep,
    "kernel_bandwidth": kernel_bandwidth,
    "load_vs_lower_bound": load_vs_lower_bound,
    "sp_groups": sp_groups,
}


def convergence(inp: FigureInputs) -> plt.Figure:
    """Validation loss against samples seen, optimizer steps and training time, per policy:
    the mean over seeds on a common grid of each axis, with the seeds' range as a band."""
    from adaptiveload.analysis.convergence import AXES, curves

    curve = curves(inp.steps) if "val_loss" in inp.steps else pd.DataFrame()
    if curve.empty:
        return _placeholder("Validation loss", "no run scored a validation set (val_every: 0)")
    groups = curve.groupby(["setup", "variant", "kernel"], sort=True)
    size = (5 * len(AXES), 5.0 * len(groups))
    fig, axes = plt.subplots(len(groups), len(AXES), figsize=size, squeeze=False)
    for row, ((setup, variant, kernel), group) in zip(axes, groups, strict=True):
        for ax, (x, label) in zip(row, AXES.items(), strict=True):
            for policy in policy_order(group["policy"]):
                _seed_band(ax, group[group["policy"] == policy], x, policy)
            ax.set_xlabel(label)
            ax.set_ylabel("validation loss")
            where = f"{group_name(setup, kernel)} / {variant}"
            mode = f"steps per epoch: {group['steps_per_epoch'].iloc[0]}"
            ax.set_title(f"{_label(group)}\n{where} ({mode})", fontsize=9)
        row[0].legend(fontsize=8)
    fig.suptitle("Does the policy change what the model learns? Held-out loss (seed band: min-max)")
    fig.tight_layout()
    return fig


def _seed_band(ax: plt.Axes, runs: pd.DataFrame, x: str, policy: str) -> None:
    """The mean over seeds of val_loss interpolated on a grid of `x` that every seed covers,
    and the band of its seeds' min and max."""
    by_seed = [run for _, run in runs.groupby("seed")]
    grid = np.linspace(max(r[x].min() for r in by_seed), min(r[x].max() for r in by_seed), 60)
    ys = np.array([np.interp(grid, r[x], r["val_loss"]) for r in by_seed])
    color = policy_color(policy)
    ax.plot(grid, ys.mean(axis=0), color=color, label=f"{policy} (n={len(by_seed)} seeds)")
    ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=color, alpha=0.2, lw=0)


FIGURES["convergence"] = convergence


def render(name: str, inputs: FigureInputs, path: Path) -> Path:
    """Draw figure `name` and save it as PNG (atomically)."""
    from adaptiveload.io import atomic_path

    sns.set_theme(style="whitegrid", context="notebook")
    fig = FIGURES[name](inputs)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    plt.close(fig)
    return path
