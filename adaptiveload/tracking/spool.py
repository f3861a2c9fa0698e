"""A local JSONL buffer of tracking records that have not reached the store yet.

One file per run, beside the run's output. Line 1 is a header naming the run and the store;
each further line is one record (`step`, `summary`, `artifact` or `status`) in the order the
run produced them. The spool is rewritten atomically to hold only what is still pending, so a
crash at any point leaves either the old or the new pending set, never a torn file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptiveload.errors import UserError
from adaptiveload.io import read_text, write_text


@dataclass
class Spool:
    path: Path
    run_id: str
    uri: str
    records: list[dict[str, Any]] = field(default_factory=list)

    def _header(self) -> dict[str, Any]:
        return {"kind": "run", "run_id": self.run_id, "uri": self.uri}

    def append(self, record: dict[str, Any]) -> None:
        """Add one record, on disk first (append + flush) so a crash right after keeps it."""
        if not self.path.exists():
            self.rewrite()
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
        self.records.append(record)

    def rewrite(self) -> None:
        """Replace the file atomically with the header plus the pending records."""
        lines = [json.dumps(self._header())] + [json.dumps(r) for r in self.records]
        write_text(self.path, "\n".join(lines) + "\n")

    def clear(self) -> None:
        """Everything pending has been uploaded: drop the file."""
        self.records = []
        self.path.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> Spool:
        path = Path(path)
        lines = [ln for ln in read_text(path, "spool file").splitlines() if ln.strip()]
        try:
            header = json.loads(lines[0]) if lines else {}
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not a tracking spool (JSONL expected: {exc})") from None
        records = []
        for i, line in enumerate(lines[1:], start=2):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                if i != len(lines):  # only a torn LAST line (killed mid-append) is expected
                    raise UserError(f"{path}: line {i}: not valid JSON") from None
        if header.get("kind") != "run" or "run_id" not in header:
            raise UserError(f"{path}: line 1 must be the run header `adaptiveload train` writes")
        return cls(path=path, run_id=header["run_id"], uri=header["uri"], records=records)
