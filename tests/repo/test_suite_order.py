"""The suite's own scheduling (tests/support/suite_order.py, applied by tests/conftest.py): the
longest test files start first."""

from __future__ import annotations

from types import SimpleNamespace

from repo_paths import ROOT, TESTS
from suite_order import LONGEST_FIRST, longest_first


def test_every_longest_file_exists_once():
    """A renamed, moved or deleted file would silently drop out of the order."""
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    assert [n for n in LONGEST_FIRST if not (TESTS / n).is_file()] == []


def test_longest_files_move_first_and_nothing_else_moves():
    names = ["base/test_a.py", "slow/repo/test_pipeline.py", "base/test_b.py",
             "slow/cli/test_faults_slow.py", "base/test_a.py"]
    items = [SimpleNamespace(path=TESTS / n, i=i) for i, n in enumerate(names)]
    items.append(SimpleNamespace(path=ROOT / "elsewhere" / "test_pipeline.py", i=5))
    longest_first(items)
    assert [(item.path.relative_to(ROOT).as_posix(), item.i) for item in items] == [
        ("tests/slow/repo/test_pipeline.py", 1), ("tests/slow/cli/test_faults_slow.py", 3),
        ("tests/base/test_a.py", 0), ("tests/base/test_b.py", 2), ("tests/base/test_a.py", 4),
        ("elsewhere/test_pipeline.py", 5),  # only paths under tests/ count
    ]
