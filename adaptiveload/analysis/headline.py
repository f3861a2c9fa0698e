"""The headline tables: one small table per kind of evidence (the measured training runs
first, then each model setup), the numbers a reader looks for and nothing else, and the
generated blocks of the README and docs/results.md that quote them.

A headline table has at most 7 columns: policy, optimizer steps per epoch, imbalance,
samples/s, the speedup over the baseline with what varies (measured: the 95% t interval over
seeds, the sign-flip p and how many seeds agree; model: the range over seeds), and the host
load the measured runs ran under (model: the epoch's distance from its lower bound). The full
table (`tables.paper_table`) keeps every column as an appendix.

Numbers in the README and docs are never typed: `analyze publish` records a run's runs table
under results/reference/<experiment>/<date>-<commit>/ and rewrites the blocks between
``<!-- generated: NAME -->`` and ``<!-- end generated -->`` from every recorded run (the newest
for the tables and findings, all of them for how far the measured figures moved between
reruns); a test fails when the committed text disagrees with the committed records.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from adaptiveload.analysis.landing import PAPER_TEXT, policy_order
from adaptiveload.analysis.stats import (
    LOAD_ADJUSTED,
    PAIRED,
    SEED_RANGE,
    compare,
    describe,
    headline,
)
from adaptiveload.errors import UserError
from adaptiveload.experiment import schema_default
from adaptiveload.pipeline import BASE_VARIANT

MEASURED_SETUP = "train"
THROUGHPUT = "samples_per_s ratio"
IMBALANCE = "imbalance_rate difference"
# the paper's numbers, worded once (`landing.PAPER_TEXT`) for the report, tables and README
PAPER_LINE = f"{PAPER_TEXT[0].upper()}{PAPER_TEXT[1:]} (its metric definitions unpublished)."


@dataclass(frozen=True)
class Headline:
    """One headline table: its setup, a caption that says what the numbers are, the table."""

    setup: str
    caption: str
    table: pd.DataFrame

    @property
    def measured(self) -> bool:
        return self.setup == MEASURED_SETUP

    def markdown(self) -> str:
        return f"**{self.setup}**: {self.caption}\n\n{self.table.to_markdown(index=False)}\n"


def _range(values: pd.Series, fmt: str) -> str:
    lo, hi = values.min(), values.max()
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return ""
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else (
        f"{format(lo, fmt)}–{format(hi, fmt)}")


def speedup(row: pd.Series | None) -> str:
    """'×1.45 [1.37, 1.53]' (measured) or '×1.55 (1.54–1.56)' (model, seed range); empty
    where no comparison was made (an experiment without the baseline's runs)."""
    if row is None:
        return ""
    text = f"×{row['estimate']:.2f}"
    if row["test"] == SEED_RANGE:
        return text + (f" ({row['seed_min']:.2f}–{row['seed_max']:.2f})"
                       if row["seed_max"] > row["seed_min"] else "")
    return text + f" [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"


def evidence(row: pd.Series | None) -> str:
    """'p=0.031, 5/5 seeds' of a measured comparison."""
    if row is None:
        return ""
    return f"p={row['p_value']:.2g}, {int(row['agree'])}/{int(row['n_policy'])} seeds"


def _caption(group: pd.DataFrame, measured: bool) -> str:
    seeds = group["seed"].nunique()
    label = ", ".join(sorted(set(group["label"])))
    world = ", ".join(str(n) for n in sorted(set(group["world_size"])))
    modes = ", ".join(sorted(set(group["steps_per_epoch"])))
    what = (f"{label}, {world} ranks, {seeds} seeds, steps per epoch `{modes}`. ")
    if measured:
        return what + ("Speedup: geometric mean of the per-seed samples/s ratios vs the "
                       "baseline, 95% t interval over seeds, exact sign-flip p.")
    return what + ("A prediction: the speedup's range over seeds is what the data's draw and "
                   "order change; there is no sampling error to give an interval for.")


def headline_tables(
    runs: pd.DataFrame, stats: pd.DataFrame | None = None,
    baseline: str = schema_default("analysis.baseline"),
) -> list[Headline]:
    """A headline table per setup of the base runs, measured first, each baseline first."""
    base = runs[runs["variant"] == BASE_VARIANT]
    stats = compare(base, baseline) if stats is None else stats
    shown = headline(stats)
    out = []
    setups = sorted(set(base["setup"]), key=lambda s: (s != MEASURED_SETUP, s))
    for setup in setups:
        group = base[base["setup"] == setup]
        measured = bool((group["source"] == "measured").all())
        present = policy_order(group["policy"])  # one order for every table and figure
        policies = sorted(present, key=lambda p: p != baseline)  # the baseline first
        rows = []
        for policy in policies:
            runs_p = group[group["policy"] == policy]
            found = shown[(shown["setup"] == setup) & (shown["variant"] == BASE_VARIANT)
                          & (shown["policy"] == policy) & (shown["metric"] == THROUGHPUT)]
            stat = found.iloc[0] if len(found) else None
            row = {
                "policy": policy,
                "steps/epoch": _range(runs_p["epoch_steps"], ".0f"),
                "imbalance": f"{runs_p['imbalance_rate'].mean():.1%}",
                "samples/s": f"{runs_p['samples_per_s'].mean():.4g}",
                "speedup": speedup(stat) if policy != baseline else "baseline",
            }
            if measured:
                row["p, seeds agreeing"] = evidence(stat) if policy != baseline else ""
                row["host load"] = _range(runs_p.get("host_load_mean", pd.Series(
                    [np.nan])), ".1f")
            else:
                row["× epoch bound"] = _range(runs_p["vs_epoch_lower_bound"], ".3f")
            rows.append(row)
        out.append(Headline(setup, _caption(group, measured), pd.DataFrame(rows)))
    return out


def to_markdown(tables: list[Headline]) -> str:
    return "\n".join(t.markdown() for t in tables) + f"\n{PAPER_LINE}\n"


def write(tables: list[Headline], stem: Path) -> list[Path]:
    """headline.md and a UTF-8 headline.html beside it."""
    from adaptiveload.io import write_text

    html = "".join(f"<h3>{t.setup}</h3>\n<p>{t.caption}</p>\n"
                   f"{t.table.to_html(index=False, border=0)}\n" for t in tables)
    paths = [stem.with_suffix(".md"), stem.with_suffix(".html")]
    write_text(paths[0], f"# Headline results\n\n{to_markdown(tables)}")
    write_text(paths[1], f'<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
                         f"<title>Headline results</title></head><body>\n{html}"
                         f"<p>{PAPER_LINE}</p>\n</body></html>\n")
    return paths


# ------------------------------------------------------------------ recorded runs and blocks
RECORDS = Path("results/reference")
RUNS_FILE = "runs.csv"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w:/.-]+) -->\n)(?P<body>.*?)"
                   r"(<!-- end generated -->)", re.S)


