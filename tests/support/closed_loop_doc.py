"""The model tables of docs/closed_loop.md, generated from the committed benchmarks (written by
`adaptiveload closed-loop`, experiments/closed_loop/): the paper-scale table with its holdout
seeds, and the table of epochs of a few steps; tests/repo checks the doc holds what this
renders.

    python tests/support/closed_loop_doc.py   # rewrite the doc's blocks from the results
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from adaptiveload.analysis.closed_loop import (
    HOLDOUT_BENCHMARK,
    MODEL_BENCHMARK,
    MODEL_TARGET,
    SHORT_EPOCHS_BENCHMARK,
    met,
    model_ratios,
    scale,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ("<!-- generated: closed loop table -->", "<!-- end of generated table -->")
SHORT = (
    "<!-- generated: closed loop short epochs table -->",
    "<!-- end of generated short epochs table -->",
)


def load() -> dict[str, dict[str, Any]]:
    """The committed results: `model` (paper scale), its `holdout` seeds, `short` epochs."""
    paths = {
        "model": MODEL_BENCHMARK,
        "holdout": HOLDOUT_BENCHMARK,
        "short": SHORT_EPOCHS_BENCHMARK,
    }
    return {name: json.loads((ROOT / path).read_text()) for name, path in paths.items()}


def _groups(result: dict[str, Any]) -> dict[tuple, list[dict[str, Any]]]:
    """The runs by setup (calibration, mixture, prior error, N), in the spec's order."""
    spec = result["spec"]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in result["rows"]:
        key = (r["calibration"], r["mixture"], r["p_shift"], r["c0_scale"], r["world_size"])
        groups.setdefault(key, []).append(r)

    def order(key: tuple) -> tuple:
        cal, mixture, p_shift, _, n = key
        shifts = [e["p_shift"] for e in spec["prior_errors"]]
        return (
            spec["mixtures"].index(mixture),
            spec["calibrations"].index(cal),
            shifts.index(p_shift),
            n,
        )

    return {key: groups[key] for key in sorted(groups, key=order)}


def table(result: dict[str, Any]) -> str:
    """One row per (calibration, mixture, prior error, N), means over the seeds: the time of
    the samples after the closed loop's first window, closed and open loop over the oracle's
    plan of them (and the closed loop's worst seed); the whole epoch's; the slowest rank's
    factor and the model error before and after."""
    out = [
        "| calibration | mixture | prior error | N | samples | window (steps) | "
        "after 1st window: closed / oracle (worst seed) | "
        "open / oracle | whole epoch: closed / oracle | open / oracle | slowest rank's factor "
        "(last refit) | median error: prior → last refit |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (cal, mixture, p_shift, c0_scale, n), rows in _groups(result).items():
        mine = model_ratios({"rows": rows})
        out.append(
            f"| {cal} | {mixture} | p {p_shift:+}, c0 ×{c0_scale} | {n:,} "
            f"| {rows[0]['num_samples']:,} | {rows[0]['window_steps']} "
            f"| {mine['closed_after'].mean():.3f} ({mine['closed_after'].max():.3f}) "
            f"| {mine['open_after'].mean():.3f} | {mine['closed_epoch'].mean():.3f} "
            f"| {mine['open_epoch'].mean():.3f} "
            f"| {np.mean([r['refits'][-1]['slowest_rank_speed'] for r in rows]):.3f} "
            f"| {np.mean([r['refits'][0]['rel_err_before'] for r in rows]):.1%} → "
            f"{np.mean([r['refits'][-1]['rel_err_after'] for r in rows]):.1%} |"
        )
    return "\n".join(out)


def summary(result: dict[str, Any], what: str) -> str:
    """How many runs of `result` meet the target, overall and per N, and the worst ratio."""
    spec, rows = result["spec"], result["rows"]
    closed = model_ratios(result)["closed_after"]
    per_n = []
    for n in spec["world_sizes"]:
        mine = {"rows": [r for r in rows if r["world_size"] == n]}
        per_n.append(f"{met(mine)} of {len(mine['rows'])} at N = {n:,}")
    seeds = ", ".join(map(str, spec["seeds"]))
    return (
        f"{what}, {scale(spec)}, seeds {seeds}: {met(result)} of {len(rows)} runs "
        f"({len(_groups(result))} setups × {len(spec['seeds'])} seeds) meet closed / oracle "
        f"≤ {MODEL_TARGET} after the first window ({'; '.join(per_n)}); worst "
        f"×{closed.max():.3f}, median ×{np.median(closed):.3f} (model)."
    )


def render_model(results: dict[str, dict[str, Any]]) -> str:
    """The paper-scale table, its count and its holdout's (the same setups, other seeds)."""
    return "\n".join(
        [
            table(results["model"]),
            "",
            summary(results["model"], "Paper scale"),
            "",
            summary(results["holdout"], "Holdout"),
        ]
    )


def render_short(results: dict[str, dict[str, Any]]) -> str:
    """The table of epochs of a few steps (a fixed sample count at every N) and its count."""
    short = results["short"]
    return "\n".join([table(short), "", summary(short, "Epochs of a few steps")])


def rewrite(doc: Path, markers: tuple[str, str], body: str) -> None:
    """Replace the block of `doc` between `markers` with `body`."""
    start, end = markers
    text = doc.read_text()
    pattern = re.escape(start) + r".*?" + re.escape(end)
    new, count = re.subn(pattern, lambda _: f"{start}\n\n{body}\n\n{end}", text, flags=re.S)
    if count != 1:
        raise ValueError(f"{doc}: expected one block between {start!r} and {end!r}")
    doc.write_text(new)


def generated_block(doc: Path, markers: tuple[str, str]) -> str:
    """The doc's block between `markers`, markers aside."""
    start, end = markers
    return doc.read_text().split(start, 1)[1].split(end, 1)[0].strip()


if __name__ == "__main__":
    results = load()
    doc = ROOT / "docs" / "closed_loop.md"
    rewrite(doc, MODEL, render_model(results))
    rewrite(doc, SHORT, render_short(results))
