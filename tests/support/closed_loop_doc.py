"""The results table of docs/closed_loop.md, generated from
results/benchmarks/closed_loop_model.json (written by `adaptiveload closed-loop --config
experiments/closed_loop/model.yaml`); tests/repo checks the doc holds what this renders.

    python tests/support/closed_loop_doc.py   # rewrite the doc's block from the result
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from adaptiveload.analysis.closed_loop import MODEL_TARGET, model_ratios

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- generated: closed loop table -->", "<!-- end of generated table -->"


def table(result: dict[str, Any]) -> str:
    """One row per (calibration, mixture, prior error, N), means over the seeds: the time of
    the samples after the closed loop's first window, closed and open loop over the oracle's
    plan of them (and the closed loop's worst seed); the whole epoch's; the slowest rank's
    factor and the model error before and after. Then how many runs meet the target."""
    out = [
        "| calibration | mixture | prior error | N | window (steps) | "
        "after 1st window: closed / oracle (worst seed) | "
        "open / oracle | whole epoch: closed / oracle | open / oracle | slowest rank's factor "
        "(last refit) | median error: prior → last refit |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        key = (r["calibration"], r["mixture"], r["p_shift"], r["c0_scale"], r["world_size"])
        groups.setdefault(key, []).append(r)
    ratios = model_ratios(result)
    for (cal, mixture, p_shift, c0_scale, n), rows in groups.items():
        mine = model_ratios({"rows": rows})
        out.append(
            f"| {cal} | {mixture} | p {p_shift:+}, c0 ×{c0_scale} | {n:,} "
            f"| {rows[0]['window_steps']} "
            f"| {mine['closed_after'].mean():.3f} ({mine['closed_after'].max():.3f}) "
            f"| {mine['open_after'].mean():.3f} | {mine['closed_epoch'].mean():.3f} "
            f"| {mine['open_epoch'].mean():.3f} "
            f"| {np.mean([r['refits'][-1]['slowest_rank_speed'] for r in rows]):.3f} "
            f"| {np.mean([r['refits'][0]['rel_err_before'] for r in rows]):.1%} → "
            f"{np.mean([r['refits'][-1]['rel_err_after'] for r in rows]):.1%} |"
        )
    met = int((ratios["closed_after"] <= MODEL_TARGET).sum())
    out.append("")
    out.append(
        f"{met} of {len(result['rows'])} runs ({len(groups)} setups × "
        f"{len(result['spec']['seeds'])} seeds) meet closed / oracle ≤ {MODEL_TARGET} after the "
        "first window (model)."
    )
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
    result = json.loads((ROOT / "results" / "benchmarks" / "closed_loop_model.json").read_text())
    rewrite(ROOT / "docs" / "closed_loop.md", result)
