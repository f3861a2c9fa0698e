"""`adaptiveload calibrate measure|refit|prior`: a cost model and its budgets, measured on this
device, fitted again from measured files, or modelled from a device's rates; `calibrate comm`:
the all-to-all time of sequence parallelism, measured into a calibration's `comm` section;
`adaptiveload budgets`: the budgets a calibration gives a token mix.

Every subcommand but `comm` turns its flags into one `calibration.settings.CalibrationConfig`
(`_settings`: the experiment file's given with --config, else the defaults, each flag over
it); `comm` into one `calibration.settings.CommGrid`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer

from adaptiveload.cli.app import app as root
from adaptiveload.cli.app import examples, group, overridden
from adaptiveload.data.bucketing import DEFAULT_GRID, DEFAULT_MAX_FRAMES, DEFAULT_MODE, GRIDS, MODES
from adaptiveload.errors import UserError, int_list
from adaptiveload.experiment import schema_default

Opt = typer.Option
calibrate = group(
    "calibrate",
    "A cost model and its budgets: measured on this device, refitted, or an analytic prior.",
)

# options every subcommand takes: what the budgets serve and how they are derived
Output = Annotated[Path, Opt("-o", "--output", help="calibration JSON to write")]
Config = Annotated[
    Path | None, Opt(help="experiment YAML: its model, data and calibration sections")
]
Model = Annotated[
    str | None,
    Opt(help="model config", show_default=f"--config's, else {schema_default('model.config')}"),
]
Manifest = Annotated[
    Path | None, Opt(help="manifest whose token range sets p and the reference bucket")
]
Mixture = Annotated[str | None, Opt(help="or a named synthetic mixture (e.g. tiny-cpu)")]
NumSamples = Annotated[
    int | None,
    Opt(help="samples drawn from --mixture",
        show_default=f"--config's, else {schema_default('simulate.num_samples')}"),
]
Grid = Annotated[
    str | None, Opt(help="bucket grid for raw manifests: wan | tiny", show_default="by model")
]
Bucketing = Annotated[str | None, Opt(help="aspect | exact")]
CapacityGb = Annotated[
    float | None,
    Opt(help="memory to budget against, GB",
        show_default="the device's own: measure on CUDA, the files' (refit), the rates' (prior)"),
]
Headroom = Annotated[float | None, Opt(help="fraction of capacity kept free")]
RefTokens = Annotated[
    float | None, Opt(help="override S_ref", show_default="the heaviest bucket that fits alone")
]
RefBatch = Annotated[int | None, Opt(help="override B_ref", show_default="floor(M_mem / S_ref)")]
MaxLoo = Annotated[
    float | None,
    Opt("--max-loo-error",
        help="refuse a fit whose leave-one-out error exceeds this (cuda 0.25, cpu 0.5)"),
]
Seed = Annotated[int | None, Opt(help="seed of the weights, inputs and mixture")]


def _settings(config: Path | None, flags: dict[str, Any]) -> Any:
    """The one place a command line becomes a CalibrationConfig: the experiment file's (else
    the defaults), every flag given over it (a None flag was not given; `--pack`s given
    replace the file's packs)."""
    from adaptiveload.calibration.settings import CalibrationConfig, Pack
    from adaptiveload.experiment import load

    base = CalibrationConfig.from_experiment(load(config)) if config else CalibrationConfig()
    f = {k: v for k, v in flags.items() if v is not None}
    mix = base.mix
    if "manifest" in f or "mixture" in f:  # a flag's token mix replaces the experiment's
        mix = replace(mix, manifest=f.get("manifest"), mixture=f.get("mixture"))
    ints = {k: int_list(f[k], f"--{k.replace('_', '-')}") for k in ("batch_sizes", "tokens")
            if k in f}
    packs = tuple(Pack.parse(text) for text in f["pack"]) if f.get("pack") else None
    return overridden(
        base, model=f.get("model"), device=f.get("device"), threads=f.get("threads"),
        timer=f.get("timer"), max_loo=f.get("max_loo"), seed=f.get("seed"),
        activation_checkpointing=f.get("activation_checkpointing"),
        grid=overridden(base.grid, **ints, repeats=f.get("repeats"), warmup=f.get("warmup"),
                        max_batch_tokens=f.get("max_batch_tokens"), packs=packs),
        mix=overridden(mix, num_samples=f.get("num_samples"), grid=f.get("grid"),
                       bucketing=f.get("bucketing"), seed=f.get("seed")),
        budgets=overridden(base.budgets, capacity_gb=f.get("capacity_gb"),
                           headroom=f.get("headroom"), ref_tokens=f.get("ref_tokens"),
                           ref_batch=f.get("ref_batch")),
        validation=overridden(base.validation, micro_batches=f.get("validate"),
                              world_size=f.get("validate_world_size"),
                              max_seconds=f.get("validate_max_seconds")),
    )


def _report(output: Path, cal: Any) -> None:
    """One line on the fit and the budgets, one on the validation when it ran, and the
    additivity block when the grid had packs."""
    from adaptiveload.calibration.additivity import describe

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
        f"{100 * fit['max_rel_err']:.1f}%{loo}; memory: {cal.extra['memory_source']}; "
        f"capacity {cal.capacity_bytes / 1e9:.4g} GB)",
        err=True,
    )
    val = cal.extra.get("validation")
    if val and val["num_measured"]:
        typer.echo(
            f"validation: {val['num_measured']} planned micro-batches, |pred-meas|/meas median "
            f"{100 * val['median_rel_err']:.1f}% p95 {100 * val['p95_rel_err']:.1f}%",
            err=True,
        )
    for line in describe(cal.extra.get("additivity")):
        typer.echo(line, err=True)


