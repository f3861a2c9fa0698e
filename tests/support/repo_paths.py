"""Where the checkout's parts are, for every test and helper: the one place a path is worked
out from a file's location (tests/support/ is on pytest's `pythonpath`, pyproject.toml), so a
test moved between folders finds the same files."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: Snakefile, experiments/, docs/
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"  # these helpers: a test's subprocess imports them from here
FIXTURES = TESTS / "fixtures"  # committed input files: tiny.yaml, H200 calibrations, digests
TINY = FIXTURES / "tiny.yaml"  # the tiny experiment the pipeline tests run
SLOW = TESTS / "slow"  # the slow lane: tests/slow/conftest.py marks every test under it
GPU_SCRIPTS = ROOT / "experiments" / "gpu"  # the device runs; they import each other by name
CALIBRATIONS = ROOT / "experiments" / "calibration"  # the shipped ones, linked by name
H200_PRIOR = CALIBRATIONS / "h200-wan2.1-t2v-1.3b.json"  # the 1.3B analytic prior
H200_MEASURED = CALIBRATIONS / "h200-wan2.1-t2v-1.3b-measured.json"  # the 1.3B refit
# copies of the first H200 run's calibrations: its grid5 run and the grid7 runs 2 and 3
H200_RUNS = FIXTURES / "h200-2026-11-30"
H200_GRID7 = {f"run{i}": H200_RUNS / f"calibration-grid7-run{i}.json" for i in (2, 3)}
# the default experiment's recorded runs and the texts whose numbers are generated from them
DEFAULT_RECORDS = ROOT / "results" / "reference" / "default"
GENERATED_DOCS = (ROOT / "README.md", ROOT / "docs" / "results.md")
CONVERGENCE_BENCHMARK = ROOT / "results" / "benchmarks" / "convergence.json"
# experiments/baselines.yaml's recorded runs and the page generated from them
BASELINES_RECORDS = ROOT / "results" / "reference" / "baselines"
BASELINES_DOC = ROOT / "docs" / "baselines.md"
