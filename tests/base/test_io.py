"""Atomic writes: results get the mode the umask asks for, not mkstemp's private 0600."""

from __future__ import annotations

import os
import stat

import pytest

from adaptiveload.io import atomic_path, write_json


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
