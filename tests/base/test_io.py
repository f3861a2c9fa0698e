"""Atomic writes: results get the mode the umask asks for, not mkstemp's private 0600; reads
refuse what is not a regular file."""

from __future__ import annotations

import os
import stat

import pytest

from adaptiveload.errors import UserError
from adaptiveload.io import atomic_path, read_json, read_table, regular_file, write_json


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_respect_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
        with atomic_path(tmp_path / "b.bin") as tmp:
            tmp.write_bytes(b"x")
    finally:
        os.umask(old)
    for name in ("a.json", "b.bin"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == mode, name
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    """A FIFO (or a device) as an experiment, calibration or table file: `open` would block
    until a writer came, past every signal a run waits for; refused first, one line."""
    fifo = tmp_path / "calibration.json"
    os.mkfifo(fifo)
    for read in (lambda: read_json(fifo, "calibration file"),
                 lambda: read_table(fifo, "table", "write it again")):
        with pytest.raises(UserError, match=r"is not a regular file \(a FIFO"):
            read()
    with pytest.raises(UserError, match="outside"):
        regular_file(tmp_path / ".." / "x", "shard", root=tmp_path)
