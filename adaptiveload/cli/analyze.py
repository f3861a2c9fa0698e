"""`adaptiveload analyze`: aggregate runs, test, tabulate, draw and record an experiment.

Each subcommand is one pipeline rule; all read the tidy tables written by `aggregate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from adaptiveload.cli.app import examples, group
from adaptiveload.errors import UserError
from adaptiveload.experiment import schema_default

analyze = group("analyze", "Statistics, tables, figures of an experiment.")
Opt = typer.Option
# inputs shared by the commands that read `aggregate`'s and `stats`' tables
Runs = Annotated[Path, Opt(help="runs.parquet from `analyze aggregate`")]
Steps = Annotated[Path, Opt(help="steps.parquet from `analyze aggregate`")]
Stats = Annotated[Path, Opt(help="stats.csv from `analyze stats`")]
KernelBench = Annotated[Path | None, Opt(help="`adaptiveload kernel bench` CSV")]
Baseline = Annotated[str, Opt(help="the policy every other is compared with")]
FlipSeed = Annotated[int, Opt(help="seed of the Monte Carlo sign flips (above 16 seeds)")]
# defaults as an experiment's `analysis:` section has them
BASELINE = schema_default("analysis.baseline")
FLIP_SEED = schema_default("analysis.seed")


def _read(path: Path):
    from adaptiveload.io import read_table

    return read_table(path, "table", "run the `adaptiveload analyze` step that writes it "
                      "(aggregate, stats, tables) again")


@analyze.command("aggregate", epilog=examples(
    "adaptiveload analyze aggregate --index run_index.json --runs-out runs.parquet "
    "--steps-out steps.parquet",
))
def aggregate_cmd(
    index: Annotated[
        Path, Opt(help="run index: a JSON file listing {setup, variant, summary, steps}")
    ],
    runs_out: Annotated[Path, Opt(help="one row per run (Parquet)")],
    steps_out: Annotated[Path, Opt(help="one row per (run, step, rank) (Parquet)")],
) -> None:
    """Collect per-step tables and run summaries into one tidy pair of tables."""
    from adaptiveload.analysis.aggregate import aggregate, parse_index
    from adaptiveload.io import write_parquet

    agg = aggregate(parse_index(index))
    write_parquet(runs_out, agg.runs)
    write_parquet(steps_out, agg.steps)
    typer.echo(f"{len(agg.runs)} runs, {len(agg.steps)} rank-steps -> {runs_out}, {steps_out}")


@analyze.command("stats", epilog=examples(
    "adaptiveload analyze stats --runs runs.parquet --csv stats.csv --md stats.md",
))
def stats_cmd(
    runs: Runs,
    csv: Annotated[Path, Opt(help="all tests, one row each")],
    md: Annotated[Path, Opt(help="the same, readable")],
    baseline: Baseline = BASELINE,
    seed: FlipSeed = FLIP_SEED,
) -> None:
    """Baseline vs each policy at the replicate level: paired t intervals, sign-flip p."""
    from adaptiveload.analysis.stats import compare, to_markdown
    from adaptiveload.io import write_text

    table = compare(_read(runs), baseline=baseline, seed=seed)
    write_text(csv, table.to_csv(index=False))
    write_text(md, to_markdown(table))
    typer.echo(f"{len(table)} tests -> {csv}, {md}")


@analyze.command("tables", epilog=examples(
    "adaptiveload analyze tables --runs runs.parquet --steps steps.parquet --stats stats.csv "
    "--out-dir tables",
))
def tables_cmd(
    runs: Runs,
    steps: Steps,
    stats: Stats,
    out_dir: Annotated[Path, Opt(help="writes headline.*, paper_table.*, kernel_table.* here")],
    kernel_bench: KernelBench = None,
    baseline: Baseline = BASELINE,
    paper_map: Annotated[
        Path | None, Opt(help="`analyze paper-map` summary: adds its paper-consistent rows")
    ] = None,
) -> None:
    """The headline tables (md, html), the full paper table (md, csv, html), the kernel table."""
    from adaptiveload.analysis import headline
    from adaptiveload.analysis.tables import KERNEL_NOTE, PAPER_NOTE, kernel_table, paper_table
    from adaptiveload.io import read_json

    extra = None
    if paper_map is not None:
        from adaptiveload.analysis.paper_map import paper_table_rows

        extra = paper_table_rows(read_json(paper_map, "paper-map summary"))
    run_table, stat_table = _read(runs), _read(stats)
    headline.write(headline.headline_tables(run_table, stat_table, baseline),
                   out_dir / "headline")
    table = paper_table(run_table, _read(steps), stat_table, baseline=baseline,
                        extra_rows=extra)
    table.write(out_dir / "paper_table", "AdaptiveLoad vs equal-token", PAPER_NOTE)
    kernel_table(kernel_bench).write(
        out_dir / "kernel_table", "Fused LayerNorm-Modulate kernel", KERNEL_NOTE)
    typer.echo(f"tables -> {out_dir}")


@analyze.command("figures", epilog=examples(
    "adaptiveload analyze figures --runs runs.parquet --steps steps.parquet --stats stats.csv "
    "--out-dir figures --figure throughput --figure imbalance_distribution",
))
def figures_cmd(
    runs: Runs,
    steps: Steps,
    stats: Stats,
    out_dir: Annotated[Path, Opt()],
    figure: Annotated[list[str], Opt(help="figure names to draw (repeatable)")],
    describe: Annotated[Path | None, Opt(help="`manifest describe --json` out")] = None,
    calibration: Annotated[Path | None, Opt(help="calibration JSON")] = None,
    kernel_bench: KernelBench = None,
    mixture: Annotated[
        str | None, Opt(help="the data's name in titles (a mixture or manifest file)")
    ] = None,
) -> None:
    """Draw the named figures as PNGs (names: see adaptiveload.analysis.figures.FIGURES)."""
    from adaptiveload.analysis.figures import FIGURES, FigureInputs, render
    from adaptiveload.io import read_json
    from adaptiveload.progress import progress_bar

    unknown = sorted(set(figure) - set(FIGURES))
    if unknown:
        raise UserError(f"--figure: unknown {', '.join(unknown)}; known: {', '.join(FIGURES)}")
    inputs = FigureInputs(
        runs=_read(runs), steps=_read(steps), stats=_read(stats),
        describe=read_json(describe, "manifest description") if describe else None,
        calibration=read_json(calibration, "calibration file") if calibration else None,
        kernel_bench=kernel_bench, mixture=mixture,
    )
    for name in progress_bar(iterable=figure, desc="figures", unit="fig"):
        render(name, inputs, out_dir / f"{name}.png")
    typer.echo(f"{len(figure)} figures -> {out_dir}")


@analyze.command("convergence", epilog=examples(
    "adaptiveload analyze convergence --steps steps.parquet --csv convergence.csv "
    "--md convergence.md",
))
def convergence_cmd(
    steps: Steps,
    csv: Annotated[Path, Opt(help="one row per policy and number, CSV")],
    md: Annotated[Path, Opt(help="the same with a verdict per policy")],
    baseline: Baseline = BASELINE,
    seed: FlipSeed = FLIP_SEED,
) -> None:
    """Time to a target validation loss and the loss at equal samples seen, vs the baseline."""
    from adaptiveload.analysis.convergence import Settings, compare, curves, to_markdown
    from adaptiveload.io import write_text

    table = compare(curves(_read(steps), str(steps)), Settings(baseline, seed))
    write_text(csv, table.to_csv(index=False))
    write_text(md, to_markdown(table))
    typer.echo(f"convergence: {len(table)} rows -> {csv}, {md}")


@analyze.command("paper-map", epilog=examples(
    "adaptiveload analyze paper-map --config experiments/paper_map.yaml "
    "--points results/paper_map/paper_map/points.csv "
    "--summary results/paper_map/paper_map/summary.json",
))
def paper_map_cmd(
    config: Annotated[Path, Opt(help="experiment YAML with a `paper_map` section")],
    points: Annotated[Path, Opt(help="one row per (setting, imbalance definition), CSV")],
    summary: Annotated[Path, Opt(help="consistent region, nearest settings, tornado (JSON)")],
) -> None:
    """Simulate the grid of the paper's unpublished choices and locate the paper's numbers."""
    from adaptiveload import experiment
    from adaptiveload.analysis import paper_map
    from adaptiveload.io import write_json, write_text
    from adaptiveload.planning.paper_map import sweep

    spec = experiment.load(config)["paper_map"]
    table = sweep(spec, progress=True)
    result = paper_map.summarize(table, spec)
    write_text(points, table.to_csv(index=False))
    write_json(summary, result)
    reg = result["region"]
    typer.echo(f"{reg['settings']} settings x {len(paper_map.DEFINITIONS)} imbalance "
               f"definitions, {reg['consistent_settings_count']} settings "
               f"({reg['consistent']} pairs) consistent with the paper within "
               f"±{reg['tolerance_pp']:g} pp (model) -> {points}, {summary}")


@analyze.command("paper-map-figure", epilog=examples(
    "adaptiveload analyze paper-map-figure --points results/paper_map/paper_map/points.csv "
    "--summary results/paper_map/paper_map/summary.json -o paper_map.png",
))
def paper_map_figure_cmd(
    points: Annotated[Path, Opt(help="`analyze paper-map` points CSV")],
    summary: Annotated[Path, Opt(help="`analyze paper-map` summary JSON")],
    out: Annotated[Path, Opt("--out", "-o", help="PNG to write")],
) -> None:
    """Draw where the paper's numbers lie in the map, and what moves each one most."""
    import matplotlib.pyplot as plt

    from adaptiveload.analysis.paper_map import figure
    from adaptiveload.io import atomic_path, read_json

    fig = figure(_read(points), read_json(summary, "paper-map summary"))
    with atomic_path(out) as tmp:
        fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    plt.close(fig)
    typer.echo(f"figure -> {out}")


