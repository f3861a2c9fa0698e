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


def _stat(stats: pd.DataFrame, key: tuple, metric: str, test: str) -> pd.Series | None:
    if stats.empty:
        return None
    sel = stats
    for col, value in zip(KEYS, key, strict=True):
        sel = sel[sel[col] == value]
    sel = sel[(sel["metric"] == metric) & (sel["test"] == test)]
    return sel.iloc[0] if len(sel) else None


def paper_table(
    runs: pd.DataFrame, steps: pd.DataFrame, stats: pd.DataFrame, baseline: str = "equal-token",
    extra_rows: pd.DataFrame | None = None,
) -> Table:
    """One row per (setup, kernel, policy) of the base (non-sweep) runs, seeds averaged; then
    `extra_rows` in the same columns (the paper map's paper-consistent settings, whose setup
    says so), which carry their own changes and no confidence intervals."""
    base_runs = runs[runs["variant"] == "base"]
    runs_v = _vram_per_run(base_runs, steps[steps["variant"] == "base"])
    rows = []
    for key, group in runs_v.groupby(KEYS, sort=True):
        setup, _, kernel, policy = key
        row = {
            "setup": setup, "kernel": kernel, "policy": policy,
            "label": ", ".join(sorted(set(group["label"]))),
            "world_size": int(group["world_size"].iloc[0]),
            "seeds": len(group),
            "timed_steps_min": int(group["timed_steps"].min()),
            "timed_steps_max": int(group["timed_steps"].max()),
            "imbalance_rate": group["imbalance_rate"].mean(),
            "imbalance_rate_sd": group["imbalance_rate"].std(ddof=1),
            "idle_fraction": group["idle_fraction"].mean(),
            "vram_utilization": group["vram_utilization"].mean(),
            "vram_source": ", ".join(sorted(set(group["vram_source"]) - {""})),
            "samples_per_s": group["samples_per_s"].mean(),
            "tokens_per_s": group["tokens_per_s"].mean(),
        }
        ratio = _stat(stats, key, "samples_per_s ratio", "bootstrap 95% CI")
        welch = _stat(stats, key, "samples_per_s", "Welch's t")
        imb = _stat(stats, key, "imbalance_rate difference", "bootstrap 95% CI")
        mwu = _stat(stats, key, "imbalance", "Mann-Whitney U")
        row.update({
            "throughput_change": ratio.estimate - 1 if ratio is not None else np.nan,
            "throughput_change_ci_low": ratio.ci_low - 1 if ratio is not None else np.nan,
            "throughput_change_ci_high": ratio.ci_high - 1 if ratio is not None else np.nan,
            "throughput_p_welch": welch.p_value if welch is not None else np.nan,
            "imbalance_change": imb.estimate if imb is not None else np.nan,
            "imbalance_change_ci_low": imb.ci_low if imb is not None else np.nan,
            "imbalance_change_ci_high": imb.ci_high if imb is not None else np.nan,
            "imbalance_p_mwu": mwu.p_value if mwu is not None else np.nan,
        })
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


def _shown(n: pd.DataFrame, baseline: str) -> pd.DataFrame:
    is_base = n["policy"] == baseline
    return pd.DataFrame({
        "setup": n["setup"],
        "kernel": n["kernel"],
        "policy": n["policy"],
        "source": n["label"],
        "seeds": n["seeds"],
        "timed steps/seed": [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in
                             zip(n["timed_steps_min"], n["timed_steps_max"], strict=True)],
        "imbalance rate": n["imbalance_rate"].map(_pct),
        "idle fraction": n["idle_fraction"].map(_pct),
        "VRAM util. (mean)": [f"{_pct(v)} ({s})" if s else "" for v, s in
                              zip(n["vram_utilization"], n["vram_source"], strict=True)],
        "samples/s": n["samples_per_s"].map(lambda x: f"{x:.4g}"),
        "tokens/s": n["tokens_per_s"].map(lambda x: f"{x:.4g}"),
        "Δ samples/s [95% CI], p": [
            "baseline" if b else _ci(e, lo, hi, p) for b, e, lo, hi, p in zip(
                is_base, n["throughput_change"], n["throughput_change_ci_low"],
                n["throughput_change_ci_high"], n["throughput_p_welch"], strict=True)],
        "Δ imbalance [95% CI], p": [
            "baseline" if b else _ci(e, lo, hi, p, pp=True) for b, e, lo, hi, p in zip(
                is_base, n["imbalance_change"], n["imbalance_change_ci_low"],
                n["imbalance_change_ci_high"], n["imbalance_p_mwu"], strict=True)],
        "Δ VRAM util. (relative)": ["baseline" if b else _pct(v, signed=True)
                                    for b, v in zip(is_base, n["vram_change"], strict=True)],
        "paper: imbalance": n["paper_imbalance_rate"],
        "paper: Δ VRAM util.": n["paper_vram_change"],
        "paper: Δ throughput": n["paper_throughput_change"],
    })


PAPER_NOTE = (
    "Means over seeds of timed steps (after warm-up; `timed steps/seed` says how many, each "
    "over all ranks). Δ = policy vs the equal-token baseline of "
    "the same setup and kernel: throughput as relative change of samples/s with a bootstrap 95% "
    "CI (steps resampled within runs) and Welch's t p-value on per-step samples/s; imbalance as "
    "difference in percentage points with a bootstrap CI and Mann-Whitney U p-value on per-step "
    "imbalance; VRAM utilization as relative change. `source` says whether numbers are measured "
    "(and on which device) or come from the cost model. The paper's numbers (arXiv 2605.17923, "
    "Wan 2.1, 16 GPUs) are shown beside ours; its exact metric definitions are not published."
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