def _write(output: Path, cal: Any) -> None:
    from adaptiveload.io import write_json

    write_json(output, cal.to_dict())
    _report(output, cal)


# measure_cmd's own options whose declarations span lines
Device = Annotated[
    str | None,
    Opt(help="cpu | cuda", show_default=f"--config's, else {schema_default('calibration.device')}"),
]
Packs = Annotated[
    list[str] | None,
    Opt(metavar="NAME=S1,S2,...",
        help="a pack of samples of these token counts, timed as one packed "
             "micro-batch and held out of the fit (repeatable; replaces --config's packs)",
        show_default="--config's, else none"),
]
ActivationCheckpointing = Annotated[
    bool | None,
    Opt("--activation-checkpointing/--no-activation-checkpointing",
        help="checkpoint every block", show_default="--config's train section, else off"),
]


@calibrate.command("measure", epilog=examples(
    "adaptiveload calibrate measure --model wan2.1-tiny --mixture tiny-cpu --capacity-gb 0.15 "
    "-o calibration.json",
    "adaptiveload calibrate measure --config experiments/default.yaml -o calibration.json",
    "adaptiveload calibrate measure --model wan2.1-tiny --mixture tiny-cpu --capacity-gb 0.15 "
    "--pack mixed=3740,1100,221 --pack images=221,221,88 -o calibration.json",
))
def measure_cmd(
    output: Output,
    config: Config = None,
    model: Model = None,
    device: Device = None,
    batch_sizes: Annotated[str | None, Opt(help="grid batch sizes, e.g. 1,2,4")] = None,
    tokens: Annotated[str | None, Opt(help="grid token counts, e.g. 16,64,256,1024,4096")] = None,
    max_batch_tokens: Annotated[
        int | None, Opt(help="skip B > 1 grid points with B*S above this (large-B corners)")
    ] = None,
    repeats: Annotated[
        int | None, Opt(help="timed passes over the grid, >= 2 (a point's time: the minimum)")
    ] = None,
    warmup: Annotated[int | None, Opt(help="warm-up steps per grid point")] = None,
    pack: Packs = None,
    threads: Annotated[int | None, Opt(help="torch CPU threads while measuring")] = None,
    timer: Annotated[
        str | None, Opt(help="auto (cpu on a CPU with one thread, wall on CUDA) | wall | cpu")
    ] = None,
    activation_checkpointing: ActivationCheckpointing = None,
    manifest: Manifest = None,
    mixture: Mixture = None,
    num_samples: NumSamples = None,
    grid: Grid = None,
    bucketing: Bucketing = None,
    capacity_gb: CapacityGb = None,
    headroom: Headroom = None,
    ref_tokens: RefTokens = None,
    ref_batch: RefBatch = None,
    max_loo_error: MaxLoo = None,
    validate: Annotated[
        int | None, Opt(help="then time K micro-batches drawn from every policy's plan (0 = off)")
    ] = None,
    validate_world_size: Annotated[
        int | None, Opt(help="ranks of the plans --validate draws from")
    ] = None,
    validate_max_seconds: Annotated[
        float | None, Opt(help="--validate draws no micro-batch predicted above this")
    ] = None,
    seed: Seed = None,
    quiet: Annotated[bool, Opt("--quiet", help="no progress bar")] = False,
) -> None:
    """Time forward+backward over a (B, S) grid, fit t(B,S) and m(B,S), derive the budgets.

    Flags override the experiment file given with --config. The file is written only after
    everything succeeded.
    """
    cfg = _settings(config, dict(locals(), max_loo=max_loo_error))  # every option, by its name
    cfg.check_measurement()
    from adaptiveload.calibration.measure import calibrate as measure  # torch: after the checks

    _write(output, measure(cfg, progress=not quiet))