def _when(folder: Path) -> tuple[str, str]:
    """A record's time for ordering: its provenance's `recorded` (UTC, ISO), else its name
    (which starts with the date)."""
    from adaptiveload.io import read_json

    provenance = folder / "provenance.json"
    stamp = read_json(provenance, "provenance").get("recorded", "") if provenance.exists() else ""
    return (stamp or folder.name, folder.name)


def recorded(root: Path) -> list[tuple[str, pd.DataFrame]]:
    """(name, runs table) of every recorded run of one experiment, oldest first."""
    folders = sorted((p.parent for p in root.glob(f"*/{RUNS_FILE}")), key=_when)
    if not folders:
        raise UserError(f"{root}: no recorded run (*/{RUNS_FILE}); record one with "
                        "`adaptiveload analyze publish --record ...`")
    return [(f.name, pd.read_csv(f / RUNS_FILE)) for f in folders]


def _machines(root: Path, records: list[tuple[str, pd.DataFrame]]) -> str:
    """The CPUs the recorded runs ran on, from their provenance."""
    from adaptiveload.io import read_json

    cpus = {read_json(root / name / "provenance.json", "provenance").get("cpu", "unknown")
            for name, _ in records if (root / name / "provenance.json").exists()}
    return ", ".join(sorted(cpus)) or "unrecorded machines"


def _moved(root: Path, records: list[tuple[str, pd.DataFrame]], baseline: str) -> str:
    """How far each measured speedup moved across the recorded reruns, and on which CPUs."""
    per_policy: dict[str, list[tuple[str, float]]] = {}
    for name, runs in records:
        train = runs[(runs["setup"] == MEASURED_SETUP) & (runs["variant"] == BASE_VARIANT)]
        if train.empty:
            continue
        rows = headline(compare(train, baseline))
        for row in rows[rows["metric"] == THROUGHPUT].itertuples():
            per_policy.setdefault(row.policy, []).append((name, row.estimate))
    if not per_policy or max(len(v) for v in per_policy.values()) < 2:
        names = ", ".join(name for name, _ in records)
        return (f"Recorded measured reruns: {len(records)} ({names}); how far the measured "
                "speedups move between reruns shows once a second run is recorded.")
    parts = [f"{policy} ×{min(v for _, v in got):.2f}–×{max(v for _, v in got):.2f} "
             f"({len(got)} runs)" for policy, got in sorted(per_policy.items())]
    return ("Measured speedups across the recorded reruns "
            f"({', '.join(name for name, _ in records)}; on {_machines(root, records)}): "
            + "; ".join(parts) + ".")