@analyze.command("record", epilog=examples(
    "adaptiveload analyze record --experiment default --paper-table tables/paper_table.csv "
    "--stats tables/stats.csv --config results/default/config.yaml -o analysis.json",
))
def record_cmd(
    experiment: Annotated[str, Opt(help="MLflow experiment (the experiment's name)")],
    paper_table: Annotated[Path, Opt(help="paper_table.csv")],
    stats: Stats,
    out: Annotated[Path, Opt("--out", "-o", help="JSON naming the analysis run")],
    config: Annotated[
        Path | None, Opt(help="the resolved experiment YAML: params and description")
    ] = None,
    artifact: Annotated[list[Path] | None, Opt(help="file to attach (repeatable)")] = None,
) -> None:
    """Log the analysis to MLflow as the experiment's "analysis" run."""
    from adaptiveload.analysis.record import log_analysis
    from adaptiveload.io import write_json
    from adaptiveload.lifecycle import stop_on_signals
    from adaptiveload.tracking.store import tracking_uri

    stop_on_signals()  # stopped, the new analysis run is deleted with its files, not left RUNNING
    for path in (paper_table, stats):
        _read(path)  # the same one-line error as the other steps when a table is missing
    exp = None
    if config is not None:
        from adaptiveload.experiment import load

        exp = load(config)
    run_id = log_analysis(experiment, paper_table, stats, artifact or [], config=exp)
    write_json(out, {"experiment": experiment, "run_id": run_id, "tracking_uri": tracking_uri()})
    typer.echo(f"analysis run {run_id} in {tracking_uri()}")


