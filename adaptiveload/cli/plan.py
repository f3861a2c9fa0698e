"""`adaptiveload plan` and `adaptiveload simulate`: thin wrappers over adaptiveload.planning."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer

from adaptiveload.cli import options as o
from adaptiveload.cli.app import app, examples, report_note, report_warnings
from adaptiveload.costmodel import Calibration, read_budgets, shipped_calibrations
from adaptiveload.data.bucketing import (
    DEFAULT_GRID,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MODE,
    DEFAULT_SHORT_CLIPS,
    bucketize,
    cut_note,
    stills_warning,
)
from adaptiveload.errors import UserError
from adaptiveload.io import write_json, write_parquet
from adaptiveload.planning.budgets import AUTO
from adaptiveload.planning.dealing import DEFAULT_WINDOW_STEPS
from adaptiveload.planning.plan import (
    FREE,
    Plan,
    PlanConfig,
    check_table,
    plan_warnings,
    without_over_capacity,
)
from adaptiveload.planning.policies import Budgets, MissingBudgetError, Policy
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


@app.command("plan", epilog=examples(
    "adaptiveload plan --manifest manifest.csv --policy adaptiveload --world-size 16 --seed 0 "
    "--calibration experiments/calibration/h200-wan2.1-t2v-1.3b.json -o plan.parquet "
    "--summary plan.json",
    "adaptiveload plan --manifest manifest.csv --policy equal-token --world-size 4 --seed 0 "
    "--m-tok 50000 -o plan.parquet --summary plan.json",
))
def plan_cmd(
    manifest: o.Manifest,
    policy: o.Policy,
    world_size: o.WorldSize,
    seed: o.Seed,
    summary: o.Summary = None,
    output: o.Table = None,
    epoch: o.Epoch = 0,
    calibration: o.CalibrationFile = None,
    budgets_file: o.BudgetsFile = None,
    strict: o.Strict = False,
    m_tok: o.MTok = AUTO,
    m_mem: o.MMem = AUTO,
    m_comp: o.MComp = AUTO,
    p: o.P = AUTO,
    m_comp_scale: o.MCompScale = 1.0,
    pack_tokens: o.PackTokens = None,
    bucketing: o.Bucketing = DEFAULT_MODE,
    grid: o.Grid = DEFAULT_GRID,
    max_frames: o.MaxFrames = DEFAULT_MAX_FRAMES,
    short_clips: o.ShortClips = DEFAULT_SHORT_CLIPS,
    window_steps: o.WindowSteps = DEFAULT_WINDOW_STEPS,
    steps_per_epoch: o.StepsPerEpoch = FREE,
    model: o.Model = None,
    allreduce_gbps: o.AllreduceGbps = DEFAULT_ALLREDUCE_GBPS,
    simulation_steps: o.SimulationSteps = None,
    simulation_summary: o.SimulationSummary = None,
    experiment: o.Experiment = None,
    val_split: o.ValSplit = None,
) -> None:
    """Plan one epoch: which samples form each micro-batch, and which rank runs it when.

    With a calibration the plan is simulated once through its cost model: the summary's
    predictions, and with --simulation-steps/--simulation-summary what `adaptiveload simulate`
    would write for it, without simulating it again."""
    flags = {"m_tok": m_tok, "m_mem": m_mem, "m_comp": m_comp, "p": p, "pack_tokens": pack_tokens}
    cal = _calibration(calibration, model)
    cal = read_budgets(budgets_file, cal) if budgets_file is not None else cal
    budgets = Budgets.resolve(**flags, calibration=cal, m_comp_scale=m_comp_scale)
    config = plan_config(policy, budgets, world_size, seed, epoch, cal, window_steps,
                         steps_per_epoch, allreduce_gbps)
    writes = _Outputs(summary, output, simulation_steps, simulation_summary,
                      experiment).checked(cal)
    bucketed = bucketize(_training_rows(manifest, val_split), mode=bucketing, grid=grid,
                         max_frames=max_frames, short_clips=short_clips)
    bucketed = without_over_capacity(bucketed, cal, config.max_degree)  # named, like the rest
    plan = config.plan(bucketed)
    info = {"manifest": str(manifest), "bucketing": bucketing, "grid": grid,
            **_sources(calibration, budgets_file, cal)}
    plan.table.attrs["plan"].update(info)
    found = plan_warnings(plan.summary, bucketed.excluded_ids.tolist())
    found += [w for w in (stills_warning(bucketed.samples),) if w]
    report_warnings(f"plan ({plan.summary['policy']})", found, strict)
    report_note(cut_note(bucketed.samples))
    writes.write(plan, info)
    typer.echo(_plan_line(plan.summary, config.policy))


def _training_rows(manifest: Path, val_split: str | None) -> pd.DataFrame:
    """The manifest's rows training plans: a held-out split is scored, never trained on."""
    from adaptiveload.data.manifest import load_manifest
    from adaptiveload.training.inputs import split_holdout

    return split_holdout(load_manifest(manifest), val_split, manifest, val_every=None)[0]


