"""docs/sampler.md's examples run as written, each by the command on its first line: plain
PyTorch (workers, exact resume), gradient accumulation (the accumulated gradient checked),
torchrun DDP with gloo, HF Accelerate and Lightning under torchrun with 2 processes on CPU
(each process must get exactly its rank's batches of each epoch's plan, and a run stopped
mid-epoch and resumed must run the uninterrupted run's batches, with its global step), and
diffusers' WanTransformer3DModel."""

from __future__ import annotations

import subprocess
import sys

import pytest
from docs_examples import SAMPLER_DOC, SAMPLER_EXAMPLES, examples
from training_setup import free_port


@pytest.mark.parametrize("name", list(SAMPLER_EXAMPLES))  # a script in a subprocess
def test_example_runs(name, tmp_path):
    expect, needs, _ = SAMPLER_EXAMPLES[name]
    if needs:
        pytest.importorskip(needs)
    launcher, code = examples(SAMPLER_DOC)[name]
    (tmp_path / name).write_text(code)
    if launcher == "python":
        args = [sys.executable, name]
    else:
        procs = launcher.split()[-1]
        args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", procs,
                "--master-addr", "127.0.0.1", "--master-port", str(free_port()), name]
    out = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    for line in expect:
        assert line in out.stdout, out.stdout[-2000:]
