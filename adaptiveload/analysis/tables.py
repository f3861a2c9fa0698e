"""The full table (the appendix beside the headline tables of `analysis.headline`): per
(setup, kernel, policy) the balance, memory and throughput metrics, the change vs the baseline
(measured: 95% t interval over seeds and sign-flip p; model: the range over seeds), the
measured/model label, and the paper's own numbers side by side. Columns that hold one value in
every row move to the caption. Plus the kernel table from the kernel benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload.analysis.aggregate import per_step
from adaptiveload.analysis.paper_map import PAPER as PAPER_NUMBERS
from adaptiveload.analysis.stats import LEVELS, describe, headline
from adaptiveload.experiment import schema_default
from adaptiveload.step_table import WHOLE_EPOCH

# arXiv 2605.17923 (abstract; 16 GPUs per a secondary source): what the paper reports, per
# policy, from its one home (`analysis.paper_map.PAPER`)
PAPER = {
    "equal-token": {"paper_imbalance_rate": f"{PAPER_NUMBERS['baseline_imbalance']:.0%}",
                    "paper_vram_change": "", "paper_throughput_change": ""},
    "adaptiveload": {"paper_imbalance_rate": f"{PAPER_NUMBERS['adaptiveload_imbalance']:.1%}",
                     "paper_vram_change": f"{PAPER_NUMBERS['vram_change']:+.1%}",
                     "paper_throughput_change": f"{PAPER_NUMBERS['throughput_change']:+.1%}"},
}
KEYS = ["setup", "variant", "kernel", "policy"]


@dataclass(frozen=True)
class Table:
    """`numbers` (machine-readable, for the CSV) and `shown` (formatted, for md/html)."""

    numbers: pd.DataFrame
    shown: pd.DataFrame

    def write(self, stem: Path, title: str, note: str) -> list[Path]:
        """csv (every column), md and a UTF-8 html (columns of one value in every row moved
        to the note)."""
        from adaptiveload.io import write_text

        paths = [stem.with_suffix(s) for s in (".csv", ".md", ".html")]
        write_text(paths[0], self.numbers.to_csv(index=False))
        shown, constant = _without_constant_columns(self.shown)
        if constant:
            note = f"{note} Every row: {constant}."
        md = shown.to_markdown(index=False) if not shown.empty else "(no rows)"
        write_text(paths[1], f"# {title}\n\n{note}\n\n{md}\n")
        html = shown.to_html(index=False, border=0, na_rep="")
        write_text(paths[2], f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>'
                             f"{title}</title></head><body>\n<h3>{title}</h3>\n<p>{note}</p>"
                             f"\n{html}\n</body></html>\n")
        return paths


def _without_constant_columns(shown: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """`shown` less the columns that hold one value in every row (of 2 or more rows), and
    'column: value; ...' of those."""
    if len(shown) < 2:
        return shown, ""
    constant = [c for c in shown.columns if shown[c].astype(str).nunique() == 1]
    text = "; ".join(f"{c}: {shown[c].iloc[0]}" for c in constant if str(shown[c].iloc[0]))
    return shown.drop(columns=constant), text


def _vram_per_run(runs: pd.DataFrame, steps: pd.DataFrame) -> pd.DataFrame:
    """Mean VRAM utilization per run and where it comes from: the summary's (measured on a GPU,
    or predicted by a simulation), else the cost model's per-step peak-memory estimate over the
    device capacity. Anything not measured is labelled `model`. Also the number of timed steps
    of each run: what its numbers rest on."""
    step_table = per_step(steps)
    per_run = step_table.groupby([*KEYS, "seed"])
    model = pd.concat([per_run["vram_util_model"].mean().rename("vram_model"),
                       per_run.size().rename("timed_steps")], axis=1).reset_index()
    out = runs.merge(model, on=[*KEYS, "seed"], how="left")
    out["timed_steps"] = out["timed_steps"].fillna(0).astype(int)
    summary = out["vram_utilization_mean"].notna()
    out["vram_utilization"] = np.where(summary, out["vram_utilization_mean"], out["vram_model"])
    measured = summary & (out["source"] == "measured")
    out["vram_source"] = np.where(measured, "measured",
                                  np.where(out["vram_utilization"].notna(), "model", ""))
    return out


# the per-run summary fields of a row's global batch and padding, each a mean over its seeds
BATCH_COLUMNS = (
    "padding_fraction",
    "samples_per_step_mean",
    "samples_per_step_std",
    "tokens_per_step_mean",
    "tokens_per_step_std",
    "micro_batches_beyond_measured_memory",
)


def _batch_columns(group: pd.DataFrame) -> dict[str, float]:
    """A row's steps per epoch (least and most over its seeds) and BATCH_COLUMNS (means over
    its seeds): how large a global batch each policy trains with, and how much padding."""
    out = {c: group[c].mean() for c in BATCH_COLUMNS}
    out["epoch_steps_min"] = group["epoch_steps"].min()
    out["epoch_steps_max"] = group["epoch_steps"].max()
    return out


def _stat(stats: pd.DataFrame, key: tuple, metric: str) -> pd.Series | None:
    if stats.empty:
        return None
    sel = stats
    for col, value in zip(KEYS, key, strict=True):
        sel = sel[sel[col] == value]
    sel = sel[sel["metric"] == metric]
    return sel.iloc[0] if len(sel) else None


def paper_table(
    runs: pd.DataFrame, steps: pd.DataFrame, stats: pd.DataFrame,
    baseline: str = schema_default("analysis.baseline"),
    extra_rows: pd.DataFrame | None = None,
) -> Table:
    """One row per (setup, kernel, policy) of the base (non-sweep) runs, seeds averaged, the
    baseline first in each setup; then `extra_rows` in the same columns (the paper map's
    paper-consistent settings, whose setup says so), which carry their own changes and no
    confidence intervals."""
    base_runs = runs[runs["variant"] == "base"]
    runs_v = _vram_per_run(base_runs, steps[steps["variant"] == "base"])
    runs_v = runs_v.assign(later=(runs_v["policy"] != baseline).astype(int))
    stats = headline(stats) if not stats.empty else stats
    rows = []
    order = ["setup", "variant", "kernel", "later", "policy"]
    for (setup, variant, kernel, _, policy), group in runs_v.groupby(order, sort=True):
        key = (setup, variant, kernel, policy)
        row = {
            "setup": setup, "kernel": kernel, "policy": policy,
            "label": ", ".join(sorted(set(group["label"]))),
            "world_size": int(group["world_size"].iloc[0]),
            "seeds": len(group),
            "timed_steps_min": int(group["timed_steps"].min()),
            "timed_steps_max": int(group["timed_steps"].max()),
            "timed_window": ", ".join(sorted(set(group["timed_window"]))),
            "imbalance_rate": group["imbalance_rate"].mean(),
            "imbalance_rate_sd": group["imbalance_rate"].std(ddof=1),
            "idle_fraction": group["idle_fraction"].mean(),
            "vram_utilization": group["vram_utilization"].mean(),
            "vram_source": ", ".join(sorted(set(group["vram_source"]) - {""})),
            "samples_per_s": group["samples_per_s"].mean(),
            "tokens_per_s": group["tokens_per_s"].mean(),
            "samples_per_s_wall": group["samples_per_s_wall"].mean(),
            "vs_lower_bound": group["vs_lower_bound"].mean(),
            "vs_epoch_lower_bound": group["vs_epoch_lower_bound"].mean(),
            **_batch_columns(group),
            "steps_per_epoch": ", ".join(sorted(set(group["steps_per_epoch"]))),
            "min_steps_per_epoch": group["min_steps_per_epoch"].mean(),
        }
        shown = _stat(stats, key, "imbalance_rate difference")
        row["ci_kind"] = LEVELS[shown.test] if shown is not None else ""
        row["host_load"] = group["host_load_mean"].mean() if "host_load_mean" in group else np.nan
        for prefix, metric in CHANGES.items():
            found = _stat(stats, key, metric)
            offset = 1.0 if metric.endswith("ratio") else 0.0
            for field, column in _CHANGE_FIELDS.items():
                value = found[field] if found is not None else np.nan
                shift = offset if field in _ON_SCALE and found is not None else 0.0
                row[column.format(prefix)] = value - shift if shift else value
        rows.append(row)
    numbers = pd.DataFrame(rows)
    if not numbers.empty:
        base = numbers[numbers["policy"] == baseline].set_index(["setup", "kernel"])
        vram_base = numbers.apply(
            lambda r: base["vram_utilization"].get((r["setup"], r["kernel"]), np.nan), axis=1)
        numbers["vram_change"] = numbers["vram_utilization"] / vram_base - 1
    if extra_rows is not None and len(extra_rows):
        numbers = pd.concat([numbers, extra_rows], ignore_index=True)
    if numbers.empty:
        return Table(numbers, numbers)
    for col in ("paper_imbalance_rate", "paper_vram_change", "paper_throughput_change"):
        numbers[col] = numbers["policy"].map(lambda p, c=col: PAPER.get(p, {}).get(c, ""))
    return Table(numbers, _shown(numbers, baseline))


# the changes vs the baseline the full table shows: column prefix -> stats.csv metric; a
# ratio is stored as a relative change (ratio - 1), a difference as is
CHANGES = {"throughput_change": "samples_per_s ratio",
           "wall_throughput_change": "samples_per_s_wall ratio",
           "imbalance_change": "imbalance_rate difference"}
# stats.csv field -> the full table's column (`{}`: the prefix); the first five on the scale
_CHANGE_FIELDS = {"estimate": "{}", "ci_low": "{}_ci_low", "ci_high": "{}_ci_high",
                  "seed_min": "{}_seed_min", "seed_max": "{}_seed_max", "p_value": "{}_p",
                  "agree": "{}_agree", "n_policy": "{}_seeds", "test": "{}_test"}
_ON_SCALE = ("estimate", "ci_low", "ci_high", "seed_min", "seed_max")


def _pct(x: float, signed: bool = False) -> str:
    if not np.isfinite(x):
        return ""
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def _changes(n: pd.DataFrame, prefix: str, is_base: pd.Series, pp: bool = False) -> list[str]:
    """Each row's change as `stats.describe` words it (relative change of a ratio in %, a
    difference in pp); empty where there is none (the paper map's rows carry their own)."""
    out = []
    for base, (_, row) in zip(is_base, n.iterrows(), strict=True):
        if base:
            out.append("baseline")
            continue
        est = row.get(prefix, np.nan)
        if not isinstance(row.get(f"{prefix}_test"), str) or not np.isfinite(est):
            out.append(f"{100 * est:+.1f}{' pp' if pp else '%'}" if np.isfinite(est) else "")
            continue
        offset = 0.0 if pp else 1.0  # describe() takes the ratio itself
        stat = {field: row[column.format(prefix)] for field, column in _CHANGE_FIELDS.items()}
        stat.update({f: stat[f] + offset for f in _ON_SCALE})
        stat["metric"] = "difference" if pp else "ratio"
        out.append(describe(pd.Series(stat), unit=" pp" if pp else "%"))
    return out


def _steps_range(lo: float, hi: float) -> str:
    """'38' or '36-40'; empty for rows that rest on no steps of ours (the paper map's)."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return ""
    return f"{lo:.0f}" if lo == hi else f"{lo:.0f}-{hi:.0f}"


def _mean_std(n: pd.DataFrame, prefix: str) -> list[str]:
    """'12.5 ± 3.2' per row from `prefix`_mean and `prefix`_std (population std over the
    run's optimizer steps, averaged over seeds); empty where a row has none."""
    pairs = zip(n[f"{prefix}_mean"], n[f"{prefix}_std"], strict=True)
    return [f"{m:.4g} ± {sd:.3g}" if np.isfinite(m) else "" for m, sd in pairs]


def _shown(n: pd.DataFrame, baseline: str) -> pd.DataFrame:
    is_base = n["policy"] == baseline
    return pd.DataFrame({
        "setup": n["setup"],
        "kernel": n["kernel"],
        "policy": n["policy"],
        "source": n["label"],
        "seeds": n["seeds"],
        "timed steps/seed": [
            _steps_range(lo, hi) + (" (1 epoch)" if window == WHOLE_EPOCH else "")
            for lo, hi, window in zip(n["timed_steps_min"], n["timed_steps_max"],
                                      n["timed_window"], strict=True)
        ],
        # free: each policy's own optimizer steps per epoch; match: equal-token's
        "steps mode": n["steps_per_epoch"].fillna(""),
        "imbalance rate": n["imbalance_rate"].map(_pct),
        "idle fraction": n["idle_fraction"].map(_pct),
        "steps/epoch": [_steps_range(lo, hi) for lo, hi in
                        zip(n["epoch_steps_min"], n["epoch_steps_max"], strict=True)],
        "samples/step (mean ± std)": _mean_std(n, "samples_per_step"),
        "tokens/step (mean ± std)": _mean_std(n, "tokens_per_step"),
        "padding": n["padding_fraction"].map(_pct),
        "vs lower bound": n["vs_lower_bound"].map(lambda x: f"{x:.3f}" if np.isfinite(x) else ""),
        "vs epoch bound": n["vs_epoch_lower_bound"].map(
            lambda x: f"{x:.3f}" if np.isfinite(x) else ""),
        "VRAM util. (mean)": [f"{_pct(v)} ({s})" if s else "" for v, s in
                              zip(n["vram_utilization"], n["vram_source"], strict=True)],
        "micro-batches beyond measured memory": n["micro_batches_beyond_measured_memory"].map(
            lambda x: f"{x:.0f}" if np.isfinite(x) else ""),
        "samples/s": n["samples_per_s"].map(lambda x: f"{x:.4g}"),
        "tokens/s": n["tokens_per_s"].map(lambda x: f"{x:.4g}"),
        "samples/s (wall clock)": n["samples_per_s_wall"].map(
            lambda x: f"{x:.4g}" if np.isfinite(x) else ""),
        "host load": n["host_load"].map(lambda x: f"{x:.1f}" if np.isfinite(x) else ""),
        "Δ samples/s [95% CI], p": _changes(n, "throughput_change", is_base),
        "Δ imbalance [95% CI], p": _changes(n, "imbalance_change", is_base, pp=True),
        "Δ samples/s, wall clock [95% CI], p": _changes(n, "wall_throughput_change", is_base),
        "CI and p from": n["ci_kind"].fillna(""),
        "Δ VRAM util. (relative)": ["baseline" if b else _pct(v, signed=True)
                                    for b, v in zip(is_base, n["vram_change"], strict=True)],
        "paper: imbalance": n["paper_imbalance_rate"],
        "paper: Δ VRAM util.": n["paper_vram_change"],
        "paper: Δ throughput": n["paper_throughput_change"],
    })


PAPER_NOTE = (
    "The full table, the appendix to the headline tables (headline.md). Means over seeds of "
    "each run's timed window: measured runs after their warm-up, `(1 epoch)` one whole "
    "epoch, the same samples for every policy; a simulation always its whole epoch (a model "
    "has no warm-up). `source` says whether numbers are measured, with which clock and on "
    "which device, or come from the cost model. Imbalance, idle fraction and samples/s use "
    "that clock: on a CPU the thread CPU time of the one thread that computes each emulated "
    "rank, which a busy machine still slows a little (`host load`: the mean 1-minute load "
    "average over the run's steps; stats.md has the load-adjusted effects). samples/s = real "
    "samples (each sample of the data once; `padding` is the share of processed samples that "
    "were padding repeats, never counted as throughput) / summed step critical path (slowest "
    "rank's load + compute, plus the optimizer step); `samples/s (wall clock)` is the same "
    "over wall-clock step times. `steps/epoch` (least-most over seeds) and `samples/step`, "
    "`tokens/step` (mean ± population std over the optimizer steps) give each policy's "
    "global batch: a policy with fewer steps per epoch trains with larger batches, which a "
    "Δ samples/s does not show. `micro-batches beyond measured memory`: micro-batches with "
    "more tokens than the calibration's largest measured one, whose memory is the fit's "
    "extrapolation. Δ = policy vs the equal-token baseline (first row) of the same setup and "
    "kernel, throughput as relative change of samples/s, imbalance in percentage points: "
    "measured, the geometric mean of the per-seed ratios (mean of the differences) with a "
    "95% t interval over seeds, the exact sign-flip p and the seeds that agree; model, the "
    "estimate and its range over seeds (a prediction has no sampling error, so no CI or p). "
    "`vs lower bound` (model): summed step compute over the sum of each step's own lower "
    "bound. It can read 1.000 for a badly imbalanced plan: it only says no regrouping of the "
    "samples each step already holds could be faster, not that the steps were formed well; "
    "`vs epoch bound` (the epoch's time over the least any plan of the same samples could "
    "take) is the one that compares plans. VRAM utilization as relative change. The paper's "
    "numbers (arXiv 2605.17923, Wan 2.1, 16 GPUs) are shown beside ours; its exact metric "
    "definitions are not published."
)


KERNEL_NOTE = (
    "Median times and achieved bandwidth of the fused op, Wan's eager op sequence and "
    "torch.compile of it, with the copy ceiling measured in the same run (phase `copy`) and "
    "saved-activation bytes (phase `saved`); measured on the device named in each row."
)


def kernel_measurements(bench_csv: Path | None) -> tuple[pd.DataFrame | None, str | None]:
    """The kernel benchmark's measured rows, or None and the reason there are none."""
    if bench_csv is None:
        return None, "the experiment does not benchmark the kernel (kernel.bench: false)"
    if not bench_csv.exists():
        return None, f"{bench_csv} does not exist"
    frame = pd.read_csv(bench_csv)
    if "source" in frame.columns and (frame["source"] == "skipped").all():
        notes = frame["note"].dropna() if "note" in frame.columns else pd.Series(dtype=str)
        return None, notes.iloc[0] if len(notes) else "skipped"
    return frame, None


def kernel_table(bench_csv: Path | None) -> Table:
    """The kernel benchmark as a table, or one row saying why nothing was measured."""
    frame, reason = kernel_measurements(bench_csv)
    if frame is None:
        frame = pd.DataFrame({"status": ["not measured"], "reason": [reason]})
        return Table(frame, frame)
    shown = frame.copy()
    for col in shown.select_dtypes("float").columns:
        shown[col] = shown[col].map(lambda x: f"{x:.4g}")
    return Table(frame, shown)
