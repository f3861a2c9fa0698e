"""The measured table of docs/closed_loop.md (the trainer's closed loop on this CPU), generated
from results/benchmarks/closed_loop_cpu.json (written by tests/bench/bench_closed_loop.py);
tests/repo checks the doc holds what this renders.

    python tests/support/closed_loop_cpu_doc.py   # rewrite the doc's block from the result
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULT = ROOT / "results" / "benchmarks" / "closed_loop_cpu.json"
START, END = "<!-- generated: closed loop cpu table -->", "<!-- end of generated cpu table -->"
# the targets: (a) imbalance from the first refit on within 1.25x the oracle's and
# samples/s above the open loop's (95% CI excluding 1); (b) step time >= 15% below open loop's
IMBALANCE_TARGET, STEP_TARGET = 1.25, 0.85


def _mean(runs: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in runs]))


def _effect(effects: dict, key: str) -> tuple[float, float, float]:
    e = effects[key]
    return e["ratio"], e["ci95"][0], e["ci95"][1]


def table(result: dict[str, Any]) -> str:
    """(a): one row per arm (means over seeds) and the closed loop's paired ratios; (b): one row
    per arm and closed over open; each target said met or not."""
    a, b = result.get("a_wrong_model"), result.get("b_straggler")
    out = []
    if a:
        s, runs = a["setup"], a["runs"]
        out += [
            f"**(a) A wrong cost model** ({s['policy']}, {s['world_size']} emulated ranks, "
            f"{s['num_samples']} {s['mixture']} samples, {s['epochs']} epochs, refit every "
            f"{s['refine_every']} steps, {len(runs['open'])} seeds; {s['timer']}; measured):",
            "",
            "| arm | samples/s | imbalance | imbalance after the 1st refit | model error "
            "median: 1st → last window |",
            "|---|---:|---:|---:|---|",
        ]
        for arm in ("open", "closed", "oracle"):
            err = "–"
            if arm == "closed":
                first = _mean([{"x": r["model_error_median_by_window"][0]} for r in runs[arm]],
                              "x")
                last = _mean([{"x": r["model_error_median_by_window"][-1]} for r in runs[arm]],
                             "x")
                err = f"{first:.0%} → {last:.0%}"
            out.append(
                f"| {arm} | {_mean(runs[arm], 'samples_per_s'):.2f} "
                f"| {_mean(runs[arm], 'imbalance_rate'):.1%} "
                f"| {_mean(runs[arm], 'imbalance_after_first_refit'):.1%} | {err} |")
        sps, lo, hi = _effect(a["effects"], "samples_per_s: closed / open")
        imb, ilo, ihi = _effect(a["effects"], "imbalance_after_first_refit: closed / oracle")
        out += [
            "",
            f"Closed / open samples/s {sps:.3f} (95% CI {lo:.3f}–{hi:.3f}): "
            f"{'met' if lo > 1 else 'not met'} (target: above 1, the CI excluding it). "
            f"Closed / oracle imbalance after the first refit {imb:.2f} (95% CI "
            f"{ilo:.2f}–{ihi:.2f}): {'met' if imb <= IMBALANCE_TARGET else 'not met'} "
            f"(target ≤ {IMBALANCE_TARGET}).",
            "",
        ]
    if b:
        s, runs = b["setup"], b["runs"]
        out += [
            f"**(b) A straggler** ({s['policy']}, {s['launch']}, {s['straggler']}, "
            f"{s['num_samples']} samples, {s['epochs']} epochs, refit every "
            f"{s['refine_every']} steps, {len(runs['open'])} seeds; {s['timer']}; measured):",
            "",
            "| arm | step time (s) | after the 1st refit (s) | imbalance after it "
            "| speed factors (last refit) |",
            "|---|---:|---:|---:|---|",
        ]
        for arm in ("open", "closed"):
            imbalance = _mean(runs[arm], "imbalance_after_first_refit")
            speeds = "–"
            if arm == "closed":
                speeds = ", ".join(
                    f"{v:.2f}" for v in np.mean([r["speed_factors_last"] for r in runs[arm]],
                                                axis=0))
            out.append(
                f"| {arm} | {_mean(runs[arm], 'step_time_s'):.3f} "
                f"| {_mean(runs[arm], 'step_time_after_first_refit_s'):.3f} | {imbalance:.1%} "
                f"| {speeds} |")
        st, lo, hi = _effect(b["effects"], "step_time_after_first_refit_s: closed / open")
        out += [
            "",
            f"Closed / open step time after the first refit {st:.3f} (95% CI {lo:.3f}–"
            f"{hi:.3f}): {'met' if st <= STEP_TARGET else 'not met'} (target ≤ {STEP_TARGET}, "
            "15% below).",
            "",
        ]
    loads = [result["load_average_before"][0], result["load_average_after"][0]]
    out.append(
        f"{result['device']}, {result['date'][:10]}; host load average (1 min) "
        f"{min(loads):.1f}–{max(loads):.1f} before and after, per-run means in the result "
        f"file. _Generated from `results/benchmarks/closed_loop_cpu.json`._")
    return "\n".join(out)


def rewrite(doc: Path, result: dict[str, Any]) -> None:
    """Replace the generated block of `doc` (between START and END) with `table(result)`."""
    text = doc.read_text()
    block = f"{START}\n\n{table(result)}\n\n{END}"
    pattern = re.escape(START) + r".*?" + re.escape(END)
    new, count = re.subn(pattern, lambda _: block, text, flags=re.S)
    if count != 1:
        raise ValueError(f"{doc}: expected one block between {START!r} and {END!r}")
    doc.write_text(new)


def generated_block(doc: Path) -> str:
    """The doc's generated block, markers aside."""
    return doc.read_text().split(START, 1)[1].split(END, 1)[0].strip()


if __name__ == "__main__":
    rewrite(ROOT / "docs" / "closed_loop.md", json.loads(RESULT.read_text()))
