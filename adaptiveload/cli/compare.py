"""`adaptiveload compare`: every policy on your data, side by side, before you train."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from adaptiveload.cli import options as o
from adaptiveload.cli.app import app, examples, report_note, report_warnings
from adaptiveload.data.bucketing import (
    DEFAULT_GRID,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MODE,
    DEFAULT_SHORT_CLIPS,
    cut_note,
    stills_warning,
)
from adaptiveload.errors import UserError
from adaptiveload.planning.plan import FREE

Opt = typer.Option


@app.command("compare", epilog=examples(
    "adaptiveload compare --manifest my.csv --world-size 8 --calibration h200-wan2.1-t2v-1.3b",
    "adaptiveload compare --manifest my.csv --world-size 8 --prior h200 "
    "--model wan2.1-t2v-1.3b --capacity-gb 80 -o compare.json",
    "adaptiveload compare --mixture paper-mixed --world-size 16 "
    "--calibration h200-wan2.1-t2v-1.3b-measured",
    "adaptiveload compare --mixture paper-mixed --world-size 16 "
    "--calibration h200-wan2.1-t2v-1.3b-measured --steps-per-epoch match "
    "--policies adaptiveload-packed,flop-greedy,token-kk",
))
def compare_cmd(
    world_size: Annotated[int, Opt(help="data-parallel ranks N (the data-parallel group's size)")],
    manifest: Annotated[Path | None, Opt(help="your manifest (CSV/Parquet)")] = None,
    mixture: Annotated[str | None, Opt(help="or a named synthetic mixture")] = None,
    num_samples: Annotated[int, Opt(help="samples drawn from --mixture")] = 20000,
    calibration: o.CalibrationFile = None,
    prior: Annotated[
        str | None, Opt(help="or a device prior (h200): the analytic cost model of --model")
    ] = None,
    model: Annotated[str | None, Opt(help="model of --prior (e.g. wan2.1-t2v-1.3b)")] = None,
    capacity_gb: Annotated[
        float | None,
        Opt(help="device memory to budget against, GB", show_default="the calibration's"),
    ] = None,
    headroom: Annotated[
        float | None, Opt(help="fraction of capacity kept free", show_default="the calibration's")
    ] = None,
    budgets_file: o.BudgetsFile = None,
    policies: Annotated[
        str | None, Opt(help="comma-separated policies", show_default="every registered one")
    ] = None,
    seed: Annotated[int, Opt(help="plan seed")] = 0,
    steps_per_epoch: o.StepsPerEpoch = FREE,
    bucketing: o.Bucketing = DEFAULT_MODE,
    grid: o.Grid = DEFAULT_GRID,
    max_frames: o.MaxFrames = DEFAULT_MAX_FRAMES,
    short_clips: o.ShortClips = DEFAULT_SHORT_CLIPS,
    output: Annotated[Path | None, Opt("-o", "--output", help="also write it as JSON")] = None,
    strict: o.Strict = False,
) -> None:
    """Predict every policy's imbalance, idle fraction, VRAM utilization and samples/s on your
    data (all `model`, through one cost model), with the budgets `adaptiveload plan` would use.

    Budgets follow `plan`'s rule: --calibration plans with the calibration's own p and budgets
    (those of the mix it was made for); --budgets FILE with those `adaptiveload budgets`
    derived for your data (its p, budgets and capacity). A --prior has no budgets of its own:
    they are derived for this data, at --capacity-gb.
    """
    from adaptiveload.io import write_json
    from adaptiveload.planning.compare import CompareConfig, compare_policies, comparison_rows
    from adaptiveload.planning.plan import without_over_capacity

    bucketed, origin = _bucketed(manifest, mixture, num_samples, bucketing, grid, max_frames,
                                 short_clips)
    tokens = bucketed.samples["tokens"].to_numpy()
    cal = _cost_model(calibration, prior, model, tokens, origin)
    cal, source = _budgets(cal, budgets_file, prior, capacity_gb, headroom, tokens)
    names = [p.strip() for p in policies.split(",") if p.strip()] if policies else None
    config = CompareConfig(cal, world_size, seed, names,
                           steps_per_epoch=o.step_mode(steps_per_epoch))
    # the header counts what every plan leaves out (one of fewer ranks per sample, more)
    bucketed = without_over_capacity(bucketed, cal, config.max_degree)
    summaries = compare_policies(bucketed, config)
    _warn(summaries, bucketed, strict)
    data = {"origin": origin, "bucketing": bucketing, "grid": grid, "short_clips": short_clips}
    report = _report(config, bucketed, data, calibration, prior, source, summaries)
    if output is not None:
        write_json(output, report)
    typer.echo(_text(report, comparison_rows(summaries)))


def _warn(summaries: list[dict[str, Any]], bucketed: Any, strict: bool) -> None:
    """Each plan's warnings under its policy's name, then those of the data (once for all)."""
    from adaptiveload.planning.plan import plan_warnings

    for s in summaries:
        found = plan_warnings(s, bucketed.excluded_ids.tolist())
        report_warnings(f"plan ({s['policy']})", found, strict)
    report_warnings("compare", [w for w in (stills_warning(bucketed.samples),) if w], strict)
    report_note(cut_note(bucketed.samples))


def _report(
    config: Any,
    bucketed: Any,
    data: dict[str, Any],
    calibration: Path | None,
    prior: str | None,
    source: str,
    summaries: list[dict[str, Any]],
) -> dict[str, Any]:
    """What `compare -o` writes: the data, ranks and seed, the cost model, the budgets every
    policy planned with (and where they come from), each policy's plan summary."""
    cal = config.calibration
    derivation = cal.extra.get("budgets") or {}
    counts = {"num_samples": bucketed.num_samples, "num_excluded": bucketed.num_excluded}
    return {
        "data": {"origin": data["origin"], **counts,
                 **{k: data[k] for k in ("bucketing", "grid", "short_clips")}},
        "world_size": config.world_size,
        "seed": config.seed,
        "steps_per_epoch": config.steps_per_epoch,
        "calibration": {"file": str(calibration) if calibration else None, "prior": prior,
                        "model": cal.model, "label": cal.label,
                        "capacity_gb": cal.capacity_bytes / 1e9,
                        "headroom": cal.extra.get("headroom", cal.headroom)},
        "budgets": {"p": cal.p, "m_tok": cal.m_tok, "m_mem": cal.m_mem, "m_comp": cal.m_comp,
                    "source": source,
                    **{k: derivation.get(k) for k in ("ref_tokens", "ref_batch")}},
        "policies": summaries,
    }


