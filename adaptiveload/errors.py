"""Errors that reach the user as one clear message instead of a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (a file, a flag, a config field).

    The CLI prints the message (which should name the file, the field and the fix) to stderr
    and exits with status 2, before any output is written.
    """
