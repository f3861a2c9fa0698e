"""The tables of docs/baselines.md, generated from results/benchmarks/baselines.json (written by
tests/bench/bench_baselines.py, which can rewrite the doc with them; tests/repo checks the doc
holds what this renders from the committed result)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from adaptiveload.planning.policies import POLICIES

PACKED = "adaptiveload-packed"
# the packed policy held to the memory limit alone (M_comp lifted), as the field's methods are
MEMORY_ONLY = "adaptiveload-packed, memory only"
START, END = "<!-- generated: baselines tables -->", "<!-- end of generated tables -->"


def _cell(row: dict[str, Any], packed: dict[str, Any], own: bool) -> str:
    """samples/s, its change vs packed (none on packed's own row), steps, x epoch bound."""
    vs = "" if own else f" ({row['samples_per_s'] / packed['samples_per_s'] - 1:+.1%})"
    return (f"{row['samples_per_s']:.4g}{vs} · {row['steps']:.0f} · "
            f"×{row['vs_epoch_lower_bound']:.3f}")


def _steps(row: dict[str, Any]) -> str:
    steps = f"{row['steps']:.0f}"
    return f"{steps} step" if steps == "1" else f"{steps} steps"


def tables(result: dict[str, Any]) -> str:
    """One table per mixture and step mode (rows: policies, columns: N), then every point
    where a method of the field plans more samples/s than packed."""
    points = result["points"]
    by_mixture: dict[str, dict[int, dict[str, Any]]] = {}
    for key, point in points.items():
        mixture, n = key.split("/N=")
        by_mixture.setdefault(mixture, {})[int(n)] = point
    out = []
    ahead = []
    for mixture, per_n in by_mixture.items():
        sizes = sorted(per_n)
        for mode in ("free", "match"):
            policies = [k.split("/", 1)[1] for k in per_n[sizes[0]] if k.startswith(mode + "/")]
            out += [f"**{mixture}, {mode}** (samples/s (vs packed) · steps · × epoch bound)", "",
                    "| policy | " + " | ".join(f"N = {n:,}" for n in sizes) + " |",
                    "| --- |" + " --- |" * len(sizes)]
            for policy in policies:
                cells = []
                for n in sizes:
                    packed = per_n[n][f"{mode}/{PACKED}"]
                    row = per_n[n][f"{mode}/{policy}"]
                    cells.append(_cell(row, packed, policy == PACKED))
                    peer = policy in POLICIES and POLICIES[policy].peer
                    if peer and row["samples_per_s"] > packed["samples_per_s"]:
                        gain = row["samples_per_s"] / packed["samples_per_s"] - 1
                        alone = per_n[n][f"{mode}/{MEMORY_ONLY}"]
                        vs_peer = alone["samples_per_s"] / row["samples_per_s"] - 1
                        ahead.append(
                            f"{mixture}, N = {n:,}, {mode}: {policy} {gain:+.1%} in "
                            f"{_steps(row)} against packed's {_steps(packed)}; packed held "
                            f"to memory alone: {vs_peer:+.1%} on {policy} in {_steps(alone)}"
                        )
                out.append(f"| {policy} | " + " | ".join(cells) + " |")
            out.append("")
        out += _memory_table(mixture, per_n)
    out.append("Where a method of the field plans more samples/s than packed:")
    out.append("")
    out += [f"- {line}" for line in ahead] or ["- nowhere"]
    out += ["", "The ranges the reading below quotes (samples/s against packed at the same point):",
            ""]
    out += [f"- {line}" for line in ranges(points)]
    return "\n".join(out)


def ranges(points: dict[str, dict[str, Any]]) -> list[str]:
    """How far each method is behind (or ahead of) packed, as ranges over the points: every
    point and step mode for the cost-blind ones, then by mixture and step mode."""
    def rel(key: str, mode: str, policy: str) -> float:
        return (points[key][f"{mode}/{policy}"]["samples_per_s"]
                / points[key][f"{mode}/{PACKED}"]["samples_per_s"] - 1)

    def span(values: list[float]) -> str:
        low, high = f"{min(values):+.1%}", f"{max(values):+.1%}"
        return low if low == high else f"{low} to {high}"

    paper = [k for k in points if k.startswith("paper-mixed/")]
    long = [k for k in points if not k.startswith("paper-mixed/")]
    every = [(k, m) for k in points for m in ("free", "match")]
    out = [f"{p}, every point: {span([rel(k, m, p) for k, m in every])}"
           for p in ("token-ffd", "time-buckets")]
    out.append(f"token-kk: free steps {span([rel(k, 'free', 'token-kk') for k in points])}; "
               f"equal steps on paper-mixed {span([rel(k, 'match', 'token-kk') for k in paper])}")
    behind = [rel(k, m, "flop-greedy") for k in paper for m in ("free", "match")]
    long_free = [rel(k, "free", "flop-greedy") for k in long]
    ahead = [(k, m) for k, m in every if rel(k, m, "flop-greedy") > 0]
    out.append(
        f"flop-greedy where behind: paper-mixed, both step modes "
        f"{span([x for x in behind if x <= 0])}; long-clips-161, free steps "
        f"{span([x for x in long_free if x <= 0])}"
    )
    if ahead:
        bound = [points[k][f"{m}/flop-greedy"]["vs_epoch_lower_bound"] for k, m in ahead]
        out.append(
            f"flop-greedy where ahead ({len(ahead)} points): "
            f"{span([rel(k, m, 'flop-greedy') for k, m in ahead])}, its epoch "
            f"×{min(bound):.3f} to ×{max(bound):.3f} of the bound; packed held to memory alone "
            f"there: {span([rel(k, m, MEMORY_ONLY) for k, m in ahead])} on packed, "
            + span([points[k][f"{m}/{MEMORY_ONLY}"]["samples_per_s"]
                    / points[k][f"{m}/flop-greedy"]["samples_per_s"] - 1 for k, m in ahead])
            + " on flop-greedy"
        )
    peers = [p for p in POLICIES if POLICIES[p].peer]
    out.append(
        f"equal steps: flop-greedy on paper-mixed "
        f"{span([rel(k, 'match', 'flop-greedy') for k in paper])}; the four on long-clips-161 "
        f"{span([rel(k, 'match', p) for k in long for p in peers])}; adaptiveload-balanced "
        f"on long-clips-161 {span([rel(k, 'match', 'adaptiveload-balanced') for k in long])}"
    )
    return out


def _memory_table(mixture: str, per_n: dict[int, dict[str, Any]]) -> list[str]:
    """Padding (share of the samples run) and micro-batches beyond the calibration's measured
    memory (seeds' mean), at the smallest and largest N, both step modes."""
    columns = [(n, mode) for n in (min(per_n), max(per_n)) for mode in ("free", "match")]
    policies = [k.split("/", 1)[1] for k in per_n[min(per_n)] if k.startswith("free/")]
    out = [f"**{mixture}: padding · micro-batches beyond measured memory**", "",
           "| policy | " + " | ".join(f"N = {n:,} {mode}" for n, mode in columns) + " |",
           "| --- |" + " --- |" * len(columns)]
    for policy in policies:
        cells = [per_n[n][f"{mode}/{policy}"] for n, mode in columns]
        out.append(f"| {policy} | " + " | ".join(
            f"{c['padding_fraction']:.1%} · {c['micro_batches_beyond_measured_memory']:,.0f}"
            for c in cells) + " |")
    return [*out, ""]


def rewrite(doc: Path, result: dict[str, Any]) -> None:
    """Replace the generated block of `doc` (between START and END) with `tables(result)`."""
    text = doc.read_text()
    block = f"{START}\n\n{tables(result)}\n\n{END}"
    new, count = re.subn(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text,
                         flags=re.S)
    if count != 1:
        raise ValueError(f"{doc}: expected one block between {START!r} and {END!r}")
    doc.write_text(new)


def generated_block(doc: Path) -> str:
    """The doc's generated block, markers aside."""
    text = doc.read_text()
    return text.split(START, 1)[1].split(END, 1)[0].strip()
