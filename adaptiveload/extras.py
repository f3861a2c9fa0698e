"""Optional dependencies: which extra of `pip install adaptiveload[...]` brings each one.

The core (data, planning, the sampler, the cost model, the CLI's planning commands) needs only
what pyproject.toml lists under `dependencies`. The rest is imported where it is used, through
`require`, so that a missing package stops with one line naming the extra to install instead of
a traceback; the CLI turns any other ModuleNotFoundError of a listed package into the same line.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from adaptiveload.errors import UserError

# top-level import name -> the extra that installs it (keep in step with pyproject.toml)
EXTRA_OF = {
    "snakemake": "pipeline",
    "seaborn": "pipeline",
    "matplotlib": "pipeline",
    "tabulate": "pipeline",
    "mlflow": "tracking",
    "psutil": "tracking",
    "ninja": "kernel",
    "av": "media",
    "PIL": "media",
    "diffusers": "diffusers",
}


class MissingExtraError(UserError, ImportError):
    """An optional package is not installed; the message names the extra that brings it."""


def missing_extra(module: str) -> MissingExtraError | None:
    """The error for a missing `module` (a dotted name is fine), or None if no extra has it."""
    top = module.split(".")[0]
    extra = EXTRA_OF.get(top)
    if extra is None:
        return None
    return MissingExtraError(
        f"{top} is not installed: it comes with the '{extra}' extra; "
        f"pip install 'adaptiveload[{extra}]'"
    )


def require(module: str) -> ModuleType:
    """Import `module`, or raise MissingExtraError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        error = missing_extra(exc.name or module)
        if error is None:
            raise
        raise error from None
