"""docs/models.md's examples run as written, each in a fresh folder: a checkpoint loaded and
converted (diffusers reads the result and agrees), three packed steps of diffusers'
WanTransformer3DModel through PackedWan with the sampler, and a LoRA trained packed, merged
and exported."""

from __future__ import annotations

import subprocess
import sys

import pytest
from docs_examples import MODELS_DOC, MODELS_EXAMPLES, examples


@pytest.mark.parametrize("name", list(MODELS_EXAMPLES))
def test_example_runs(name, tmp_path):
    expect, needs = MODELS_EXAMPLES[name]
    for package in needs:
        pytest.importorskip(package)
    _, code = examples(MODELS_DOC)[name]
    (tmp_path / name).write_text(code)
    out = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert expect in out.stdout, out.stdout[-2000:]
    if name == "convert.py":  # the gap of the two implementations, fp32 (fidelity test's bound)
        assert float(out.stdout.rsplit("gap ", 1)[1]) <= 1e-4
    if name == "lora.py":
        assert (tmp_path / "wan-lora-merged" / "transformer" / "config.json").is_file()
