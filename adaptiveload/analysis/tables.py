"""The paper's table, reproduced: per (setup, kernel, policy) the balance, memory and throughput
metrics, the change vs the baseline with its 95% CI and p-value, the measured/model label, and
the paper's own numbers side by side. Plus the kernel table from the kernel benchmark.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload.analysis.aggregate import per_step
from adaptiveload.analysis.stats import LEVELS, headline
from adaptiveload.experiment import schema_default
from adaptiveload.step_table import WHOLE_EPOCH

# arXiv 2605.17923 (abstract; 16 GPUs per a secondary source): what the paper reports
PAPER = {
    "equal-token": {"paper_imbalance_rate": "39%", "paper_vram_change": "",
                    "paper_throughput_change": ""},
    "adaptiveload": {"paper_imbalance_rate": "18.9%", "paper_vram_change": "+22.7%",
                     "paper_throughput_change": "+27.2%"},
}
KEYS = ["setup", "variant", "kernel", "policy"]


@dataclass(frozen=True)
class Table:
    """`numbers` (machine-readable, for the CSV) and `shown` (formatted, for md/html)."""

    numbers: pd.DataFrame
    shown: pd.DataFrame

    def write(self, stem: Path, title: str, note: str) -> list[Path]:
        from adaptiveload.io import write_text

        paths = [stem.with_suffix(s) for s in (".csv", ".md", ".html")]
        write_text(paths[0], self.numbers.to_csv(index=False))
        md = self.shown.to_markdown(index=False) if not self.shown.empty else "(no rows)"
        write_text(paths[1], f"# {title}\n\n{note}\n\n{md}\n")
        html = self.shown.to_html(index=False, border=0, na_rep="")
        write_text(paths[2], f"<h3>{title}</h3>\n<p>{note}</p>\n{html}\n")
        return paths


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
        for prefix, metric, offset in (
            ("throughput_change", "samples_per_s ratio", 1.0),
            ("wall_throughput_change", "samples_per_s_wall ratio", 1.0),
            ("imbalance_change", "imbalance_rate difference", 0.0),
        ):
            found = _stat(stats, key, metric)
            values = ((found.estimate - offset, found.ci_low - offset, found.ci_high - offset,
                       found.p_value) if found is not None else (np.nan,) * 4)
            row.update(zip((prefix, f"{prefix}_ci_low", f"{prefix}_ci_high", f"{prefix}_p"),
                           values, strict=True))
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


def _pct(x: float, signed: bool = False) -> str:
    if not np.isfinite(x):
        return ""
    return f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def _ci(est: float, lo: float, hi: float, p: float, pp: bool = False) -> str:
    if not np.isfinite(est):
        return ""
    unit, scale = (" pp", 100) if pp else ("%", 100)
    if not (np.isfinite(lo) and np.isfinite(hi)):  # a model setting: no spread to show
        return f"{scale * est:+.1f}{unit}"
    text = f"{scale * est:+.1f}{unit} [{scale * lo:+.1f}, {scale * hi:+.1f}]"
    return text + (f", p={p:.2g}" if np.isfinite(p) else "")


def _changes(n: pd.DataFrame, prefix: str, is_base: pd.Series, pp: bool = False) -> list[str]:
    cols = [n[c] for c in (prefix, f"{prefix}_ci_low", f"{prefix}_ci_high", f"{prefix}_p")]
    return ["baseline" if b else _ci(*v, pp=pp) for b, *v in zip(is_base, *cols, strict=True)]


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
    "Means over seeds of timed steps (after warm-up; `timed steps/seed` says how many, each "
    "over all ranks; `(1 epoch)`: one whole epoch, the same samples for every policy, so the "
    "bootstrap resamples only those steps' times). `source` says whether numbers are "
    "measured, with which clock and on which device, or come from the cost model. Imbalance, "
    "idle fraction and samples/s use that clock: on a CPU the thread CPU time of the one "
    "thread that computes each emulated rank (other processes on the machine do not enter "
    "it), samples/s = real samples (each sample of the data once; `padding` is the share of "
    "processed samples that were padding repeats, never counted as throughput) / summed step "
    "critical path (slowest rank's load + compute, plus "
    "the optimizer step); `samples/s (wall clock)` is the same over wall-clock step times. "
    "`steps/epoch` (least-most over seeds) and `samples/step`, `tokens/step` (mean ± population "
    "std over the timed optimizer steps of the real samples and tokens each trained on, all "
    "ranks together) give each policy's global batch: a policy with fewer steps per epoch "
    "trains with larger batches, which a Δ samples/s does not show. `micro-batches beyond "
    "measured memory` (plans through a calibration that measured memory): micro-batches with "
    "more tokens than its largest measured one, whose memory is the fit's extrapolation. "
    "Δ = policy vs the equal-token baseline (first row) of the same setup and kernel: "
    "throughput as relative change of samples/s, imbalance as difference in percentage "
    "points, each with a 95% CI and a two-sided p-value from the same bootstrap, named in "
    "`CI and p from` (seeds, then steps within runs when there are >= 2 seeds; else steps "
    "within runs); stats.md has both kinds and the per-step tests. `vs lower bound` (model, "
    "simulations): summed step compute over the sum of each step's lower bound, max(c0 + "
    "max(mean over ranks, costliest sample), t_floor) of its samples: 1.000 = no packing of "
    "those steps' samples could be faster. VRAM utilization as "
    "relative change. The paper's numbers (arXiv 2605.17923, Wan 2.1, 16 GPUs) are shown "
    "beside ours; its exact metric definitions are not published."
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
