"""docs/models.md's examples run as written, each in a fresh folder: a checkpoint loaded and
converted (diffusers reads the result and agrees), three packed steps of diffusers'
WanTransformer3DModel through PackedWan with the sampler, and a LoRA trained packed, merged
and exported."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_sampler_docs import ROOT, examples

DOC = ROOT / "docs" / "models.md"
# script -> (what its output must say, the packages beyond the core it needs)
EXAMPLES = {
    "convert.py": ("loaded wan2.1-micro; diffusers reads the converted folder", ("diffusers",)),
    "diffusers_packed.py": ("PackedWan: 3 packed steps", ("diffusers",)),
    "lora.py": ("LoRA: 3 packed steps", ("peft",)),
}


def test_doc_has_every_example():
    assert list(examples(DOC)) == list(EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_runs(name, tmp_path):
    expect, needs = EXAMPLES[name]
    for package in needs:
        pytest.importorskip(package)
    _, code = examples(DOC)[name]
    (tmp_path / name).write_text(code)
    out = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert expect in out.stdout, out.stdout[-2000:]
    if name == "convert.py":  # the gap of the two implementations, fp32 (fidelity test's bound)
        assert float(out.stdout.rsplit("gap ", 1)[1]) <= 1e-4
    if name == "lora.py":
        assert (tmp_path / "wan-lora-merged" / "transformer" / "config.json").is_file()