def findings(
    runs: pd.DataFrame, baseline: str = schema_default("analysis.baseline")
) -> dict[str, str]:
    """Per setup, one generated line per policy: its speedup and imbalance change with what
    varies, and a verdict that follows from the interval (measured) or says it is a model."""
    base = runs[runs["variant"] == BASE_VARIANT]
    stats = compare(base, baseline)
    out = {}
    for table in headline_tables(base, stats, baseline):
        lines = []
        group = stats[(stats["setup"] == table.setup) & (stats["variant"] == BASE_VARIANT)]
        for policy in table.table["policy"]:
            if policy == baseline:
                continue
            rows = group[group["policy"] == policy]
            head = PAIRED if table.measured else SEED_RANGE
            speed, imb = _pick(rows, THROUGHPUT, head), _pick(rows, IMBALANCE, head)
            if speed is None or imb is None:
                continue
            kind = "" if table.measured else " (model)"
            text = (f"- `{table.setup}`, {policy}{kind}: samples/s {speedup(speed)}, imbalance "
                    f"{describe(imb, unit=' pp', evidence=False)}")
            if table.measured:
                text += f" ({evidence(speed)}): {_verdict(speed)}"
                adj = _pick(rows, THROUGHPUT, LOAD_ADJUSTED)
                if adj is not None:
                    text += (f"; at equal host load ×{adj['estimate']:.2f} "
                             f"[{adj['ci_low']:.2f}, {adj['ci_high']:.2f}]")
            lines.append(text + ".")
        out[table.setup] = "\n".join(lines) + "\n"
    return out


def _pick(rows: pd.DataFrame, metric: str, test: str) -> pd.Series | None:
    found = rows[(rows["metric"] == metric) & (rows["test"] == test)]
    return found.iloc[0] if len(found) else None


def _verdict(row: pd.Series) -> str:
    if row["ci_low"] > 1:
        return "faster, resolved (the 95% interval excludes ×1)"
    if row["ci_high"] < 1:
        return "slower, resolved (the 95% interval excludes ×1)"
    return "not resolved (the 95% interval spans ×1)"


def blocks(root: Path, baseline: str = schema_default("analysis.baseline")) -> dict[str, str]:
    """The generated blocks' texts from the recorded runs under `root`: `headline:<setup>`
    and `findings:<setup>` for each setup of the newest run, `headline:measured`,
    `headline:model` (all of one kind), `findings` (all setups) and `reruns` (every recorded
    run)."""
    records = recorded(root)
    name, runs = records[-1]
    tables = headline_tables(runs, baseline=baseline)
    # named as in the checkout, wherever `root` was given from
    source = f"_Generated from `{(RECORDS / root.name / name / RUNS_FILE).as_posix()}`._\n"
    out = {f"headline:{t.setup}": t.markdown() + "\n" + source for t in tables}
    out["headline:measured"] = to_markdown([t for t in tables if t.measured]) + "\n" + source
    out["headline:model"] = "\n".join(t.markdown() for t in tables if not t.measured) + (
        "\n" + source)
    found = findings(runs, baseline)
    out.update({f"findings:{setup}": text for setup, text in found.items()})
    out["findings"] = "".join(found.values())
    out["reruns"] = _moved(root, records, baseline) + "\n"
    return out


CONVERGENCE_BENCHMARK = Path("results/benchmarks/convergence.json")


def generated_blocks(
    records: Path, convergence: Path = CONVERGENCE_BENCHMARK,
    baseline: str = schema_default("analysis.baseline"),
) -> dict[str, str]:
    """Every generated block of the README and docs: the recorded runs' (`blocks`), the
    convergence benchmark's table (`convergence`) and the closed loop's benchmarks'
    (`closed-loop`)."""
    from adaptiveload.analysis import closed_loop
    from adaptiveload.analysis.convergence import readme_table
    from adaptiveload.io import read_json

    out = blocks(records, baseline)
    bench = read_json(convergence, "convergence benchmark")
    out["convergence"] = readme_table(bench["comparisons"]) + (
        f"\n_Generated from `{CONVERGENCE_BENCHMARK.as_posix()}` (commit "
        f"{bench['commit'][:7]})._\n")
    out["closed-loop"] = closed_loop.readme_block(
        read_json(closed_loop.MODEL_BENCHMARK, "closed-loop model benchmark"),
        read_json(closed_loop.HOLDOUT_BENCHMARK, "closed-loop model benchmark's holdout"),
        read_json(closed_loop.SHORT_EPOCHS_BENCHMARK, "closed-loop short-epochs benchmark"),
        read_json(closed_loop.CPU_BENCHMARK, "closed-loop CPU benchmark"))
    return out


def fill(text: str, generated: dict[str, str], where: str) -> str:
    """`text` with every generated block replaced by its new body; UserError for a block
    whose name has no generator."""
    def body(match: re.Match) -> str:
        name = match.group("name")
        if name not in generated:
            raise UserError(f"{where}: generated block `{name}` unknown; known: "
                            f"{', '.join(sorted(generated))}")
        return f"{match.group(1)}{generated[name]}{match.group(4)}"

    return BLOCK.sub(body, text)

