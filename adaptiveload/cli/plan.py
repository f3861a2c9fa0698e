"""`adaptiveload plan` and `adaptiveload simulate`: thin wrappers over adaptiveload.planning."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer

from adaptiveload.cli.app import app, examples, report_note, report_warnings
from adaptiveload.costmodel import Calibration, shipped_calibrations
from adaptiveload.data.bucketing import (
    DEFAULT_GRID,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MODE,
    GRIDS,
    MODES,
    bucketize,
    cut_note,
)
from adaptiveload.errors import UserError
from adaptiveload.io import read_json, write_json, write_parquet
from adaptiveload.planning.budgets import AUTO
from adaptiveload.planning.dealing import DEFAULT_WINDOW_STEPS
from adaptiveload.planning.plan import (
    FREE,
    STEP_MODES,
    build_plan,
    check_table,
    plan_warnings,
    without_over_capacity,
)
from adaptiveload.planning.policies import POLICIES, Budgets, MissingBudgetError, get_policy
from adaptiveload.planning.simulate import DEFAULT_ALLREDUCE_GBPS, Simulation, simulate

Opt = typer.Option


def _calibration(path: Path | None, model: str | None) -> Calibration | None:
    """Load a calibration (a file, or a shipped one by name); UserError if it was made for
    another model than `model`."""
    if path is None:
        return None
    cal = Calibration.load(path)
    if model is not None:
        cal.require_model(model, path)
    return cal


# the fields of a budgets file (`adaptiveload budgets`) that planning reads
BUDGETS_FILE_FIELDS = ("calibration", "p", "m_mem", "m_comp", "m_tok", "capacity_gb", "headroom")


def read_budgets(path: Path, cal: Calibration | None) -> Calibration:
    """The calibration a budgets file was derived from (`cal`, else the one the file names),
    carrying the file's p, budgets, reference batch and capacity: so a plan uses the p
    `budgets` derived for the user's data, and predicts at that capacity."""
    data = read_json(path, "budgets file")
    missing = [k for k in BUDGETS_FILE_FIELDS if not isinstance(data, dict) or k not in data]
    if missing:
        raise UserError(
            f"{path}: field(s) {', '.join(missing)} missing; write it with `adaptiveload "
            "budgets --calibration CAL --manifest M > budgets.json`"
        )
    if cal is None:
        if not (Path(data["calibration"]).exists() or data["calibration"] in
                shipped_calibrations()):  # fmt: skip
            raise UserError(
                f"{path}: its calibration {data['calibration']!r} is not found from here; "
                "give it with --calibration"
            )
        cal = Calibration.load(data["calibration"])
    elif data.get("model", cal.model) != cal.model:
        raise UserError(
            f"{path}: budgets derived for model {data['model']!r}, the calibration is of "
            f"{cal.model!r}; derive them with this calibration (`adaptiveload budgets`)"
        )
    derivation = {k: data[k] for k in ("ref_tokens", "ref_batch", "s_lo", "s_hi") if k in data}
    return replace(
        cal, p=float(data["p"]), m_mem=float(data["m_mem"]), m_comp=float(data["m_comp"]),
        m_tok=float(data["m_tok"]), capacity_bytes=float(data["capacity_gb"]) * 1e9,
        extra={**cal.extra, "budgets": derivation, "headroom": data["headroom"]},
    )  # fmt: skip


