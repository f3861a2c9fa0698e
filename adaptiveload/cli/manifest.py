"""`adaptiveload manifest synth|probe|import|describe`: make a manifest, or say what is in one."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer

from adaptiveload.cli.app import examples, group
from adaptiveload.data.bucketing import DEFAULT_GRID, DEFAULT_MAX_FRAMES, DEFAULT_MODE, GRIDS, MODES

manifest_app = group(
    "manifest",
    "Manifests: synthesize a named mixture, probe real media, describe buckets and tokens.",
)
Opt, Arg = typer.Option, typer.Argument
OutFile = Annotated[Path, Opt("-o", "--out", help="output manifest: .csv or .parquet")]


@manifest_app.command("synth", epilog=examples(
    "adaptiveload manifest synth --mixture paper-mixed -n 20000 -o manifest.parquet",
))
def synth(
    mixture: Annotated[str, Opt(help="paper-mixed | opensora2-stage1 | images-only | ...")],
    n: Annotated[int, Opt("-n", "--num-samples", help="number of rows")],
    out: OutFile,
    seed: Annotated[int, Opt(help="generator seed")] = 0,
) -> None:
    """Write `n` rows of a named synthetic mixture (deterministic by seed)."""
    from adaptiveload.data.manifest import check_manifest_suffix, write_manifest
    from adaptiveload.data.mixtures import synthesize

    check_manifest_suffix(out)
    frame = synthesize(mixture, n, seed)
    write_manifest(out, frame)
    typer.echo(f"{out}: {len(frame)} samples of mixture {mixture} (seed {seed})", err=True)


@manifest_app.command("probe", epilog=examples(
    "adaptiveload manifest probe data/clips -o data/manifest.csv",
))
def probe(
    directory: Annotated[Path, Arg(help="folder of videos and images (searched recursively)")],
    out: OutFile,
) -> None:
    """Read frames, size and fps of real files; unreadable ones are skipped, named and counted."""
    from adaptiveload.data.manifest import check_manifest_suffix, write_manifest
    from adaptiveload.data.probe import ProbeWarning, probe_directory

    check_manifest_suffix(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProbeWarning)  # reported below, one line each
        probed = probe_directory(directory)
    for rel, reason in probed.skipped:
        typer.echo(f"warning: {directory / rel}: skipped, cannot be read: {reason}", err=True)
    frame = probed.manifest.copy()
    # paths are written relative to the manifest, which load_manifest resolves them against
    rel_to_out = os.path.relpath(directory.resolve(), out.resolve().parent)
    frame["path"] = (Path(rel_to_out).as_posix() + "/") + frame["path"]
    write_manifest(out, frame)
    typer.echo(
        f"{out}: {len(frame)} samples from {directory}, {probed.num_skipped} skipped", err=True
    )


@manifest_app.command("import", epilog=examples(
    "adaptiveload manifest import cache/ --layout musubi -o cache/manifest.csv",
    "adaptiveload manifest import cache/ --layout diffsynth --windows 3 --window-frames 5 "
    "--val-fraction 0.05 -o cache/manifest.csv",
))
def import_(
    directory: Annotated[Path, Arg(help="folder of cached latents (searched recursively)")],
    out: OutFile,
    layout: Annotated[str, Opt(help="adaptiveload | musubi | diffsynth")] = "adaptiveload",
    windows: Annotated[int, Opt(help="frame windows per clip, evenly spaced")] = 1,
    window_frames: Annotated[
        int | None, Opt(help="latent frames per window (default: the whole clip)")
    ] = None,
    val_fraction: Annotated[
        float, Opt(help="share of clips held out as split 'val' (data.val_split: val)")
    ] = 0.0,
    seed: Annotated[int, Opt(help="seed of the held-out choice")] = 0,
) -> None:
    """Index a latent cache: one row per sample, shapes from file headers, files left in place."""
    from adaptiveload.data.importers import CacheWarning, import_cache
    from adaptiveload.data.manifest import check_manifest_suffix, write_manifest

    check_manifest_suffix(out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CacheWarning)
        imported = import_cache(directory, layout, windows, window_frames, val_fraction, seed)
    for w in caught:
        typer.echo(f"warning: {w.message}", err=True)
    frame = imported.manifest.copy()
    base = out.resolve().parent
    for col in ("latent_path", "text_path"):  # relative to the manifest, which resolves them
        frame[col] = [os.path.relpath(p, base) for p in frame[col]]
    write_manifest(out, frame)
    held = int((frame["split"] == "val").sum())
    typer.echo(
        f"{out}: {len(frame)} samples from {imported.clips} clips in {directory} ({layout}), "
        f"{held} held out as split 'val'", err=True,
    )


@manifest_app.command("describe", epilog=examples(
    "adaptiveload manifest describe data/manifest.csv",
    "adaptiveload manifest describe manifest.parquet --grid tiny --json -o describe.json",
))
def describe(
    manifest: Annotated[Path, Arg(help="a .csv or .parquet manifest")],
    bucketing: Annotated[str, Opt(help=" | ".join(MODES))] = DEFAULT_MODE,
    grid: Annotated[str, Opt(help=f"aspect grid: {' | '.join(GRIDS)}")] = DEFAULT_GRID,
    max_frames: Annotated[
        int, Opt(help="longest clip kept, in frames (4k+1)")
    ] = DEFAULT_MAX_FRAMES,
    as_json: Annotated[bool, Opt("--json", help="print one JSON object")] = False,
    out: Annotated[
        Path | None, Opt("-o", "--out", help="also write the JSON object here (atomically)")
    ] = None,
) -> None:
    """Samples kept and excluded, token statistics and bucket counts under a bucketing."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.manifest import load_manifest
    from adaptiveload.io import write_json

    bucketed = bucketize(load_manifest(manifest), mode=bucketing, grid=grid, max_frames=max_frames)
    table = bucketed.bucket_table()
    summary = {
        "manifest": str(manifest),
        "bucketing": bucketing,
        "grid": bucketed.grid,
        "max_frames": max_frames,
        "num_samples": bucketed.num_samples,
        "num_bucketed": len(bucketed.samples),
        "num_excluded": bucketed.num_excluded,
        "excluded_examples": bucketed.excluded_ids.head(5).tolist(),
        "tokens": bucketed.token_stats(),
        "buckets": table.to_dict(orient="records"),
    }
    if out is not None:
        write_json(out, summary)
    if as_json:
        json.dump(summary, sys.stdout, default=int)
        sys.stdout.write("\n")
        return
    tok = summary["tokens"]
    typer.echo(
        f"{manifest}: {summary['num_samples']} samples, {summary['num_bucketed']} bucketed, "
        f"{summary['num_excluded']} excluded ({bucketing}, grid {bucketed.grid}, "
        f"max {max_frames} frames)\n"
        f"tokens: min {tok['min']}  p50 {tok['p50']:.0f}  mean {tok['mean']:.0f}  "
        f"p99 {tok['p99']:.0f}  max {tok['max']}"
    )
    typer.echo(table.to_string(index=False))
