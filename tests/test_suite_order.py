"""The suite's own scheduling (conftest.py): the longest test files start first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from conftest import LONGEST_FIRST, pytest_collection_modifyitems

TESTS = Path(__file__).resolve().parent


def test_every_longest_file_exists_once():
    """A renamed or deleted file would silently drop out of the order."""
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [n for n in LONGEST_FIRST if not (TESTS / n).is_file()] == []


def test_longest_files_move_first_and_nothing_else_moves():
    names = ["test_a.py", "test_pipeline.py", "test_b.py", "test_faults.py", "test_a.py"]
    items = [SimpleNamespace(path=TESTS / n, i=i) for i, n in enumerate(names)]
    pytest_collection_modifyitems(items)
    assert [(item.path.name, item.i) for item in items] == [
        ("test_pipeline.py", 1), ("test_faults.py", 3),
        ("test_a.py", 0), ("test_b.py", 2), ("test_a.py", 4),
    ]
