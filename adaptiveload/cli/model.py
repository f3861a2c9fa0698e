"""`adaptiveload model info`: a Wan config's shapes, parameter count and FLOPs per sample;
`adaptiveload model convert`: a Wan 2.1 T2V checkpoint from one layout to the other."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from adaptiveload.cli.app import examples, group

model_app = group("model", "Wan 2.1 model configs (shapes, parameters, FLOPs) and checkpoints.")
Opt = typer.Option


@model_app.command("info", epilog=examples(
    "adaptiveload model info --config wan2.1-t2v-1.3b --frames 81 --height 480 --width 832",
))
def info(
    config: Annotated[str, Opt(help="wan2.1-t2v-1.3b | wan2.1-t2v-14b | wan2.1-tiny | ...")],
    frames: Annotated[int, Opt(help="sample frames (4k+1; 1 = image)")] = 81,
    height: Annotated[int, Opt(help="sample height in pixels (multiple of 16)")] = 480,
    width: Annotated[int, Opt(help="sample width in pixels (multiple of 16)")] = 832,
    as_json: Annotated[bool, Opt("--json", help="print JSON instead of text")] = False,
) -> None:
    """Parameters (counted on the meta device) and analytic training FLOPs of one sample."""
    from adaptiveload.model.info import model_info

    record = model_info(config, frames, height, width)
    if as_json:
        typer.echo(json.dumps(record, indent=2))
        return
    for key, value in record.items():
        typer.echo(f"{key:>24}: {value}")


@model_app.command("convert", epilog=examples(
    "adaptiveload model convert Wan2.1-T2V-1.3B -o Wan2.1-T2V-1.3B-diffusers/transformer",
    "adaptiveload model convert Wan2.1-T2V-1.3B-Diffusers -o wan-original --to original",
))
def convert(
    src: Annotated[str, typer.Argument(help="weights file, index, or (transformer) folder")],
    output: Annotated[str, Opt("-o", "--output", help="new folder to write")],
    to: Annotated[str, Opt(help="layout to write: diffusers | original")] = "diffusers",
    config: Annotated[
        str | None, Opt(help="config the weights must match (default: inferred, checked)")
    ] = None,
) -> None:
    """Check every key and shape of a Wan 2.1 T2V checkpoint (original or diffusers layout)
    and write it in the other layout: tensors as stored (dtype and bytes kept), shards kept,
    with that layout's config.json (docs/models.md)."""
    from adaptiveload.model.weights import convert as convert_checkpoint

    cfg = convert_checkpoint(src, output, to, config)
    typer.echo(f"wrote {output} ({to} layout, config {cfg.name})")


@model_app.command("export", epilog=examples(
    "adaptiveload model export runs/ft/checkpoints/ckpt-00001000.pt -o wan-ft/transformer",
    "adaptiveload model export runs/ft/checkpoints/ckpt-00001000.pt -o wan-ft-lora.safetensors "
    "--lora-only --to original",
))
def export(
    src: Annotated[str, typer.Argument(help="a training checkpoint (ckpt-<step>.pt)")],
    output: Annotated[str, Opt("-o", "--output", help="new folder (or file with --lora-only)")],
    to: Annotated[str, Opt(help="layout to write: diffusers | original")] = "diffusers",
    lora_only: Annotated[bool, Opt(
        "--lora-only", help="a LoRA run's adapters alone, one .safetensors file (original: "
        "ComfyUI's names)")] = False,
) -> None:
    """Write the model a training run trained: merged into a Wan 2.1 checkpoint in either
    layout (LoRA adapters folded into the base weights), or a LoRA run's adapters alone in
    diffusers' or ComfyUI's names (docs/finetune.md)."""
    from adaptiveload.errors import UserError
    from adaptiveload.model.weights import LAYOUTS

    if to not in LAYOUTS:
        raise UserError(f"--to {to!r}: expected one of {', '.join(LAYOUTS)}")
    from adaptiveload.training.export import export_lora, export_merged

    written = export_lora(src, output, to) if lora_only else export_merged(src, output, to)
    typer.echo(f"wrote {written} ({to} {'LoRA names' if lora_only else 'layout'})")
