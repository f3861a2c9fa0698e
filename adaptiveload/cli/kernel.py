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
))
def bench_cmd(
    out: Annotated[Path, Opt("-o", "--out", help="CSV to write")] = Path(
        "results/kernels/bench.csv"
    ),
    seq_lens: Annotated[
        str | None,
        Opt(help="comma-separated S values (default 8k..75.6k; --e2e: 16380,32760,75600)"),
    ] = None,
    dims: Annotated[
        str | None, Opt(help="comma-separated D values (default: the six Wan/DiT widths)")
    ] = None,
    repeats: Annotated[int, Opt(help="timed repeats per measurement (median)")] = 20,
    skip_ok: Annotated[bool, Opt(help="without CUDA write a skip record and exit 0")] = False,
    e2e: Annotated[
        bool, Opt(help="time whole Wan training steps, eager vs fused (step time, peak memory)")
    ] = False,
    model: Annotated[str | None, Opt(help="--e2e: model config (default Wan 2.1 1.3B)")] = None,
    device: Annotated[str, Opt(help="--e2e: cuda, or cpu for a dry run")] = "cuda",
    steps: Annotated[int, Opt(help="--e2e: timed steps per point (median)")] = 3,
) -> None:
    """Time fused vs Wan eager vs torch.compile vs copy bandwidth on the GPU (needs CUDA):
    TB/s, fraction of the copy bandwidth, speed-ups, saved activations; or, with --e2e, whole
    training steps."""
    from adaptiveload.ops import kernel_bench

    seqs = tuple(int(v) for v in seq_lens.split(",")) if seq_lens else None
    if e2e:
        code = kernel_bench.e2e_to_file(
            out, model or kernel_bench.E2E_MODEL, seqs or kernel_bench.E2E_SEQ_LENS, device, steps
        )
    else:
        code = kernel_bench.bench_to_file(
            out,
            seqs or kernel_bench.SEQ_LENS,
            tuple(int(v) for v in dims.split(",")) if dims else kernel_bench.DIMS,
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
