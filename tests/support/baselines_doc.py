"""The tables of docs/baselines.md, generated from results/benchmarks/baselines.json (written by
tests/bench/bench_baselines.py, which can rewrite the doc with them; tests/repo checks the doc
holds what this renders from the committed result)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

PACKED = "adaptiveload-packed"
START, END = "<!-- generated: baselines tables -->", "<!-- end of generated tables -->"


def _cell(row: dict[str, Any], packed: dict[str, Any], own: bool) -> str:
    """samples/s, its change vs packed (none on packed's own row), steps, x epoch bound."""
    vs = "" if own else f" ({row['samples_per_s'] / packed['samples_per_s'] - 1:+.1%})"
    return (f"{row['samples_per_s']:.4g}{vs} · {row['steps']:.0f} · "
            f"×{row['vs_epoch_lower_bound']:.3f}")


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
                    if row["samples_per_s"] > packed["samples_per_s"]:
                        gain = row["samples_per_s"] / packed["samples_per_s"] - 1
                        ahead.append(f"{mixture}, N = {n:,}, {mode}: {policy} {gain:+.1%} "
                                     f"({row['steps']:.0f} steps against packed's "
                                     f"{packed['steps']:.0f})")
                out.append(f"| {policy} | " + " | ".join(cells) + " |")
            out.append("")
    out.append("Where a method of the field plans more samples/s than packed:")
    out.append("")
    out += [f"- {line}" for line in ahead] or ["- nowhere"]
    return "\n".join(out)


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