@calibrate.command("refit", epilog=examples(
    "adaptiveload calibrate refit results/reference/h200/2026-11-30/grid7/"
    "calibration-grid7-run2.json results/reference/h200/2026-11-30/grid7/"
    "calibration-grid7-run3.json --mixture paper-mixed -o h200-1.3b-measured.json",
))
def refit_cmd(
    files: Annotated[list[Path], typer.Argument(help="measured calibration files, pooled")],
    output: Output,
    config: Config = None,
    model: Annotated[str | None, Opt(help="refuse files measured for another model")] = None,
    manifest: Manifest = None,
    mixture: Mixture = None,
    num_samples: NumSamples = None,
    grid: Grid = None,
    bucketing: Bucketing = None,
    capacity_gb: CapacityGb = None,
    headroom: Headroom = None,
    ref_tokens: RefTokens = None,
    ref_batch: RefBatch = None,
    max_loo_error: MaxLoo = None,
) -> None:
    """Fit the points of measured calibration files again, pooled, by today's form, checks and
    budget rules (no measurement)."""
    flags = dict(locals(), max_loo=max_loo_error)  # every option, by its name
    from adaptiveload.calibration.files import refit
    from adaptiveload.costmodel import Calibration

    measured = Calibration.load(files[0]).model  # the files say which model they measured
    if model is not None and model != measured:
        raise UserError(f"{files[0]}: calibration is for {measured!r}, not {model!r}")
    cfg = _settings(config, dict(flags, model=measured))
    mix = cfg.mix.load(cfg.model)
    if mix is None:
        raise UserError("refit needs --manifest or --mixture (the budgets' token range)")
    _write(output, refit(files, mix, cfg.budgets, cfg.max_loo))


@calibrate.command("prior", epilog=examples(
    "adaptiveload calibrate prior --model wan2.1-t2v-1.3b --mixture paper-mixed "
    "-o h200-1.3b.json",
    "adaptiveload calibrate prior --model wan2.1-t2v-1.3b --mixture paper-mixed "
    "--capacity-gb 80 -o h200-1.3b-80gb.json",
))
def prior_cmd(
    output: Output,
    rates: Annotated[str, Opt(help="the device whose rates model the step (h200)")] = "h200",
    config: Config = None,
    model: Model = None,
    manifest: Manifest = None,
    mixture: Mixture = None,
    num_samples: NumSamples = None,
    grid: Grid = None,
    bucketing: Bucketing = None,
    capacity_gb: CapacityGb = None,
    headroom: Headroom = None,
    ref_tokens: RefTokens = None,
    ref_batch: RefBatch = None,
) -> None:
    """A `source: model` calibration from the analytic step time and memory of the model on a
    device's rates (no measurement), fitted like one: the shipped H200 priors."""
    flags = dict(locals())  # every option, by its name
    from adaptiveload.calibration.prior import prior

    cfg = _settings(config, flags)
    _write(output, prior(cfg.model, rates, cfg.mix.load(cfg.model), cfg.budgets))


