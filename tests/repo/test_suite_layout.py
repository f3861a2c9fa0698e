"""The suite's layout: test files in folders named like the package's layers (tests/<layer>/,
tests/repo/test_layers.py's LAYERS) or tests/repo/ (the checkout beyond the package), the slow
lane under tests/slow/ in the same folders and marked there by its conftest.py alone, and no
end-to-end run started from the fast lane."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
from repo_paths import SLOW, TESTS
from suite_order import end_to_end
from test_layers import LAYERS

AREAS = {name for name, _ in LAYERS} | {"repo"}
# what tests/ holds besides the test folders
OTHERS = {"conftest.py", "plan_digests.py", "support", "fixtures", "bench", "slow"}


def _test_files():
    return sorted(p for p in TESTS.rglob("test_*.py")
                  if not ({"support", "bench", "fixtures"} & set(p.relative_to(TESTS).parts)))


def test_every_test_file_lives_in_its_areas_folder_of_one_lane():
    misplaced = []
    for path in _test_files():
        parts = path.relative_to(TESTS).parts
        folders = parts[1:-1] if parts[0] == "slow" else parts[:-1]
        if len(folders) != 1 or folders[0] not in AREAS:
            misplaced.append(path.relative_to(TESTS).as_posix())
    assert not misplaced, (f"put each test file in tests/<area>/ or tests/slow/<area>/, area one "
                           f"of {sorted(AREAS)}: {misplaced}")
    entries = {p.name for p in TESTS.iterdir() if p.name != "__pycache__"}
    assert entries - AREAS - OTHERS == set(), "tests/ holds only the folders above"


def test_test_file_names_are_unique():
    """pytest imports test files by name (rootdir import mode, no __init__.py)."""
    names = Counter(p.name for p in _test_files())
    assert [n for n, count in names.items() if count > 1] == []


def test_only_the_slow_folder_marks_slow():
    """No per-test or per-module slow marker: a test is slow by living under tests/slow/."""
    marker = re.compile(r"mark\.slow\b")
    found = [f"{p.relative_to(TESTS)}:{n}" for p in sorted(TESTS.rglob("*.py"))
             if p != SLOW / "conftest.py"
             for n, line in enumerate(p.read_text().splitlines(), 1) if marker.search(line)]
    assert found == []


def test_the_slow_conftest_marks_its_folder_and_nothing_else():
    spec = importlib.util.spec_from_file_location("slow_lane_conftest", SLOW / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    marked = {}
    for path in (SLOW / "repo" / "test_pipeline.py", TESTS / "base" / "test_io.py",
                 TESTS / "slowly" / "test_x.py"):
        marks = []
        conftest.pytest_itemcollected(SimpleNamespace(path=path, add_marker=marks.append))
        marked[path.relative_to(TESTS).as_posix()] = [m.name for m in marks]
    assert marked == {"slow/repo/test_pipeline.py": ["slow"], "base/test_io.py": [],
                      "slowly/test_x.py": []}


def test_end_to_end_programs_are_named_as_programs_and_modules():
    assert end_to_end([sys.executable, "-m", "snakemake", "-n"]) == "snakemake"
    assert end_to_end(["/venv/bin/torchrun", "--nproc-per-node", "2", "x.py"]) == "torchrun"
    assert end_to_end([sys.executable, "-m", "torch.distributed.run", "x.py"])
    assert end_to_end("python -m pip install .") == "pip"
    assert end_to_end([sys.executable, "-m", "adaptiveload", "plan", "--help"]) is None
    assert end_to_end(["make", "clean"]) is None and end_to_end([]) is None


def test_the_fast_lane_refuses_an_end_to_end_run():
    """tests/conftest.py stops it at the call, before the program starts."""
    with pytest.raises(AssertionError, match="starts snakemake: the fast lane"):
        subprocess.run([sys.executable, "-m", "snakemake", "--version"], capture_output=True)
    done = subprocess.run([sys.executable, "-c", "print(2)"], capture_output=True, text=True)
    assert done.stdout == "2\n"  # other subprocesses run


def test_a_test_file_imports_test_modules_of_its_own_folder_only():
    """A file runs alone (`pytest tests/model/test_x.py`) only if what it imports is on the
    path without other folders collected first: test modules of its own folder, or
    tests/support/. An import of another folder's test module passes in the whole suite (that
    folder was collected earlier) and fails alone."""
    crossing = []
    for path in _test_files():
        for name in re.findall(r"^(?:from|import) (test_\w+)", path.read_text(), re.M):
            if not (path.parent / f"{name}.py").exists():
                crossing.append(f"{path.relative_to(TESTS).as_posix()}: {name}")
    assert not crossing, f"move what these share into tests/support/: {crossing}"
