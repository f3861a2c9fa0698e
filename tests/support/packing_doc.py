"""The tables of docs/packing.md, generated from the committed benchmarks: the packed policy on
data it was not tuned on (results/benchmarks/epoch_bound.json, tests/bench/bench_epoch_bound.py),
sequence-parallel plans against one degree and against exclusion (sp_plans.json) and the
planner's time and memory (planning_sp.json, both tests/bench/bench_planner_sp.py); the packed
policy against balanced dealing on paper-mixed and its planner's time (packing_plans.json,
planning_packed.json, tests/bench/bench_planner_packing.py), in docs/packing.md and
docs/results.md; and the README's summary of the sequence-parallel plans. tests/repo checks
the docs hold what this renders.

    python tests/support/packing_doc.py   # rewrite the docs' blocks from the results
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "packing.md"
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
BENCHMARKS = ROOT / "results" / "benchmarks"
EPOCH_BOUND = (
    "<!-- generated: epoch bound table -->", "<!-- end of generated epoch bound table -->"
)
SP_PLANS = ("<!-- generated: sp plans table -->", "<!-- end of generated sp plans table -->")
PLANNER = (
    "<!-- generated: planner time table -->", "<!-- end of generated planner time table -->"
)
README_SP = (
    "<!-- generated: sp plans summary -->", "<!-- end of generated sp plans summary -->"
)
PACKED_PLANS = (
    "<!-- generated: packed plans table -->", "<!-- end of generated packed plans table -->"
)
PACKED_PLANNER = (
    "<!-- generated: packed planner time -->", "<!-- end of generated packed planner time -->"
)
BALANCED = "adaptiveload-balanced"
# the README's summary spans the world sizes up to this one
README_SP_MAX_N = 256
PACKED, SP, FIXED = "adaptiveload-packed", "adaptiveload-sp", "adaptiveload-sp-fixed"
# sp_plans.json's setups as the table names them
SP_SETUPS = {
    "h200-wan2.1-t2v-14b-long": "14B, H200 prior, `long-clips-121`",
    "h200-wan2.1-t2v-1.3b-long-40gb": "1.3B, measured H200 at 40 GB, `long-clips-161`",
    "h200-wan2.1-t2v-1.3b-paper-mixed": "1.3B, measured H200, `paper-mixed`",
}


def load(name: str) -> dict[str, Any]:
    return json.loads((BENCHMARKS / name).read_text())


def _n(n: int | str) -> str:
    return f"{int(n):,}"


def render_epoch_bound(result: dict[str, Any]) -> str:
    """Per mixture and N, the packed policy at `free` over its three seeds: the most steps
    (K_min), the worst × epoch bound, the distinct compositions, "=" where every `match` plan
    reaches its steps asked for; then how many of the json's targets hold."""
    sizes = sorted({int(k.split("/N=")[1]) for k in result["points"]})
    lines = ["| mixture | " + " | ".join(f"N = {_n(n)}" for n in sizes) + " |",
             "| --- |" + " --- |" * len(sizes)]
    for mixture in result["mixtures"]:
        cells = []
        for n in sizes:
            point = result["points"][f"{mixture}/N={n}"]
            free = point[f"free/{PACKED}"]["per_seed"]
            match = point[f"match/{PACKED}"]["per_seed"]
            steps = max(r["steps"] for r in free)
            k_min = max(r["min_steps_per_epoch"] for r in free)
            bound = max(r["vs_epoch_lower_bound"] for r in free)
            exact = "=" if all(r["steps"] == r["steps_asked"] for r in match) else "≠"
            cells.append(f"{steps} ({k_min}), {bound:.3f}, "
                         f"{point['packed_distinct_compositions_of_3_seeds']}, {exact}")
        lines.append(f"| `{mixture}` | " + " | ".join(cells) + " |")
    held = sum(result["targets"].values())
    missed = [k for k, ok in result["targets"].items() if not ok]
    tail = (f"{held} of {len(result['targets'])} targets hold" if not missed else
            f"{held} of {len(result['targets'])} targets hold; not met: " + "; ".join(missed))
    return "\n".join(lines) + f"\n\n{tail} (`targets` in the json; {result['date'][:10]}).\n"


