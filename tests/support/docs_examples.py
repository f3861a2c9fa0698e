"""The complete examples of a docs page (fenced `python` blocks whose first line names the
script and the command that runs it), and what each example of docs/sampler.md and
docs/models.md must print: the docs tests check the pages hold exactly these (fast lane) and
run each one as written (slow lane)."""

from __future__ import annotations

import re
from pathlib import Path

from repo_paths import ROOT

HEAD = re.compile(r"^# (\w+\.py) — run: (python|torchrun --nproc-per-node \d+) \1$")

SAMPLER_DOC = ROOT / "docs" / "sampler.md"
# script -> (what its output must say: every process's line, a package beyond the core it
# needs, whether it runs several processes)
SAMPLER_EXAMPLES = {
    "plain.py": (["resumed after step 3: the remaining"], None, False),
    "accumulate.py": (["optimizer steps"], None, False),
    "ddp.py": (["rank 0/2:", "rank 1/2:"], None, True),
    "closed_loop.py": (["rank 0/2: 2 epochs", "rank 1/2: 2 epochs", "refit at epoch 0 step 4"],
                       None, True),
    "accelerate_example.py": (["process 0/2:", "process 1/2:", "resumed after epoch 1 step 3"],
                              "accelerate", True),
    "lightning_example.py": (["process 0: epochs [0, 1] ran its rank's plan; resumed after step 5",
                              "process 1: epochs [0, 1] ran its rank's plan; resumed after step 5"],
                             "lightning", True),
    "diffusers_wan.py": (["diffusers WanTransformer3DModel: 3 steps"], "diffusers", False),
}

MODELS_DOC = ROOT / "docs" / "models.md"
# script -> (what its output must say, the packages beyond the core it needs)
MODELS_EXAMPLES = {
    "convert.py": ("loaded wan2.1-micro; diffusers reads the converted folder", ("diffusers",)),
    "diffusers_packed.py": ("PackedWan: 3 packed steps", ("diffusers",)),
    "lora.py": ("LoRA: 3 packed steps", ("peft",)),
}


def examples(doc: Path) -> dict[str, tuple[str, str]]:
    """The complete examples of `doc`, by script name -> (launcher, code)."""
    found = {}
    for code in re.findall(r"^```python\n(.*?)^```$", doc.read_text(), flags=re.S | re.M):
        head = HEAD.match(code.splitlines()[0])
        assert head, f"an example without its run line: {code.splitlines()[0]!r}"
        found[head.group(1)] = (head.group(2), code)
    return found
