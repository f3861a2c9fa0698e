"""experiments/gpu/kernel_check.sh as a GPU-less dry run (ALLOW_NO_GPU=1, no CUDA toolkit):
every part runs under its limit and is recorded in steps.tsv, the CUDA parts skip with their
reason, the end-to-end step runs the tiny model on the CPU, and the archive is packed."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from repo_paths import ROOT


def test_kernel_check_dry_run_packs_every_part(tmp_path: Path) -> None:
    out, pack = tmp_path / "kernel", tmp_path / "kernel.tgz"
    env = dict(
        os.environ, ALLOW_NO_GPU="1", PYTHON=sys.executable, PACK=str(pack),
        CUDA_HOME=str(tmp_path / "no-cuda"), PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",
        NCU_TIMEOUT_S="0", OMP_NUM_THREADS="1",
        # the suite runs these files itself: here the part's plumbing, on two of their tests
        CPU_OP_TESTS="tests/ops/test_kernel_ops.py::test_opcheck "
        "tests/ops/test_kernel_segments.py::test_homogeneous_pack_equals_the_dense_op",
    )
    env.pop("ADAPTIVELOAD_BUILD_DIR", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "experiments" / "gpu" / "kernel_check.sh"), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    rows = csv.DictReader((out / "steps.tsv").read_text().splitlines(), delimiter="\t")
    steps = {r["step"]: r for r in rows}
    # background parts (resources, cpu_op_tests) may finish in any order
    assert set(steps) == {"build", "resources", "cpu_op_tests", "cuda_tests",
                          "cuda_segment_tests", "bench", "bench_segments", "bench_widths",
                          "bench_nopipe", "e2e"}
    assert all(r["status"] == "0" for r in steps.values())
    assert "skipped" in (out / "build.json").read_text()
    assert "resource check skipped: nvcc not found" in (out / "resources.txt").read_text()
    assert "skipped" in (out / "bench.csv").read_text()
    assert "skipped" in (out / "bench_widths.csv").read_text()
    assert "skipped" in (out / "bench_segments.csv").read_text()
    assert "SKIPPED" in (out / "cuda_segment_tests.log").read_text()
    assert "passed" in (out / "cpu_op_tests.log").read_text()
    e2e = list(csv.DictReader((out / "e2e.csv").read_text().splitlines()))
    assert {(r["S"], r["kernel"]) for r in e2e} == {
        ("16", "eager"), ("16", "fused"), ("48", "eager"), ("48", "fused")
    }
    summary = (out / "summary.txt").read_text()
    assert "end to end" in summary and "wan2.1-micro 48 fused" in summary
    assert "packed streams" in summary
    with tarfile.open(pack) as tar:
        names = set(tar.getnames())
    assert {"kernel/steps.tsv", "kernel/summary.txt", "kernel/e2e.csv"} <= names