@app.command("plan", epilog=examples(
    "adaptiveload plan --manifest manifest.csv --policy adaptiveload --world-size 16 --seed 0 "
    "--calibration experiments/calibration/h200-wan2.1-t2v-1.3b.json -o plan.parquet "
    "--summary plan.json",
    "adaptiveload plan --manifest manifest.csv --policy equal-token --world-size 4 --seed 0 "
    "--m-tok 50000 -o plan.parquet --summary plan.json",
))
def plan_cmd(
    manifest: Annotated[Path, Opt(help="manifest CSV/Parquet (adaptiveload manifest ...)")],
    policy: Annotated[str, Opt(help=f"one of: {', '.join(POLICIES)}")],
    world_size: Annotated[int, Opt(help="number of data-parallel ranks N")],
    seed: Annotated[int, Opt(help="plan seed (with the epoch, seeds all shuffles)")],
    summary: Annotated[Path | None, Opt(help="plan summary JSON to write")] = None,
    output: Annotated[
        Path | None, Opt("-o", "--output", help="plan table (Parquet) to write")
    ] = None,
    epoch: Annotated[int, Opt(help="epoch to plan")] = 0,
    calibration: Annotated[
        Path | None,
        Opt(help="calibration JSON (or a shipped one by name, e.g. h200-wan2.1-t2v-1.3b): "
            "budgets set to 'auto' and the cost model"),
    ] = None,
    budgets_file: Annotated[
        Path | None,
        Opt("--budgets", help="budgets JSON of `adaptiveload budgets` (p and budgets derived for "
            "your data, its capacity): budgets set to 'auto'; the calibration still predicts"),
    ] = None,
    strict: Annotated[
        bool, Opt("--strict", help="refuse an unusual plan (budget below every sample, "
                  "excluded or oversize samples, heavy padding) instead of warning")
    ] = False,
    m_tok: Annotated[
        str, Opt(help="equal-token budget, tokens per batch (auto: calibration, else m_mem)")
    ] = AUTO,
    m_mem: Annotated[str, Opt(help="memory budget, tokens per batch (auto: calibration)")] = AUTO,
    m_comp: Annotated[
        str, Opt(help="compute budget, B*S^p per batch (auto: calibration's, at --p)")
    ] = AUTO,
    p: Annotated[
        str,
        Opt(help="compute exponent in [1, 3] (auto: calibration); an auto --m-comp follows it, "
            "the calibration's reference batch kept (the p sweep)"),
    ] = AUTO,
    m_comp_scale: Annotated[
        float, Opt(help="multiply the calibration's M_comp (auto --m-comp only; the M_comp sweep)")
    ] = 1.0,
    pack_tokens: Annotated[
        float | None,
        Opt(help="adaptiveload-packed: at most this many tokens per pack (default: packs fill "
            "toward the memory budget, M_mem as predicted memory with a calibration)"),
    ] = None,
    bucketing: Annotated[str, Opt(help=" | ".join(MODES))] = DEFAULT_MODE,
    grid: Annotated[str, Opt(help=" | ".join(GRIDS))] = DEFAULT_GRID,
    max_frames: Annotated[int, Opt(help="frames cap of the bucket grid")] = DEFAULT_MAX_FRAMES,
    window_steps: Annotated[
        int, Opt(help="balanced dealing window in steps (0 = whole epoch)")
    ] = DEFAULT_WINDOW_STEPS,
    steps_per_epoch: Annotated[
        str, Opt(help="free (the policy's own step count) | match (equal-token's for these "
                 "samples and ranks) | an integer: optimizer steps per epoch")
    ] = FREE,
    model: Annotated[str | None, Opt(help="refuse a calibration made for another model")] = None,
    allreduce_gbps: Annotated[
        float, Opt(help="ring all-reduce bandwidth, Gbit/s (predicted metrics)")
    ] = DEFAULT_ALLREDUCE_GBPS,
    simulation_steps: Annotated[
        Path | None,
        Opt(help="also write the predicted per-(step, rank) table (Parquet; needs --calibration)"),
    ] = None,
    simulation_summary: Annotated[
        Path | None, Opt(help="also write the simulation's run summary (JSON)")
    ] = None,
    warmup_steps: Annotated[
        int, Opt(help="steps left out of the simulation summary's metrics")
    ] = 0,
    experiment: Annotated[
        str | None, Opt(help="experiment name for the simulation summary")
    ] = None,
) -> None:
    """Plan one epoch: which samples form each micro-batch, and which rank runs it when.

    With a calibration the plan is simulated once through its cost model: the summary's
    predictions, and with --simulation-steps/--simulation-summary what `adaptiveload simulate`
    would write for it, without simulating it again."""
    from adaptiveload.data.manifest import load_manifest

    pol = get_policy(policy)
    cal = _calibration(calibration, model)
    derived = read_budgets(budgets_file, cal) if budgets_file is not None else None
    budgets = Budgets.resolve(
        m_tok, m_mem, m_comp, p, calibration=derived or cal, m_comp_scale=m_comp_scale,
        pack_tokens=pack_tokens,
    )  # fmt: skip
    try:
        pol.check(budgets)
    except MissingBudgetError as exc:  # the library's message names Budgets; here: the flags
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in exc.missing)
        raise UserError(
            f"policy {policy}: budget(s) {', '.join(exc.missing)} not set; give {flags}, "
            "--budgets FILE (`adaptiveload budgets --calibration CAL --manifest M` derives "
            "them for your data) or --calibration CAL (a shipped one by name: "
            f"{', '.join(shipped_calibrations())}; or `adaptiveload calibrate measure` on your "
            "GPU, `adaptiveload calibrate prior --rates h200` without one)"
        ) from None
    cal = derived or cal  # with a budgets file: its calibration, at the budgets' capacity
    _positive(allreduce_gbps=allreduce_gbps)
    simulated = simulation_steps is not None or simulation_summary is not None
    if summary is None and output is None and not simulated:
        raise UserError("plan: nothing to write; give --summary, -o, --simulation-steps or "
                        "--simulation-summary")  # fmt: skip
    if simulated and cal is None:
        raise UserError("--simulation-steps/--simulation-summary: give --calibration (the cost "
                        "model the plan is simulated through)")  # fmt: skip
    _check_warmup(warmup_steps)
    bucketed = bucketize(load_manifest(manifest), mode=bucketing, grid=grid, max_frames=max_frames)
    bucketed = without_over_capacity(bucketed, cal)  # excluded, and named, like the rest
    plan = build_plan(
        bucketed, pol, budgets, world_size, seed, epoch, cost_model=cal,
        window_steps=window_steps or None, allreduce_gbps=allreduce_gbps,
        steps_per_epoch=_step_mode(steps_per_epoch),
    )  # fmt: skip
    info = {
        "manifest": str(manifest), "bucketing": bucketing, "grid": grid,
        "calibration": str(calibration) if calibration else None,
        "budgets_file": str(budgets_file) if budgets_file else None,
        "calibration_label": cal.label if cal else None,
    }  # fmt: skip
    plan.table.attrs["plan"].update(info)
    found = plan_warnings(plan.summary, bucketed.excluded_ids.tolist())
    report_warnings(f"plan ({plan.summary['policy']})", found, strict)
    report_note(cut_note(bucketed.samples))
    if output is not None:
        write_parquet(output, plan.table)
    if summary is not None:
        write_json(summary, {**plan.summary, **info})
    if simulated:
        sim = plan.simulation.timed(warmup_steps)
        _write_simulation(sim, {**plan.summary, **info}, experiment, simulation_steps,
                          simulation_summary)  # fmt: skip
    s = plan.summary
    unit = "packs" if pol.packed else "batches"
    line = f"{s['policy']}: {s['steps']} steps x {s['world_size']} ranks, {s['batches']} {unit}"
    if "predicted_imbalance_rate" in s:
        line += f", predicted imbalance {s['predicted_imbalance_rate']:.1%} (model)"
    if s.get("predicted_vs_lower_bound"):
        line += f", {s['predicted_vs_lower_bound']:.3f}x the steps' lower bound"
    if s.get("predicted_vs_epoch_lower_bound"):
        ratio, k_min = s["predicted_vs_epoch_lower_bound"], s["min_steps_per_epoch"]
        line += f", {ratio:.3f}x the epoch's lower bound (K_min {k_min} steps)"
    typer.echo(line)


