"""The ln_modulate custom op on CPU (the reference kernels): numerics against fp64, autograd,
torch.library registration (opcheck), torch.compile tracing and input validation. These run
whether or not the CUDA library is built (it only adds CUDA kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from adaptiveload.ops import kernel_lib
from adaptiveload.ops import ln_modulate as lm

torch.set_num_threads(1)


def test_not_built_fallback_defines_the_ops():
    """Without the library the same ops exist (defined in Python) and run the reference."""
    code = (
        "import torch; from adaptiveload.ops import ln_modulate as lm\n"
        "assert not lm._LOAD.loaded and 'not found' in lm.fused_unavailable_reason()\n"
        "x, s, t = torch.randn(2, 3, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)\n"
        "torch.testing.assert_close(lm.ln_modulate(x, s, t), lm.reference(x, s, t))\n"
        "print(torch.ops.adaptiveload.ln_modulate_fwd.default._schema)\n"
        "print(torch.ops.adaptiveload.ln_modulate_seg_fwd.default._schema)\n"
    )
    env = dict(os.environ, ADAPTIVELOAD_BUILD_DIR="/nonexistent")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "ln_modulate_fwd" + lm.FWD_SCHEMA in out.stdout
    assert "ln_modulate_seg_fwd" + lm.SEG_FWD_SCHEMA in out.stdout


def test_library_built_for_another_torch_is_not_loaded(tmp_path):
    """A build record naming another torch version keeps the library unloaded, with the reason."""
    lib = tmp_path / "adaptiveload_kernels.so"
    lib.write_bytes(b"not a library")
    (tmp_path / "build.json").write_text('{"torch_version": "0.0.0"}')
    code = "from adaptiveload.ops import ln_modulate as lm\nprint(lm.fused_unavailable_reason())\n"
    env = dict(os.environ, ADAPTIVELOAD_BUILD_DIR=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "built for torch 0.0.0" in out.stdout


@pytest.mark.parametrize("recorded", ["0123456789abcdef", None])
def test_library_built_from_other_sources_is_not_loaded(tmp_path, recorded):
    """A library of older kernel sources (or a record without their digest) would run in place
    of the code beside it under the same op names: it stays unloaded, the reason says rebuild.
    The record of the current sources passes this check (and fails only at loading the fake)."""

    (tmp_path / "adaptiveload_kernels.so").write_bytes(b"not a library")
    code = "from adaptiveload.ops import ln_modulate as lm\nprint(lm.fused_unavailable_reason())\n"
    env = dict(os.environ, ADAPTIVELOAD_BUILD_DIR=str(tmp_path))

    def reason(digest):
        record = {"torch_version": torch.__version__}
        if digest is not None:
            record["sources_digest"] = digest
        (tmp_path / "build.json").write_text(json.dumps(record))
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout

    stale = reason(recorded)
    assert "built from other kernel sources" in stale and "rebuild" in stale
    current = reason(kernel_lib.sources_digest())
    assert "other kernel sources" not in current and "loading" in current