def plan_config(
    policy: str, budgets: Budgets, world_size: int, seed: int, epoch: int,
    cal: Calibration | None, window_steps: int, steps_per_epoch: str, allreduce_gbps: float,
) -> PlanConfig:
    """The PlanConfig of `adaptiveload plan`'s flags (--window-steps 0: the whole epoch); a
    missing budget is named by the flags that set it."""
    _positive(allreduce_gbps=allreduce_gbps)
    try:
        return PlanConfig(
            policy, budgets, world_size, seed, epoch, cost_model=cal,
            window_steps=window_steps or None, steps_per_epoch=o.step_mode(steps_per_epoch),
            allreduce_gbps=allreduce_gbps,
        )
    except MissingBudgetError as exc:  # the library's message names Budgets; here: the flags
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in exc.missing)
        raise UserError(
            f"policy {policy}: budget(s) {', '.join(exc.missing)} not set; give {flags}, "
            "--budgets FILE (`adaptiveload budgets --calibration CAL --manifest M` derives "
            "them for your data) or --calibration CAL (a shipped one by name: "
            f"{', '.join(shipped_calibrations())}; or `adaptiveload calibrate measure` on your "
            "GPU, `adaptiveload calibrate prior --rates h200` without one)"
        ) from None


@dataclass(frozen=True)
class _Outputs:
    """What `adaptiveload plan` writes: the summary, the table, the simulation's per-step
    table and run summary (the latter two need a cost model)."""

    summary: Path | None
    table: Path | None
    simulation_steps: Path | None
    simulation_summary: Path | None
    experiment: str | None

    @property
    def simulated(self) -> bool:
        return self.simulation_steps is not None or self.simulation_summary is not None

    def checked(self, cal: Calibration | None) -> _Outputs:
        """These outputs; UserError before any planning where nothing would be written, or a
        simulation has no cost model."""
        if self.summary is None and self.table is None and not self.simulated:
            raise UserError("plan: nothing to write; give --summary, -o, --simulation-steps or "
                            "--simulation-summary")
        if self.simulated and cal is None:
            raise UserError("--simulation-steps/--simulation-summary: give --calibration (the "
                            "cost model the plan is simulated through)")
        return self

    def write(self, plan: Plan, info: dict) -> None:
        if self.table is not None:
            write_parquet(self.table, plan.table)
        if self.summary is not None:
            write_json(self.summary, {**plan.summary, **info})
        if self.simulated:
            _write_simulation(plan.simulation, {**plan.summary, **info}, self.experiment,
                              self.simulation_steps, self.simulation_summary)


def _sources(
    calibration: Path | None, budgets_file: Path | None, cal: Calibration | None
) -> dict[str, str | None]:
    """Where a plan's cost model and budgets came from, for its summary."""
    return {
        "calibration": str(calibration) if calibration else None,
        "budgets_file": str(budgets_file) if budgets_file else None,
        "calibration_label": cal.label if cal else None,
    }


