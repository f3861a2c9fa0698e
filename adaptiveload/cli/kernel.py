"""`adaptiveload kernel build|bench|status`: the fused LayerNorm-Modulate CUDA op."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from adaptiveload.cli.app import examples, group

Opt = typer.Option
kernel = group("kernel", "Fused LayerNorm-Modulate CUDA kernel: build, benchmark, status.")


@kernel.command("build", epilog=examples(
    "adaptiveload kernel build", "adaptiveload kernel build --arch '9.0;8.0' --out build/k",
))
def build_cmd(
    out: Annotated[Path | None, Opt(help="build directory", show_default="build/kernels")] = None,
    arch: Annotated[
        str | None,
        Opt(help="TORCH_CUDA_ARCH_LIST, e.g. '9.0;8.0'",
            show_default="$TORCH_CUDA_ARCH_LIST, else 9.0"),
    ] = None,
    verbose: Annotated[bool, Opt(help="show the compiler commands")] = False,
) -> None:
    """Compile the library; without nvcc/ninja/CUDA torch: status 'skipped', exit 0."""
    from adaptiveload.ops import kernel_build as kb
    from adaptiveload.ops.kernel_lib import DEFAULT_BUILD_DIR

    arch = arch or os.environ.get("TORCH_CUDA_ARCH_LIST") or kb.DEFAULT_ARCH
    try:
        record = kb.build(out or DEFAULT_BUILD_DIR, arch, verbose)
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    detail = record["reason"] or f"{record['library']} ({record['seconds']} s, arch {arch})"
    typer.echo(f"kernel build {record['status']}: {detail}")


@kernel.command("bench", epilog=examples(
    "adaptiveload kernel bench -o results/kernels/bench.csv --skip-ok",
))
def bench_cmd(
    out: Annotated[Path, Opt("-o", "--out", help="CSV to write")] = Path(
        "results/kernels/bench.csv"
    ),
    seq_lens: Annotated[str, Opt(help="comma-separated S values")] = "8192,16384,32768,65536,75600",
    dims: Annotated[str, Opt(help="comma-separated D values")] = "1536,5120",
    repeats: Annotated[int, Opt(help="timed repeats per measurement (median)")] = 20,
    skip_ok: Annotated[bool, Opt(help="without CUDA write a skip record and exit 0")] = False,
) -> None:
    """Time fused vs Wan eager vs torch.compile vs copy bandwidth on the GPU (needs CUDA)."""
    from adaptiveload.ops import kernel_bench

    code = kernel_bench.bench_to_file(
        out,
        tuple(int(v) for v in seq_lens.split(",")),
        tuple(int(v) for v in dims.split(",")),
        repeats,
        skip_ok,
    )
    raise typer.Exit(code)


@kernel.command("status", epilog=examples("adaptiveload kernel status"))
def status_cmd() -> None:
    """Say whether ln_modulate runs the fused kernel here, and if not, why."""
    from adaptiveload.ops import ln_modulate as lm

    reason = lm.fused_unavailable_reason()
    typer.echo("fused kernel: available" if not reason else f"fused kernel: unavailable ({reason})")
