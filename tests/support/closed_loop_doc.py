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

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- generated: closed loop table -->", "<!-- end of generated table -->"
TARGET = 1.03


def table(result: dict[str, Any]) -> str:
    """One row per (calibration, mixture, prior error, N): the time of the samples after the
    closed loop's first window, closed and open loop over the oracle's plan of them; the
    whole epoch's; the slowest rank's factor and the model error before and after."""
    out = [
        "| calibration | mixture | prior error | N | window (steps) | "
        "after 1st window: closed / oracle | "
        "open / oracle | whole epoch: closed / oracle | open / oracle | slowest rank's factor "
        "(last refit) | median error: prior → last refit |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    met = 0
    for r in result["rows"]:
        after = r["after_first_window"]
        closed = after["closed_s"] / after["oracle_s"]
        met += closed <= TARGET
        first, last = r["refits"][0], r["refits"][-1]
        out.append(
            f"| {r['calibration']} | {r['mixture']} | p {r['p_shift']:+}, c0 ×{r['c0_scale']} "
            f"| {r['world_size']:,} | {r['window_steps']} | {closed:.3f} "
            f"| {after['open_s'] / after['oracle_s']:.3f} "
            f"| {r['closed_s'] / r['oracle_s']:.3f} | {r['open_s'] / r['oracle_s']:.3f} "
            f"| {last['slowest_rank_speed']:.3f} "
            f"| {first['rel_err_before']:.1%} → {last['rel_err_after']:.1%} |"
        )
    out.append("")
    out.append(
        f"{met} of {len(result['rows'])} rows meet closed / oracle ≤ {TARGET} after the first "
        "window (model)."
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