@analyze.command("publish", epilog=examples(
    "adaptiveload analyze publish --runs results/default/analysis/runs.parquet",
    "adaptiveload analyze publish --check",
))
def publish_cmd(
    runs: Annotated[
        Path | None, Opt(help="runs.parquet of a finished run: recorded first (copied as "
                              "RECORDS/<date>-<commit>/runs.csv with its provenance)")
    ] = None,
    records: Annotated[Path, Opt(help="the experiment's recorded runs")] = Path(
        "results/reference/default"),
    doc: Annotated[
        list[Path] | None, Opt(help="a file whose generated blocks are rewritten (repeatable)",
                               show_default="README.md and docs/results.md")
    ] = None,
    check: Annotated[bool, Opt(help="write nothing; exit 2 if a file is out of date")] = False,
    baseline: Baseline = BASELINE,
) -> None:
    """The README's and docs' generated numbers, from the recorded runs (never typed)."""
    import datetime as dt
    import json

    from adaptiveload.analysis import headline
    from adaptiveload.io import write_text
    from adaptiveload.provenance import cpu_model, git_commit

    if runs is not None:
        if check:
            raise UserError("--check writes nothing: give it without --runs")
        table = _read(runs)
        now = dt.datetime.now(dt.timezone.utc)
        commit = git_commit()
        folder = records / f"{now:%Y-%m-%d}-{commit[:7]}"
        write_text(folder / headline.RUNS_FILE, table.to_csv(index=False))
        write_text(folder / "provenance.json", json.dumps({
            "recorded": now.isoformat(timespec="seconds"), "commit": commit,
            "cpu": cpu_model(), "source": str(runs),
            "devices": sorted(set(table["label"])),
        }, indent=2) + "\n")
        typer.echo(f"recorded {len(table)} runs -> {folder}")
    generated = headline.generated_blocks(records, baseline=baseline)
    stale = []
    for path in doc or [Path("README.md"), Path("docs/results.md")]:
        text = path.read_text(encoding="utf-8")
        new = headline.fill(text, generated, str(path))
        if new != text:
            stale.append(path)
            if not check:
                write_text(path, new)
    if check and stale:
        raise UserError(f"{', '.join(map(str, stale))}: generated numbers out of date; run "
                        "`adaptiveload analyze publish`")
    typer.echo(f"{'out of date' if check else 'rewritten'}: "
               f"{', '.join(map(str, stale)) or 'nothing'}")
