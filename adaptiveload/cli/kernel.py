"""`adaptiveload kernel build|bench|e2e|status`: the fused LayerNorm-Modulate CUDA op."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from adaptiveload.cli.app import examples, group

Opt = typer.Option
kernel = group(
    "kernel", "Fused LayerNorm-Modulate CUDA kernel: build, benchmark (op, end to end), status."
)


@kernel.command("build", epilog=examples(
    "adaptiveload kernel build", "adaptiveload kernel build --arch '9.0;8.0' --build-dir build/k",
))
def build_cmd(
    build_dir: Annotated[
        Path | None,
        Opt(help="where the library goes (set $ADAPTIVELOAD_BUILD_DIR too, for the loader)",
            show_default="$ADAPTIVELOAD_BUILD_DIR, else build/kernels of a checkout, "
            "else ~/.cache/adaptiveload/kernels"),
    ] = None,
    arch: Annotated[
        str | None,
        Opt(help="TORCH_CUDA_ARCH_LIST, e.g. '9.0;8.0'",
            show_default="$TORCH_CUDA_ARCH_LIST, else 9.0"),
    ] = None,
    verbose: Annotated[bool, Opt(help="show the compiler commands")] = False,
) -> None:
    """Compile the library; without nvcc/ninja/CUDA torch: status 'skipped', exit 0."""
    from adaptiveload.ops import kernel_build as kb

    arch = arch or os.environ.get("TORCH_CUDA_ARCH_LIST") or kb.DEFAULT_ARCH
    try:
        record = kb.build(build_dir, arch, verbose)
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    detail = record["reason"] or f"{record['library']} ({record['seconds']} s, arch {arch})"
    typer.echo(f"kernel build {record['status']}: {detail}")


@kernel.command("bench", epilog=examples(
    "adaptiveload kernel bench -o results/kernels/bench.csv --skip-ok",
    "adaptiveload kernel bench --dims 1536,5120 --seq-lens 16384,75600 --repeats 15",
    "adaptiveload kernel bench --segment-counts 1,8,64 --segment-lens 75600 --seq-lens 75600",
))
def bench_cmd(
    out: Annotated[Path | None, Opt("-o", "--out", help="CSV to write",
                                    show_default="results/kernels/bench.csv")] = None,
    seq_lens: Annotated[
        str | None, Opt(help="comma-separated S values", show_default="8k .. 75.6k")
    ] = None,
    dims: Annotated[
        str | None, Opt(help="comma-separated D values ('' for no dense shape)",
                        show_default="the six Wan/DiT widths")
    ] = None,
    repeats: Annotated[int | None, Opt(help="timed repeats per measurement (median)")] = None,
    impls: Annotated[
        str | None, Opt(help="comma-separated: fused, eager, compile", show_default="all three")
    ] = None,
    segment_counts: Annotated[str | None, Opt(
        help="comma-separated segment counts G of the packed shapes ('' for none)",
        show_default="1,8,64")] = None,
    segment_dims: Annotated[
        str | None, Opt(help="comma-separated D values of the packed shapes",
                        show_default="1536,5120")
    ] = None,
    segment_lens: Annotated[
        str | None, Opt(help="comma-separated tokens L per pack", show_default="16384,75600")
    ] = None,
    skip_ok: Annotated[bool, Opt(help="without CUDA write a skip record and exit 0")] = False,
) -> None:
    """Time fused vs Wan eager vs torch.compile vs copy bandwidth on the GPU (needs CUDA), for
    dense batches and packed token streams of G segments: TB/s, fraction of the copy
    bandwidth, speed-ups, saved activations."""
    from adaptiveload.ops import kernel_bench as kb

    flags = {"seq_lens": seq_lens, "dims": dims, "repeats": repeats, "impls": impls,
             "segment_counts": segment_counts, "segment_dims": segment_dims,
             "segment_lens": segment_lens}
    cfg = kb.KernelBenchConfig(**kb.bench_fields(flags))
    raise typer.Exit(kb.bench_to_file(out or kb.DEFAULT_OUT, cfg, skip_ok))


@kernel.command("e2e", epilog=examples(
    "adaptiveload kernel e2e -o results/kernels/e2e.csv",
    "adaptiveload kernel e2e --device cpu --model wan2.1-micro --seq-lens 16,48 --steps 1 "
    "-o e2e.csv",
))
def e2e_cmd(
    out: Annotated[Path | None, Opt("-o", "--out", help="CSV to write",
                                    show_default="results/kernels/e2e.csv")] = None,
    model: Annotated[str | None, Opt(help="model config", show_default="Wan 2.1 1.3B")] = None,
    seq_lens: Annotated[
        str | None, Opt(help="comma-separated S values", show_default="480p to 720p clips")
    ] = None,
    device: Annotated[str | None, Opt(help="cuda, or cpu for a dry run (default cuda)")] = None,
    steps: Annotated[int | None, Opt(help="timed steps per point (median)")] = None,
) -> None:
    """Time whole Wan training steps with the LayerNorm-Modulate sites eager, then fused: step
    time and peak memory per sequence length (B = 1, activation checkpointing, bf16 on CUDA)."""
    from adaptiveload.calibration import kernel_e2e

    flags = {"model": model, "seq_lens": seq_lens, "device": device, "steps": steps}
    cfg = kernel_e2e.E2EConfig(**kernel_e2e.e2e_fields(flags))
    raise typer.Exit(kernel_e2e.to_file(out or kernel_e2e.DEFAULT_OUT, cfg))


@kernel.command("status", epilog=examples("adaptiveload kernel status"))
def status_cmd() -> None:
    """Say whether ln_modulate runs the fused kernel here, and if not, why."""
    from adaptiveload.ops import ln_modulate as lm

    reason = lm.fused_unavailable_reason()
    typer.echo("fused kernel: available" if not reason else f"fused kernel: unavailable ({reason})")