def render_sp_plans(result: dict[str, Any]) -> str:
    """Per setup and N, the means over seeds: degree per micro-batch (samples/s, × epoch
    bound), the fixed degree (its samples/s, the SP plan's gain over it, × bound) and
    exclusion (its samples/s, the SP plan's rate relative to it, samples excluded)."""
    lines = [
        "| setup | N | degree per micro-batch: samples/s, × epoch bound | fixed degree: "
        "samples/s (SP vs it), × bound | excluding: samples/s (SP vs it), excluded |",
        "| --- | --- | --- | --- | --- |",
    ]
    for setup, by in result["setups"].items():
        for i, n in enumerate(str(n) for n in result["world_sizes"]):
            sp, fixed, packed = by[SP][n], by[FIXED][n], by[PACKED][n]
            rate = sp["samples_per_s"]
            lines.append(
                f"| {SP_SETUPS[setup] if i == 0 else ''} | {_n(n)} | {rate:.4g}, "
                f"{sp['vs_epoch_lower_bound']:.3f} | {fixed['samples_per_s']:.4g} "
                f"({_pct(rate / fixed['samples_per_s'] - 1)}), "
                f"{fixed['vs_epoch_lower_bound']:.3f} | {packed['samples_per_s']:.4g} "
                f"({_pct(rate / packed['samples_per_s'] - 1)}), {_n(round(packed['excluded']))} |"
            )
    excluded = max(by[SP][str(n)]["excluded"] for by in result["setups"].values()
                   for n in result["world_sizes"])
    flags = sum(r["beyond_measured_memory"] or 0 for by in result["setups"].values()
                for p in (SP, FIXED) for n in result["world_sizes"]
                for r in by[p][str(n)]["per_seed"])
    slower = [f"{SP_SETUPS[s].split(',')[0]} at N = {_n(n)}" for s, by in result["setups"].items()
              for n in result["world_sizes"]
              if by[SP][str(n)]["samples_per_s"] < by[FIXED][str(n)]["samples_per_s"]]
    return (
        "\n".join(lines) + f"\n\nSamples the SP policy excludes: {excluded:.0f}. Micro-batches "
        f"flagged beyond the calibration's measured memory (per rank, Σ S / d against its "
        f"largest measured point), SP and fixed degree, every seed: {flags}. Where the fixed "
        f"degree predicts more samples/s (the plan's baseline warning says so): "
        f"{', '.join(slower) or 'nowhere'}. ({result['date'][:10]}.)\n"
    )


def render_sp_readme(result: dict[str, Any]) -> str:
    """The README's two rows (one per setup): the SP plan's samples/s against the fixed
    degree and its × epoch bound, as ranges over N up to README_SP_MAX_N, the samples it
    excludes and the share the excluding plan leaves out; then how much faster exclusion is."""
    sizes = [str(n) for n in result["world_sizes"] if n <= README_SP_MAX_N]
    lines = ["| setup | samples/s vs one degree | × epoch bound (groups) | excluded |",
             "| --- | --- | --- | --- |"]
    faster = []
    for setup, by in result["setups"].items():
        gain = [by[SP][n]["samples_per_s"] / by[FIXED][n]["samples_per_s"] - 1 for n in sizes]
        bound = [by[SP][n]["vs_epoch_lower_bound"] for n in sizes]
        excluded = max(by[SP][n]["excluded"] for n in sizes)
        left_out = max(by[PACKED][n]["excluded"] for n in sizes) / result["samples"]
        faster += [by[PACKED][n]["samples_per_s"] / by[SP][n]["samples_per_s"] - 1 for n in sizes]
        lines.append(f"| {SP_SETUPS[setup]} | {_pct(min(gain))} to {_pct(max(gain))} | "
                     f"{min(bound):.3f}–{max(bound):.3f} | {excluded:.0f} (exclusion: "
                     f"{left_out:.1%}) |")
    return (
        "\n".join(lines) + f"\n\nExcluding the long samples instead gives {min(faster):.0%}–"
        f"{max(faster):.0%} more samples/s by dropping the costliest ones "
        f"(`results/benchmarks/sp_plans.json`, {result['date'][:10]}).\n"
    )


def render_packed_plans(result: dict[str, Any], indent: str = "") -> str:
    """Per N, balanced dealing against packing on paper-mixed (means over the seeds): steps,
    imbalance, × the steps' lower bound, and packed samples/s over balanced's; then the same
    at 1M samples and N = 1,024. `indent`: each line's (the table inside a list item)."""
    by = result["policies"]
    lines = ["| N | steps: balanced → packed | imbalance: balanced → packed | × the steps' lower "
             "bound: balanced → packed | samples/s, packed / balanced |",
             "| --- | --- | --- | --- | --- |"]
    for n in by[PACKED]:
        b, k = by[BALANCED][n], by[PACKED][n]
        lines.append(
            f"| {_n(n)} | {b['steps']:.0f} → {k['steps']:.0f} | {b['imbalance_rate']:.1%} → "
            f"{k['imbalance_rate']:.2%} | {b['vs_lower_bound']:.3f} → {k['vs_lower_bound']:.3f} "
            f"| {k['samples_per_s'] / b['samples_per_s']:.3f} |"
        )
    big = result["one_million_n1024"]
    b, k = big[BALANCED], big[PACKED]
    lines += ["", f"{result['samples']:,} samples, means over {len(result['seeds'])} seeds "
              f"(steps rounded); at 1M samples and N = 1,024: imbalance "
              f"{b['imbalance_rate']:.1%} → {k['imbalance_rate']:.2%}, × the bound "
              f"{b['vs_lower_bound']:.3f} → {k['vs_lower_bound']:.3f} ({result['date'][:10]})."]
    return "".join(f"{indent}{line}\n" if line else "\n" for line in lines)