@root.command("budgets", epilog=examples(
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
    num_samples: Annotated[
        int, Opt(help="samples drawn from --mixture")
    ] = schema_default("simulate.num_samples"),
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
    from adaptiveload.costmodel import Calibration, budgets_record, capacity_for, derive_budgets

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
    head = cal.headroom if headroom is None else headroom
    if m_mem is not None:
        capacity = capacity_for(cal.cost, m_mem, head, float(mix.tokens.min()))
    elif capacity_gb is not None:
        capacity = capacity_gb * 1e9
    elif cal.capacity_bytes:
        capacity = float(cal.capacity_bytes)
    else:
        raise UserError(f"{calibration}: no capacity_bytes; give --capacity-gb or --m-mem")
    derived = derive_budgets(cal.cost, mix.tokens, capacity, head)
    record = budgets_record(calibration, cal, mix.to_dict(), capacity, head, derived)
    typer.echo(json.dumps(record, indent=2))


@contextlib.contextmanager
def _one_voice(ranks: Any) -> Iterator[None]:
    """A refusal every rank makes alike (same inputs, same all-reduced points), said once:
    by rank 0; the other ranks exit 2 without a line each."""
    try:
        yield
    except UserError:
        if ranks.is_main:
            raise
        raise typer.Exit(2) from None


def _measure_comm(calibration: Path, output: Path | None, grid: Any, degrees: str | None,
                  quiet: bool) -> None:
    """`calibrate comm` on this process's rank: every input checked before the process group
    starts; rank 0 reports and writes, every rank fits the same all-reduced points."""
    import torch.distributed as dist

    from adaptiveload.calibration.comm import (
        comm_section,
        describe,
        measure_points,
        read_target,
        with_comm,
    )
    from adaptiveload.training import distributed as dd
    from adaptiveload.training.sp_groups import SPGroups, check_group_degree, degrees_of

    ranks = dd.resolve_ranks(None, 1)
    main = ranks.is_main
    with _one_voice(ranks):
        if ranks.world_size < 2:
            raise UserError("calibrate comm: an all-to-all needs >= 2 processes; run it under "
                            "`torchrun --nproc-per-node N -m adaptiveload calibrate comm ...`, "
                            "N >= 2")
        wanted = int_list(degrees, "--degrees") if degrees else degrees_of(ranks.world_size)
        wanted = sorted({check_group_degree(d, ranks.world_size) for d in wanted} - {1})
        if not wanted:
            raise UserError(f"world size {ranks.world_size}: no SP degree > 1 divides it")
        data, out = read_target(calibration, output)
    if main and "comm" in data:
        typer.echo(f"warning: {calibration}: its comm section is replaced", err=True)
    dev = dd.setup(ranks, grid.device)  # a rank without its GPU says so itself
    try:
        with _one_voice(ranks):
            groups = SPGroups.build(ranks.world_size, wanted)
            mine = {d: groups.group_of(ranks.process_rank, d)[0] for d in groups.degrees}
            say = (lambda line: typer.echo(line, err=True)) if main and not quiet else None
            points = measure_points(mine, grid, dev, say)
            section = comm_section(points, dist.get_backend(), str(dev), ranks.world_size, grid)
        if main:
            with_comm(data, section, out)
            for line in describe(section):
                typer.echo(f"{out}: {line}", err=True)
    finally:
        dd.teardown(ranks)


@calibrate.command("comm", epilog=examples(
    "torchrun --nproc-per-node 4 -m adaptiveload calibrate comm --calibration cal.json",
    "torchrun --nproc-per-node 8 -m adaptiveload calibrate comm --device cuda "
    "--calibration h200-wan2.1-t2v-1.3b -o h200-1.3b-comm.json",
))
def comm_cmd(
    calibration: Annotated[
        Path, Opt(help="calibration JSON the comm section goes into (or a shipped one by "
                  "name, with -o)")
    ],
    output: Annotated[
        Path | None,
        Opt("-o", "--output", "--out", help="calibration JSON to write",
            show_default="--calibration's file"),
    ] = None,
    device: Annotated[str, Opt(help="cpu (gloo) | cuda (NCCL, one GPU per process)")] = "cpu",
    sizes: Annotated[
        str | None, Opt(help="bytes each rank holds, e.g. 65536,1048576",
                        show_default="cuda 64 KiB..64 MiB, cpu 16 KiB..16 MiB, x4")
    ] = None,
    degrees: Annotated[
        str | None, Opt(help="SP degrees, powers of two dividing the world size, e.g. 2,4",
                        show_default="all of them")
    ] = None,
    repeats: Annotated[int, Opt(help="timed calls per point (its time: their median)")] = 10,
    warmup: Annotated[int, Opt(help="untimed calls per point first")] = 3,
    quiet: Annotated[bool, Opt("--quiet", help="no progress lines")] = False,
) -> None:
    """Time one all-to-all against bytes and degree (gloo on CPU, NCCL on CUDA; under
    torchrun, >= 2 processes), fit latency and bandwidth per degree, and write them as the
    calibration's `comm` section; its other fields are kept as they are."""
    from adaptiveload.calibration.settings import CommGrid

    grid = CommGrid(device, int_list(sizes, "--sizes") if sizes else (), repeats, warmup)
    _measure_comm(calibration, output, grid, degrees, quiet)
