"""The `adaptiveload` command run inside the test's own process (no subprocess: fast-lane
tests call it), for tests of several folders."""

from __future__ import annotations

import sys

from adaptiveload.cli import main


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """One `adaptiveload` command in this process: (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["adaptiveload", *args])
    capsys.readouterr()
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err
