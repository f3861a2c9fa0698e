"""The root `adaptiveload` command; each stage module under `adaptiveload.cli` adds its own.

Help is plain click text (`rich_markup_mode=None`): paragraphs rewrap to the terminal, so
docstrings wrapped at 100 columns in the source read well at any width and in log files.
"""

import dataclasses
from typing import Annotated, Any

import typer

from adaptiveload import __version__
from adaptiveload.errors import UserError


def group(name: str, help: str) -> typer.Typer:
    """A command group (`adaptiveload <name> ...`) with the root's help settings."""
    sub = typer.Typer(help=help, no_args_is_help=True, rich_markup_mode=None)
    app.add_typer(sub, name=name)
    return sub


def overridden(settings: Any, **flags: Any) -> Any:
    """`settings` (a frozen dataclass) with the flags given on the command line put in (a None
    flag was not given: the setting stays), validated again."""
    given = {k: v for k, v in flags.items() if v is not None}
    return dataclasses.replace(settings, **given) if given else settings


def examples(*lines: str) -> str:
    """A command's epilog: example command lines, printed as they are (click's \\b block)."""
    return "Examples:\n\n\b\n" + "\n".join(f"  $ {line}" for line in lines)


def report_warnings(what: str, found: list[str], strict: bool) -> None:
    """Tell the user what is unusual about `what` in one `warning:` line on stderr, or, with
    --strict, refuse it (a UserError: exit 2, nothing written)."""
    if not found:
        return
    line = f"{what}: " + "; ".join(found)
    if strict:
        raise UserError(f"{line} (refused: --strict)")
    typer.echo(f"warning: {line}", err=True)


def report_note(note: str | None) -> None:
    """Say something true of every plan of this data that the user should know once (clips cut
    to their bucket), in one `note:` line on stderr; never refused by --strict."""
    if note:
        typer.echo(f"note: {note}", err=True)


app = typer.Typer(
    name="adaptiveload",
    help="Compute-aware data loading for video DiT training: one subcommand per pipeline stage.",
    epilog=examples(
        "adaptiveload manifest synth --mixture tiny-cpu -n 1000 -o manifest.csv",
        "adaptiveload plan --help",
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"adaptiveload {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True,
                     help="Print the package version and exit."),
    ] = False,
) -> None:
    pass


@app.command("version", epilog=examples("adaptiveload version"))
def version() -> None:
    """Print the versions that results are stamped with (package, torch, CUDA)."""
    import torch

    cuda = torch.version.cuda or "none"
    typer.echo(f"adaptiveload {__version__}  torch {torch.__version__}  cuda {cuda}")
