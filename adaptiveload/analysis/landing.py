"""The numbers a reader meets first: each policy's samples/s speedup over the baseline and its
imbalance, per setup, generated from the statistics and the runs (never typed), with the
paper's own numbers beside them. The Snakemake report opens on this text (`landing`), the
throughput figure draws the same speedups (`speedups`, `seed_spread`).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from adaptiveload.analysis.paper_map import PAPER
from adaptiveload.analysis.stats import headline
from adaptiveload.pipeline import BASE_VARIANT
from adaptiveload.planning.policies import POLICIES

# the samples/s speedup the paper reports for AdaptiveLoad over equal-token bucketing
PAPER_SPEEDUP = 1 + PAPER["throughput_change"]
PAPER_TEXT = (f"the paper (Wan 2.1, 16 GPUs) reports throughput ×{PAPER_SPEEDUP:.3f}, "
              f"imbalance {100 * PAPER['baseline_imbalance']:.0f}% → "
              f"{100 * PAPER['adaptiveload_imbalance']:.1f}%, peak VRAM utilization "
              f"+{100 * PAPER['vram_change']:.1f}%")


def policy_order(policies) -> list[str]:
    """`policies` once each, in the order every table and figure shows them: POLICIES' order
    (the baseline first), then any other."""
    present = list(dict.fromkeys(policies))
    return [p for p in POLICIES if p in present] + [p for p in present if p not in POLICIES]


def group_name(setup: str, kernel: str) -> str:
    """'setup / kernel', or just the setup where no kernel ran (simulations: 'none')."""
    return setup if kernel in ("none", "", None) else f"{setup} / {kernel}"


def speedups(stats: pd.DataFrame) -> pd.DataFrame:
    """The samples/s ratio policy / baseline of every comparison of the base variant: one row
    per setup, kernel and policy, with its interval (NaN where there is none: simulations),
    and `group` (`group_name`)."""
    rows = headline(stats)
    rows = rows[(rows["metric"] == "samples_per_s ratio") & (rows["variant"] == BASE_VARIANT)]
    return rows.assign(group=[group_name(s, k) for s, k in zip(rows["setup"], rows["kernel"],
                                                                strict=True)])


def seed_spread(row: pd.Series) -> tuple[float, float]:
    """Min and max over seeds of a policy's per-seed ratio to the baseline (the spread a
    simulation shows instead of an interval), as its stats row carries them; NaN with fewer
    than two seeds."""
    if row["n_policy"] < 2:
        return np.nan, np.nan
    return row["seed_min"], row["seed_max"]


def _interval(row: pd.Series) -> str:
    if np.isfinite(row["ci_low"]) and np.isfinite(row["ci_high"]):
        return f" [95% CI {row['ci_low']:.2f}, {row['ci_high']:.2f}]"
    low, high = seed_spread(row)
    return f" (seeds {low:.2f}–{high:.2f})" if np.isfinite(low) else ""


def _number(value: float) -> str:
    """Four significant digits, trailing zeros kept (0.9350, 230.1, 12.00)."""
    return f"{value:#.4g}".rstrip(".")


def headline_lines(runs: pd.DataFrame, stats: pd.DataFrame) -> list[str]:
    """One bullet per setup and kernel (measured first): every policy with its mean samples/s
    and imbalance over seeds, each but the baseline with its speedup and interval."""
    base = runs[runs["variant"] == BASE_VARIANT]
    ratios = speedups(stats)
    lines = []
    groups = base.groupby(["setup", "kernel"], sort=False)
    order = sorted(groups.groups, key=lambda g: (not g[0].startswith("train"), g))
    for setup, kernel in order:
        mine = groups.get_group((setup, kernel))
        label, seeds = mine["label"].iloc[0], mine["seed"].nunique()
        parts = []
        for policy in policy_order(mine["policy"]):
            sel = mine[mine["policy"] == policy]
            text = (f"**{policy}** {_number(sel['samples_per_s'].mean())} samples/s, imbalance "
                    f"{100 * sel['imbalance_rate'].mean():.1f}%")
            ratio = ratios[(ratios["setup"] == setup) & (ratios["kernel"] == kernel)
                           & (ratios["policy"] == policy)]
            if not ratio.empty:
                row = ratio.iloc[0]
                text += f", ×{row['estimate']:.2f}{_interval(row)}"
            else:
                text += " (baseline)"
            parts.append(text)
        lines.append(f"- ``{group_name(setup, kernel)}``, {label}, {seeds} seed(s): "
                     + "; ".join(parts))
    return lines


def landing(template: str, runs: pd.DataFrame, stats: pd.DataFrame,
            kernel_reason: str | None) -> str:
    """The report's landing text: `template` (the workflow's description), then the headline
    numbers, where the statistics are, and why the kernel has no figure if it has none."""
    lines = [template.rstrip(), "", "Headline numbers", "----------------", "",
             "Samples/s speedup (×) of each policy over the baseline, measured runs with a 95% "
             "confidence interval, model estimates (simulations) with their seeds' min–max; "
             f"means over seeds. For comparison, {PAPER_TEXT}.", "",
             *headline_lines(runs, stats), "",
             "Every test behind these numbers is in ``tables/stats.csv`` (Tables).", ""]
    if kernel_reason is not None:
        lines += [f"The fused kernel was not measured ({kernel_reason}): no bandwidth "
                  "figure; ``kernel_table`` says so.", ""]
    return "\n".join(lines)