def render_packed_planner(result: dict[str, Any], indent: str = "") -> str:
    """The packed planner's CPU time against balanced dealing's at 1M x 1,024 and 10M x 4,096,
    its peak RSS, where and under what load it was measured, and its targets."""
    by = {(c["policy"], c["samples"]): c for c in result["cases"]}
    loads = [x for c in result["cases"] for x in c["load_average_1min"]]

    def case(samples: int) -> str:
        k, b = by[PACKED, samples], by[BALANCED, samples]
        return (f"{_n(samples)} samples × {_n(k['world_size'])} ranks in "
                f"{k['best_cpu_s']:.2f} s (balanced dealing {b['best_cpu_s']:.2f} s)")

    peak = max(c["peak_rss_bytes"] for c in result["cases"])
    names = {"plan_1m_n1024_cpu_le_2s": "1M × 1,024 in ≤ 2 s",
             "plan_10m_n4096_cpu_le_10s": "10M × 4,096 in ≤ 10 s",
             "peak_rss_le_4gb": "peak RSS ≤ 4 GB"}
    held = ", ".join(f"{names[k]}: {'met' if ok else 'NOT met'}"
                     for k, ok in result["targets"].items())
    text = (
        f"The planner (`results/benchmarks/planning_packed.json`, measured on "
        f"{result['device']}, {result['date'][:10]}, load {_span(loads)}, "
        f"the planning thread's CPU time, best of {result['repeats']}; wall clock beside it in "
        f"the json): {case(1_000_000)}, {case(10_000_000)}, peak RSS "
        f"{peak / 2**30:.2f} GiB per process with the manifest (targets: {held})."
    )
    return textwrap.fill(text, 96 + len(indent), initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False) + "\n"


def _span(values: list[float]) -> str:
    """Load averages as one value, or low–high where they differ at one decimal."""
    low, high = f"{min(values):.1f}", f"{max(values):.1f}"
    return low if low == high else f"{low}–{high}"


def _pct(x: float) -> str:
    return f"{x:+.1%}".replace("-", "−")


def render_planner(result: dict[str, Any]) -> str:
    """Each case: its CPU time (best of the repeats, and the first, which also pays the OS for
    the process's fresh memory), wall clock and load beside it, peak RSS, and the targets with
    whether they hold (judged on the best)."""
    lines = ["| setup | policy | samples × ranks | CPU s (best) | CPU s (first) | wall s | load "
             "| peak RSS GiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in result["cases"]:
        lines.append(
            f"| {SP_SETUPS[c['setup']]} | `{c['policy']}` | {_n(c['samples'])} × "
            f"{_n(c['world_size'])} | {c['best_cpu_s']:.2f} | {c['cpu_s'][0]:.2f} | "
            f"{c['best_wall_s']:.2f} | "
            f"{_span(c['load_average_1min'])} | {c['peak_rss_bytes'] / 2**30:.2f} |"
        )
    targets = "; ".join(f"{_target(k)}: {'met' if ok else 'NOT met'}"
                        for k, ok in result["targets"].items())
    return (
        "\n".join(lines) + f"\n\nMeasured on {result['device']}, {result['date'][:10]}, "
        f"{result['repeats']} repeats in a fresh process per case (the 10M case once). "
        f"Targets: {targets}.\n"
    )


def _target(key: str) -> str:
    """A planning_sp.json target's key (setup/name) as the table names it."""
    setup, name = key.split("/")
    what = {"plan_1m_n1024_cpu_le_2s": "1M × 1,024 in ≤ 2 s CPU",
            "plan_10m_n4096_peak_rss_le_4gb": "10M × 4,096 in ≤ 4 GiB peak RSS"}[name]
    return f"{SP_SETUPS[setup].split(', ')[-1]}, {what}"


def generated_block(text: str, markers: tuple[str, str]) -> str:
    """What `text` holds between `markers` (without them; an end marker indented as its block
    is, inside a list item, ends it)."""
    start, end = markers
    match = re.search(re.escape(start) + r"\n(.*?)[ ]*" + re.escape(end), text, re.S)
    if match is None:
        raise SystemExit(f"no block {start} ... {end}")
    return match.group(1)


def blocks() -> list[tuple[Path, tuple[str, str], str]]:
    """Each block's file, markers and what it should hold now."""
    sp = load("sp_plans.json")
    return [
        (DOC, EPOCH_BOUND, render_epoch_bound(load("epoch_bound.json"))),
        (DOC, SP_PLANS, render_sp_plans(sp)),
        (DOC, PLANNER, render_planner(load("planning_sp.json"))),
        (README, README_SP, render_sp_readme(sp)),
        (DOC, PACKED_PLANS, render_packed_plans(load("packing_plans.json"))),
        (RESULTS, PACKED_PLANS, render_packed_plans(load("packing_plans.json"), "  ")),
        (RESULTS, PACKED_PLANNER, render_packed_planner(load("planning_packed.json"), "  ")),
    ]


def main() -> None:
    for path, (start, end), body in blocks():
        text = path.read_text()
        pattern = re.escape(start) + r"\n.*?(?P<indent>[ ]*)" + re.escape(end)
        match = re.search(pattern, text, re.S)
        if match is None:
            raise SystemExit(f"{path}: no block {start} ... {end}")
        new = f"{start}\n{body}{match.group('indent')}{end}"
        path.write_text(text[: match.start()] + new + text[match.end():])


if __name__ == "__main__":
    main()
