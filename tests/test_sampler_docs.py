"""docs/sampler.md's examples run as written: plain PyTorch (num_workers=2, exact resume) and
HF Accelerate with 2 processes on CPU (gloo), where each process must get exactly its rank's
batches of the plan (not a second sharding of them)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from training_setup import free_port

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "sampler.md"


def examples() -> list[str]:
    """The complete examples: fenced blocks whose info string is exactly `python`."""
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text(), flags=re.S | re.M)


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=600)


def test_doc_has_the_two_examples():
    blocks = examples()
    assert len(blocks) == 2
    assert "num_workers=2" in blocks[0] and "consumed_steps" in blocks[0]
    assert "from accelerate import Accelerator" in blocks[1] and "rank=None" in blocks[1]


@pytest.mark.slow
def test_plain_pytorch_example_runs(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(examples()[0])
    out = run([sys.executable, str(script)], tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed after step 3: the remaining" in out.stdout


@pytest.mark.slow
def test_accelerate_example_two_processes(tmp_path):
    pytest.importorskip("accelerate")
    script = tmp_path / "accel.py"
    script.write_text(examples()[1])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(free_port())]  # fmt: skip
    out = run([*torchrun, str(script)], tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("process "))
    assert [line.split(":")[0] for line in lines] == ["process 0/2", "process 1/2"], out.stdout
