"""docs/sampler.md's examples run as written, each by the command on its first line: plain
PyTorch (workers, exact resume), gradient accumulation (the accumulated gradient checked),
torchrun DDP with gloo, HF Accelerate and Lightning under torchrun with 2 processes on CPU
(each process must get exactly its rank's batches of each epoch's plan, and a run stopped
mid-epoch and resumed must run the uninterrupted run's batches, with its global step), and
diffusers' WanTransformer3DModel."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from training_setup import free_port

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "sampler.md"
HEAD = re.compile(r"^# (\w+\.py) — run: (python|torchrun --nproc-per-node \d+) \1$")

# script -> (what its output must say: every process's line, a package beyond the core it
# needs, whether it runs several processes)
EXAMPLES = {
    "plain.py": (["resumed after step 3: the remaining"], None, False),
    "accumulate.py": (["optimizer steps"], None, False),
    "ddp.py": (["rank 0/2:", "rank 1/2:"], None, True),
    "accelerate_example.py": (["process 0/2:", "process 1/2:", "resumed after epoch 1 step 3"],
                              "accelerate", True),
    "lightning_example.py": (["process 0: epochs [0, 1] ran its rank's plan; resumed after step 5",
                              "process 1: epochs [0, 1] ran its rank's plan; resumed after step 5"],
                             "lightning", True),
    "diffusers_wan.py": (["diffusers WanTransformer3DModel: 3 steps"], "diffusers", False),
}


def examples(doc: Path = DOC) -> dict[str, tuple[str, str]]:
    """The complete examples of `doc`: fenced `python` blocks, by script name -> (launcher,
    code)."""
    found = {}
    for code in re.findall(r"^```python\n(.*?)^```$", doc.read_text(), flags=re.S | re.M):
        head = HEAD.match(code.splitlines()[0])
        assert head, f"an example without its run line: {code.splitlines()[0]!r}"
        found[head.group(1)] = (head.group(2), code)
    return found


def test_doc_has_every_example():
    assert list(examples()) == list(EXAMPLES)
    text = DOC.read_text()
    assert "use_distributed_sampler=False" in examples()["lightning_example.py"][1]
    assert "PlanDataLoader(" in examples()["lightning_example.py"][1]
    assert "rank=None" in examples()["accelerate_example.py"][1]
    assert "prepare(accelerator, " in examples()["accelerate_example.py"][1]
    assert "```python fragment" not in text  # every example runs


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) for n in EXAMPLES],  # a script in a subprocess
)
def test_example_runs(name, tmp_path):
    expect, needs, _ = EXAMPLES[name]
    if needs:
        pytest.importorskip(needs)
    launcher, code = examples()[name]
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