def _step_mode(value: str) -> str | int:
    """--steps-per-epoch as build_plan takes it: free, match or a step count."""
    if value in STEP_MODES:
        return value
    try:
        return int(value)
    except ValueError:
        raise UserError(
            f"--steps-per-epoch {value!r}: expected {' | '.join(STEP_MODES)} or an integer >= 1"
        ) from None


@app.command("simulate", epilog=examples(
    "adaptiveload simulate --plan plan.parquet "
    "--calibration experiments/calibration/h200-wan2.1-t2v-1.3b.json --json",
))
def simulate_cmd(
    plan: Annotated[Path, Opt(help="plan table written by `adaptiveload plan`")],
    calibration: Annotated[Path, Opt(help="calibration JSON (cost model, capacity, grads)")],
    allreduce_gbps: Annotated[
        float, Opt(help="ring all-reduce bandwidth, Gbit/s")
    ] = DEFAULT_ALLREDUCE_GBPS,
    grad_bytes: Annotated[
        float | None, Opt(help="gradient bytes", show_default="the calibration's, else 0")
    ] = None,
    warmup_steps: Annotated[int, Opt(help="steps left out of the summary metrics")] = 0,
    steps_per_epoch: Annotated[
        str, Opt(help="free (the policy's own step count) | match (equal-token's for these "
                 "samples and ranks) | an integer: optimizer steps per epoch")
    ] = FREE,
    model: Annotated[str | None, Opt(help="refuse a calibration made for another model")] = None,
    experiment: Annotated[str | None, Opt(help="experiment name for the run summary")] = None,
    as_json: Annotated[bool, Opt("--json", help="print the summary as JSON")] = False,
    output: Annotated[
        Path | None, Opt("-o", "--output", help="per-(step, rank) table (Parquet)")
    ] = None,
    summary: Annotated[Path | None, Opt(help="run summary JSON to write")] = None,
) -> None:
    """Predict per-step, per-rank times of a plan through a calibration (labelled `model`)."""
    cal = _calibration(calibration, model)
    _positive(allreduce_gbps=allreduce_gbps)
    if grad_bytes is not None and grad_bytes < 0:
        raise UserError(f"--grad-bytes {grad_bytes}: must be >= 0")
    _check_warmup(warmup_steps)
    table = _read_plan(plan)
    sim = simulate(
        table, cal, allreduce_gbps=allreduce_gbps, grad_bytes=grad_bytes,
        warmup_steps=warmup_steps,
    )  # fmt: skip
    run = _write_simulation(sim, table.attrs.get("plan", {}), experiment, output, summary)
    if as_json:
        typer.echo(json.dumps(run, indent=2, default=float))
    else:
        typer.echo(
            f"{run['policy']}: imbalance {run.get('imbalance_rate', math.nan):.1%}, "
            f"{run.get('samples_per_s', math.nan):.3g} samples/s (model, {cal.label})"
        )


def _write_simulation(
    sim: Simulation, plan: dict, experiment: str | None, steps: Path | None,
    summary: Path | None,
) -> dict:  # fmt: skip
    """The run summary of a simulated plan (what the analysis reads beside its per-step
    table; `plan`: the plan's own summary), written with the table where asked."""
    run = {
        "experiment": experiment, "policy": plan.get("policy"), "seed": plan.get("seed"),
        "epoch": plan.get("epoch"), "kernel": None, "plan": plan, **sim.summary,
    }  # fmt: skip
    if steps is not None:
        write_parquet(steps, sim.steps)
    if summary is not None:
        write_json(summary, run)
    return run


def _check_warmup(warmup_steps: int) -> None:
    if warmup_steps < 0:
        raise UserError(f"--warmup-steps {warmup_steps}: must be >= 0")


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be positive")


def _read_plan(path: Path) -> pd.DataFrame:
    from adaptiveload.io import read_table

    table = read_table(path, "plan file", "pass a plan table `adaptiveload plan -o` writes")
    check_table(table, str(path))
    return table
