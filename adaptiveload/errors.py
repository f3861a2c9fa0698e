"""Errors that reach the user as one clear message instead of a traceback."""

from __future__ import annotations

import sys


class UserError(Exception):
    """Bad input from the user (a file, a flag, a config field).

    The CLI prints the message (which should name the file, the field and the fix) to stderr
    and exits with status 2, before any output is written.
    """


def notice(message: str) -> None:
    """Tell the user, in one line on stderr, about something the run decided on its own
    (starting over, skipping a file) that changes what they get but is not an error."""
    print(f"note: {' '.join(str(message).split())}", file=sys.stderr, flush=True)


def int_list(text: str, name: str) -> tuple[int, ...]:
    """A command line's comma-separated integers ("1,2,4"); UserError naming `name` else."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{name} {text!r}: expected comma-separated integers, e.g. 1,2,4") from None