def _budgets(
    cal: Any, budgets_file: Path | None, prior: str | None, capacity_gb: float | None,
    headroom: float | None, tokens: Any,
) -> tuple[Any, str]:
    """The cost model with the budgets `plan` would use (the rule in compare_cmd's help), and
    where they come from."""
    from adaptiveload.costmodel import read_budgets

    rederive = capacity_gb is not None or headroom is not None
    if budgets_file is not None or prior is None:
        if rederive:
            raise UserError(
                "compare: --capacity-gb/--headroom derive budgets, which `plan` reads from a "
                "budgets file: write it with `adaptiveload budgets --calibration CAL --manifest "
                "M --capacity-gb G > budgets.json` and pass --budgets budgets.json"
            )
        if budgets_file is not None:
            return read_budgets(budgets_file, cal), f"derived for your data ({budgets_file})"
        return cal, "the calibration's own (--budgets FILE: derived for your data)"
    capacity = None if capacity_gb is None else capacity_gb * 1e9
    return cal.for_tokens(tokens, capacity, headroom), "derived for this data (a prior's)"


def _bucketed(
    manifest: Path | None, mixture: str | None, num_samples: int, bucketing: str, grid: str,
    max_frames: int, short_clips: str,
) -> tuple[Any, str]:
    """The data to compare on, bucketed, and how to name it."""
    from adaptiveload.data.bucketing import bucketize
    from adaptiveload.data.manifest import load_manifest
    from adaptiveload.data.mixtures import synthesize

    if (manifest is None) == (mixture is None):
        raise UserError("compare: give exactly one of --manifest or --mixture (your data)")
    if manifest is not None:
        frame, origin = load_manifest(manifest), str(manifest)
    else:
        frame, origin = synthesize(mixture, num_samples, 0), f"mixture {mixture} (n={num_samples})"
    bucketed = bucketize(frame, mode=bucketing, grid=grid, max_frames=max_frames,
                         short_clips=short_clips)
    return bucketed, origin


def _cost_model(
    calibration: Path | None, prior: str | None, model: str | None, tokens: Any, origin: str
) -> Any:
    """A calibration file (or shipped name), or the analytic prior of `model` on a device."""
    from adaptiveload.costmodel import Calibration

    if (calibration is None) == (prior is None):
        raise UserError(
            "compare: give exactly one of --calibration (a file, or a shipped name such as "
            "h200-wan2.1-t2v-1.3b) or --prior h200 with --model"
        )
    if calibration is not None:
        cal = Calibration.load(calibration)
        if model is not None:
            cal.require_model(model, calibration)
        return cal
    if model is None:
        raise UserError("compare: --prior needs --model (e.g. wan2.1-t2v-1.3b)")
    from adaptiveload.calibration.mix import TokenMix
    from adaptiveload.calibration.prior import prior as analytic_prior

    return analytic_prior(model, prior, TokenMix(tokens, origin))


def _text(report: dict[str, Any], rows: list[list[str]]) -> str:
    """The printed comparison: what was compared, the budgets, the table."""
    data, cal, b = report["data"], report["calibration"], report["budgets"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines = [
        f"{data['origin']}: {data['num_samples']} samples ({data['num_excluded']} excluded), "
        f"{report['world_size']} ranks, seed {report['seed']}, steps per epoch "
        f"{report['steps_per_epoch']}",
        f"cost model: {cal['model']}, {cal['label']}, capacity {cal['capacity_gb']:.4g} GB, "
        f"headroom {cal['headroom']:.0%}",
        f"budgets: p={b['p']:.3f}  M_tok={b['m_tok']:,.0f}  M_mem={b['m_mem']:,.0f}"
        f"  M_comp={b['m_comp']:.4g}  ({b['source']})",
        "",
        *table,
        "",
        f"all predicted (model, through {cal['label']}); imbalance (max - min)/max of rank "
        "compute per step, mean over steps",
    ]
    return "\n".join(lines)
