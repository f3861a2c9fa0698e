"""`adaptiveload calibrate`: measure (or, with --prior, model) a cost model and its budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from adaptiveload.cli.app import app, examples
from adaptiveload.data.bucketing import (
    DEFAULT_GRID,
    DEFAULT_MAX_FRAMES,
    DEFAULT_MODE,
    GRIDS,
    MODES,
)
from adaptiveload.errors import UserError
from adaptiveload.experiment import schema_default

Opt = typer.Option
RELEASED = ("wan2.1-t2v-1.3b", "wan2.1-t2v-14b")


def _ints(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,2,4") from None


_SCHEMA = object()  # `_pick`'s default: the schema's default of calibration.<key>


def _pick(flag: Any, section: dict[str, Any], key: str, default: Any = _SCHEMA) -> Any:
    """An explicit flag wins over the experiment file, which wins over the default (the
    schema's, unless the command line alone means something else)."""
    if flag is not None:
        return flag
    if default is _SCHEMA:
        default = schema_default(f"calibration.{key}")
    return section.get(key, default)


def _token_mix(
    manifest: Path | None, mixture: str | None, num_samples: int, seed: int,
    data: dict[str, Any], model_name: str, grid: str | None, bucketing: str | None,
) -> Any:  # fmt: skip
    """The token mix the budgets are derived for: --manifest, --mixture, else the experiment's
    data; None when there is none (the calibration then budgets its own grid)."""
    from adaptiveload.calibration.mix import manifest_token_mix, mixture_token_mix

    grid_name = grid or data.get("grid") or (DEFAULT_GRID if model_name in RELEASED else "tiny")
    mode = bucketing or data.get("bucketing", DEFAULT_MODE)
    max_frames = data.get("max_frames", DEFAULT_MAX_FRAMES)
    if manifest is None and mixture is None:  # no flag: the experiment's data, if any
        manifest, mixture = data.get("manifest") or None, data.get("mixture") or None
        num_samples = data.get("num_samples", num_samples)
    if manifest is not None:
        return manifest_token_mix(manifest, mode, grid_name, max_frames)
    if mixture is not None:
        return mixture_token_mix(mixture, num_samples, seed, mode, grid_name, max_frames)
    return None


def _report(output: Path, cal: Any) -> None:
    """One line on the fit and the budgets (and one on the validation, when it ran)."""
    fit = cal.extra["fit"]
    loo = (
        f", {fit['form']} form, leave-one-out median {100 * fit['loo_median']:.1f}% max "
        f"{100 * fit['loo_max']:.1f}%"
        if fit.get("loo_max") is not None
        else ""
    )
    typer.echo(
        f"{output}: {cal.label} {cal.model}: p={cal.p:.3f} M_tok={cal.m_tok:.4g} "
        f"M_mem={cal.m_mem:.4g} M_comp={cal.m_comp:.4g} (fit R^2={fit['r2']:.4f}, worst point "
        f"{100 * fit['max_rel_err']:.1f}%{loo}; memory: {cal.extra['memory_source']})",
        err=True,
    )
    val = cal.extra.get("validation")
    if val and val["num_measured"]:
        typer.echo(
            f"validation: {val['num_measured']} planned micro-batches, |pred-meas|/meas median "
            f"{100 * val['median_rel_err']:.1f}% p95 {100 * val['p95_rel_err']:.1f}%",
            err=True,
        )


@app.command("calibrate", epilog=examples(
    "adaptiveload calibrate --model wan2.1-tiny --mixture tiny-cpu --capacity-gb 0.15 "
    "-o calibration.json",
    "adaptiveload calibrate --config experiments/default.yaml -o calibration.json",
    "adaptiveload calibrate --model wan2.1-t2v-1.3b --prior h200 --mixture paper-mixed "
    "-o h200-1.3b.json",
))
def calibrate_cmd(
    output: Annotated[Path, Opt("-o", "--output", help="calibration JSON to write")],
    model: Annotated[
        str | None, Opt(help="model config", show_default="--config's, else wan2.1-tiny")
    ] = None,
    device: Annotated[
        str | None, Opt(help="cpu | cuda", show_default="--config's, else cpu")
    ] = None,
    batch_sizes: Annotated[str | None, Opt(help="grid batch sizes, e.g. 1,2,4")] = None,
    tokens: Annotated[str | None, Opt(help="grid token counts, e.g. 16,64,256,1024,4096")] = None,
    manifest: Annotated[
        Path | None, Opt(help="manifest whose token range sets p and the reference bucket")
    ] = None,
    mixture: Annotated[str | None, Opt(help="or a named synthetic mixture (e.g. tiny-cpu)")] = None,
    num_samples: Annotated[int, Opt(help="samples drawn from --mixture")] = 20000,
    grid: Annotated[
        str | None, Opt(help="bucket grid for raw manifests: wan | tiny", show_default="by model")
    ] = None,
    bucketing: Annotated[str | None, Opt(help="aspect | exact")] = None,
    capacity_gb: Annotated[
        float | None, Opt(help="memory to budget against, GB", show_default="on CUDA the device's")
    ] = None,
    headroom: Annotated[float | None, Opt(help="fraction of capacity kept free")] = None,
    repeats: Annotated[
        int | None, Opt(help="timed passes over the grid, >= 2 (a point's time: the minimum)")
    ] = None,
    warmup: Annotated[int | None, Opt(help="warm-up steps per grid point (default 1)")] = None,
    threads: Annotated[int | None, Opt(help="torch CPU threads while measuring")] = None,
    timer: Annotated[
        str | None,
        Opt(
            help="auto (cpu on a CPU with one thread, wall on CUDA) | wall | cpu",
            show_default="auto",
        ),
    ] = None,
    max_batch_tokens: Annotated[
        int | None, Opt(help="skip B > 1 grid points with B*S above this (large-B corners)")
    ] = None,
    max_loo_error: Annotated[
        float | None,
        Opt(help="refuse a fit whose leave-one-out error exceeds this (cuda 0.25, cpu 0.5)"),
    ] = None,
    validate: Annotated[
        int, Opt(help="then time K micro-batches drawn from every policy's plan (0 = off)")
    ] = 0,
    validate_world_size: Annotated[int, Opt(help="ranks of the plans --validate draws from")] = 16,
    validate_max_seconds: Annotated[
        float | None, Opt(help="--validate draws no micro-batch predicted above this")
    ] = None,
    refit: Annotated[
        list[Path] | None,
        Opt(help="no measurement: refit the points of measured calibration file(s), pooled"),
    ] = None,
    activation_checkpointing: Annotated[
        bool, Opt("--activation-checkpointing", help="checkpoint every block")
    ] = False,
    ref_tokens: Annotated[
        float | None, Opt(help="override S_ref", show_default="the heaviest bucket that fits alone")
    ] = None,
    ref_batch: Annotated[
        int | None, Opt(help="override B_ref", show_default="floor(M_mem / S_ref)")
    ] = None,
    prior: Annotated[
        str | None, Opt(help="no measurement: analytic prior for a device's rates (h200)")
    ] = None,
    config: Annotated[
        Path | None, Opt(help="experiment YAML: model, data and calibration sections")
    ] = None,
    seed: Annotated[int, Opt(help="seed of the weights, inputs and mixture")] = 0,
    quiet: Annotated[bool, Opt("--quiet", help="no progress bar")] = False,
) -> None:
    """Time forward+backward over a (B, S) grid, fit t(B,S) and m(B,S), derive the budgets.

    Flags override the experiment file given with --config. The file is written only after
    everything succeeded.
    """
    from adaptiveload.calibration.files import refit as refit_files
    from adaptiveload.calibration.measure import calibrate
    from adaptiveload.calibration.prior import prior as analytic_prior
    from adaptiveload.costmodel import Calibration
    from adaptiveload.io import write_json

    exp: dict[str, Any] = {}
    if config is not None:
        from adaptiveload.experiment import load

        exp = load(config)
    cal_section, data = exp.get("calibration", {}), exp.get("data", {})
    model_name = model or exp.get("model", {}).get("config", "wan2.1-tiny")
    if refit:  # the files say which model they measured
        measured_model = Calibration.load(refit[0]).model
        if model is not None and model != measured_model:
            raise UserError(f"{refit[0]}: calibration is for {measured_model!r}, not {model!r}")
        model_name = measured_model

    if cal_section.get("file") and prior is None:  # the experiment pins a calibration file
        cal = Calibration.load(cal_section["file"])
        if cal.model != model_name:
            raise UserError(
                f"{cal_section['file']}: calibration is for {cal.model!r}, the experiment "
                f"trains {model_name!r}"
            )
        write_json(output, cal.to_dict())
        typer.echo(f"{output}: copied {cal_section['file']} ({cal.label})", err=True)
        return

    mix = _token_mix(manifest, mixture, num_samples, seed, data, model_name, grid, bucketing)
    head = _pick(headroom, cal_section, "headroom")
    max_loo = _pick(max_loo_error, cal_section, "max_loo_error")
    if refit:
        if mix is None:
            raise UserError("--refit needs --manifest or --mixture (the budgets' token range)")
        cal = refit_files(refit, mix, head, max_loo, ref_tokens, ref_batch)
    elif prior is not None:
        cal = analytic_prior(model_name, prior, mix, head, ref_tokens, ref_batch)
    else:
        cal = calibrate(
            model_name,
            device=_pick(device, cal_section, "device"),
            batch_sizes=_pick(_ints(batch_sizes, "--batch-sizes"), cal_section, "batch_sizes"),
            tokens=_pick(_ints(tokens, "--tokens"), cal_section, "tokens"),
            mix=mix,
            # no --config: None, i.e. a CUDA device's own memory (the schema's 4 GB is a file's)
            capacity_gb=_pick(capacity_gb, cal_section, "capacity_gb", None),
            headroom=head,
            repeats=_pick(repeats, cal_section, "repeats"),
            warmup=_pick(warmup, cal_section, "warmup"),
            activation_checkpointing=activation_checkpointing,
            ref_tokens=ref_tokens,
            ref_batch=ref_batch,
            seed=seed,
            threads=_pick(threads, cal_section, "threads"),
            timer=_pick(timer, cal_section, "timer"),
            progress=not quiet,
            max_batch_tokens=_pick(max_batch_tokens, cal_section, "max_batch_tokens"),
            max_loo=max_loo,
            validate=validate,
            validate_world_size=validate_world_size,
            validate_max_seconds=validate_max_seconds,
        )  # fmt: skip
    write_json(output, cal.to_dict())
    _report(output, cal)


@app.command("budgets", epilog=examples(
    "adaptiveload budgets --calibration experiments/calibration/h200-wan2.1-t2v-1.3b.json "
    "--mixture paper-mixed",
    "adaptiveload budgets --calibration CAL.json --mixture paper-mixed --max-frames 5 "
    "--m-mem 18000",
))
def budgets_cmd(
    calibration: Annotated[Path, Opt(help="calibration JSON: the cost and memory model")],
    manifest: Annotated[
        Path | None, Opt(help="manifest whose token range sets p and the reference bucket")
    ] = None,
    mixture: Annotated[str | None, Opt(help="or a named synthetic mixture")] = None,
    num_samples: Annotated[int, Opt(help="samples drawn from --mixture")] = 20000,
    grid: Annotated[
        str, Opt(help="bucket grid for raw manifests: " + " | ".join(GRIDS))
    ] = DEFAULT_GRID,
    bucketing: Annotated[str, Opt(help=" | ".join(MODES))] = DEFAULT_MODE,
    max_frames: Annotated[int, Opt(help="frames cap of the bucket grid")] = DEFAULT_MAX_FRAMES,
    m_mem: Annotated[
        float | None, Opt(help="size the device for this M_mem (tokens) instead of its capacity")
    ] = None,
    capacity_gb: Annotated[
        float | None, Opt(help="memory to budget against, GB", show_default="the calibration's")
    ] = None,
    headroom: Annotated[
        float | None, Opt(help="fraction of capacity kept free", show_default="the calibration's")
    ] = None,
) -> None:
    """Print the budgets a calibration's cost model derives for a token mix, as JSON.

    With --m-mem, the capacity (GB) at which M_mem is that many tokens comes first
    (`costmodel.capacity_for`), then the budgets at that capacity: how a short run on a real
    device is given a pretend smaller one.
    """
    import json

    from adaptiveload.calibration.mix import manifest_token_mix, mixture_token_mix
    from adaptiveload.costmodel import Calibration, capacity_for, derive_budgets

    cal = Calibration.load(calibration)
    if (manifest is None) == (mixture is None):
        raise UserError("budgets: give exactly one of --manifest or --mixture (the token mix)")
    if m_mem is not None and capacity_gb is not None:
        raise UserError("budgets: give --m-mem or --capacity-gb, not both")
    mix = (
        manifest_token_mix(manifest, bucketing, grid, max_frames)
        if manifest is not None
        else mixture_token_mix(mixture, num_samples, 0, bucketing, grid, max_frames)
    )
    head = float(cal.extra.get("headroom", 0.1)) if headroom is None else headroom
    if m_mem is not None:
        capacity = capacity_for(cal.cost, m_mem, head, float(mix.tokens.min()))
    elif capacity_gb is not None:
        capacity = capacity_gb * 1e9
    elif cal.capacity_bytes:
        capacity = float(cal.capacity_bytes)
    else:
        raise UserError(f"{calibration}: no capacity_bytes; give --capacity-gb or --m-mem")
    derived = derive_budgets(cal.cost, mix.tokens, capacity, head)
    out = {"calibration": str(calibration), "label": cal.label, "manifest": mix.to_dict(),
           "capacity_gb": capacity / 1e9, "headroom": head, **derived.to_dict()}  # fmt: skip
    typer.echo(json.dumps(out, indent=2))