def _plan_line(s: dict, policy: Policy) -> str:
    """The one line `adaptiveload plan` prints: steps, ranks, micro-batches, predictions."""
    unit = "packs" if policy.packed else "batches"
    line = f"{s['policy']}: {s['steps']} steps x {s['world_size']} ranks, {s['batches']} {unit}"
    if "predicted_imbalance_rate" in s:
        line += f", predicted imbalance {s['predicted_imbalance_rate']:.1%} (model)"
    if s.get("predicted_vs_lower_bound"):
        line += f", {s['predicted_vs_lower_bound']:.3f}x the steps' lower bound"
    if s.get("predicted_vs_epoch_lower_bound"):
        ratio, k_min = s["predicted_vs_epoch_lower_bound"], s["min_steps_per_epoch"]
        line += f", {ratio:.3f}x the epoch's lower bound (K_min {k_min} steps)"
    return line


@app.command("simulate", epilog=examples(
    "adaptiveload simulate --plan plan.parquet "
    "--calibration experiments/calibration/h200-wan2.1-t2v-1.3b.json --json",
))
def simulate_cmd(
    plan: Annotated[Path, Opt(help="plan table written by `adaptiveload plan`")],
    calibration: Annotated[Path, Opt(help="calibration JSON (cost model, capacity, grads)")],
    allreduce_gbps: o.AllreduceGbps = DEFAULT_ALLREDUCE_GBPS,
    grad_bytes: Annotated[
        float | None, Opt(help="gradient bytes", show_default="the calibration's, else 0")
    ] = None,
    model: o.Model = None,
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
    table = _read_plan(plan)
    sim = simulate(table, cal, allreduce_gbps=allreduce_gbps, grad_bytes=grad_bytes)
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
) -> dict:
    """The run summary of a simulated plan (what the analysis reads beside its per-step
    table; `plan`: the plan's own summary), written with the table where asked."""
    run = {
        "experiment": experiment, "policy": plan.get("policy"), "seed": plan.get("seed"),
        "epoch": plan.get("epoch"), "kernel": None, "plan": plan, **sim.summary,
    }
    if steps is not None:
        write_parquet(steps, sim.steps)
    if summary is not None:
        write_json(summary, run)
    return run


def _positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise UserError(f"--{name.replace('_', '-')} {value}: must be positive")


def _read_plan(path: Path) -> pd.DataFrame:
    from adaptiveload.io import read_table

    table = read_table(path, "plan file", "pass a plan table `adaptiveload plan -o` writes")
    check_table(table, str(path))
    return table


@app.command("closed-loop", epilog=examples(
    "adaptiveload closed-loop --config experiments/closed_loop/model.yaml "
    "-o results/benchmarks/closed_loop_model.json",
    "adaptiveload closed-loop --config experiments/closed_loop/model.yaml --seed 3 --seed 4 "
    "-o results/benchmarks/closed_loop_model_holdout.json",
))
def closed_loop_cmd(
    config: Annotated[Path, Opt(help="YAML file with a `closed_loop` section")],
    output: Annotated[Path, Opt("-o", "--output", help="results JSON to write")],
    seed: Annotated[
        list[int] | None, Opt(help="seed to run instead of the file's (repeatable): a holdout "
                                   "of the same setups", show_default="the file's `seeds`")
    ] = None,
) -> None:
    """Open loop, closed loop (refit every window) and oracle on a true device unlike the
    prior (planning.closed_loop; every number `model`). The results JSON holds the section as
    run (--seed in it)."""
    import yaml

    from adaptiveload.planning.closed_loop import experiment

    if not config.exists():
        raise UserError(f"{config}: file not found; give the experiment file with --config")
    spec = yaml.safe_load(config.read_text()) or {}
    if not isinstance(spec.get("closed_loop"), dict):
        raise UserError(f"{config}: field 'closed_loop' missing; see experiments/closed_loop/")
    section = spec["closed_loop"] if seed is None else {**spec["closed_loop"], "seeds": seed}
    rows = experiment(section)
    write_json(output, {"source": "model", "config": str(config), "spec": section, "rows": rows})
    for r in rows:
        after = r["after_first_window"]
        typer.echo(
            f"{r['calibration']} {r['mixture']} N={r['world_size']} ({r['num_samples']:,} "
            f"samples) p{r['p_shift']:+} "
            f"c0x{r['c0_scale']}: after the first window closed/oracle "
            f"{after['closed_s'] / after['oracle_s']:.3f}, open/oracle "
            f"{after['open_s'] / after['oracle_s']:.3f} (model)"
        )
