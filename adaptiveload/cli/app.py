"""The root `adaptiveload` command; each stage module under `adaptiveload.cli` adds its own."""

import typer

app = typer.Typer(
    name="adaptiveload",
    help="Compute-aware data loading for video DiT training: one subcommand per pipeline stage.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command("version")
def version() -> None:
    """Print the versions that results are stamped with (package, torch, CUDA)."""
    import torch

    from adaptiveload import __version__

    cuda = torch.version.cuda or "none"
    typer.echo(f"adaptiveload {__version__}  torch {torch.__version__}  cuda {cuda}")
