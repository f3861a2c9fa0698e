"""Progress on stderr: a tqdm bar on a terminal, plain lines in a log file.

A bar redraws itself with carriage returns, which a log file keeps as one long line of
`\\r`-joined frames. When stderr is not a terminal (a Snakemake log, a SLURM output file, a
pipe), the same calls print one complete line at most every `LOG_INTERVAL_S` seconds, plus the
first and the last.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0
LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}]{postfix}"


class LogLines(tqdm):
    """tqdm that writes whole lines (no carriage returns, no bar glyphs)."""

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg == "":  # tqdm clearing its line: nothing to clear (False: no '\r' after it)
            return False
        self.fp.write(self.format_meter(**self.format_dict) + "\n")
        self.fp.flush()
        self._shown = self.n
        return True

    def close(self) -> None:
        if not self.disable and getattr(self, "_shown", None) != self.n:
            self.display()  # the final count, once
        self.leave = False  # so that tqdm's own close writes no further line
        super().close()


def progress_bar(*, interval_s: float = LOG_INTERVAL_S, **kwargs: Any) -> tqdm:
    """`tqdm(**kwargs)` on stderr: a live bar on a terminal, else plain lines every interval_s."""
    kwargs.setdefault("file", sys.stderr)
    if kwargs["file"].isatty():
        return tqdm(dynamic_ncols=True, **kwargs)
    return LogLines(mininterval=interval_s, bar_format=LOG_FORMAT, **kwargs)
