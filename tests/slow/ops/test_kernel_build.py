"""The CUDA library really builds here (nvcc, sm_90), holds sm_90 device code, and loads on a
GPU-less machine, registering the ops; the build skips cleanly where nvcc is absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adaptiveload.ops import kernel_build as kb
from adaptiveload.ops import ln_modulate as lm

# ~25-50 s on 2 shared cores for one architecture


def _run_with_library(built: dict, code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter that loads the built library; it must exit 0."""
    env = dict(os.environ, ADAPTIVELOAD_BUILD_DIR=str(Path(built["library"]).parent))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    if reason := kb.skip_reason():
        pytest.skip(f"cannot build the CUDA library here: {reason}")
    return kb.build(tmp_path_factory.mktemp("kernels"), arch="9.0")


def test_build_record(built: dict) -> None:
    assert built["status"] == "built", built
    assert Path(built["library"]).is_file()
    assert built["arch_list"] == "9.0" and "release" in built["nvcc_version"]
    record = json.loads((Path(built["library"]).parent / kb.RECORD_NAME).read_text())
    assert record == json.loads(json.dumps(built))


def test_library_holds_sm90_code(built: dict) -> None:
    if built["cubins"] is None:
        pytest.skip("no cuobjdump found (CUDA toolkit bin/, PATH, or Triton's copy)")
    assert built["cubins"] and all(name.endswith("sm_90.cubin") for name in built["cubins"])


def test_library_loads_and_registers_ops(built: dict) -> None:
    """Fresh process: the loaded library defines the schemas (the Python side then adds CPU,
    fake and autograd kernels); CPU tensors still take the reference path."""
    code = (
        "import torch; from adaptiveload.ops import ln_modulate as lm\n"
        "assert lm._LOAD.loaded, lm._LOAD\n"
        "assert not lm._MISSING_FROM_LIBRARY, lm._MISSING_FROM_LIBRARY\n"
        "for op in ('ln_modulate_fwd', 'ln_modulate_bwd', 'ln_modulate_seg_fwd',"
        " 'ln_modulate_seg_bwd'):\n"
        "    print(getattr(torch.ops.adaptiveload, op).default._schema)\n"
        "    assert torch._C._dispatch_has_kernel_for_dispatch_key('adaptiveload::' + op, 'CUDA')\n"
        "x, s, t = torch.randn(2, 3, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)\n"
        "torch.testing.assert_close(lm.ln_modulate(x, s, t), lm.reference(x, s, t))\n"
        "cu = torch.tensor([0, 4, 6], dtype=torch.int32)\n"
        "x, s = torch.randn(6, 16), torch.randn(2, 16)\n"
        "torch.testing.assert_close(lm.ln_modulate_segments(x, s, s, cu),"
        " lm.reference_segments(x, s, s, cu))\n"
    )
    out = _run_with_library(built, code)
    for name, schema in [("ln_modulate_fwd", lm.FWD_SCHEMA), ("ln_modulate_bwd", lm.BWD_SCHEMA),
                         ("ln_modulate_seg_fwd", lm.SEG_FWD_SCHEMA),
                         ("ln_modulate_seg_bwd", lm.SEG_BWD_SCHEMA)]:
        assert f"adaptiveload::{name}{schema}" in out.stdout


def test_build_skips_without_nvcc(tmp_path: Path) -> None:
    """No nvcc: exit 0, status 'skipped' with the reason (the pipeline's kernel_build rule)."""
    env = dict(
        os.environ, CUDA_HOME=str(tmp_path / "no-cuda"), PATH=str(Path(sys.executable).parent)
    )
    env.pop("CUDA_PATH", None)
    out = subprocess.run(
        [sys.executable, "-m", "adaptiveload", "kernel", "build", "--build-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0, out.stderr
    record = json.loads((tmp_path / kb.RECORD_NAME).read_text())
    assert record["status"] == "skipped" and "nvcc" in record["reason"]
    assert "skipped" in out.stdout


def test_binding_checks_raise_instead_of_crashing(built: dict) -> None:
    """The C++ CUDA kernel entry reached with bad input (redispatched to the CUDA key with CPU
    tensors, in a child process so a crash fails this test) raises ValueError: the throw path
    that the first H200 run saw end in a segfault works here."""
    code = (
        "import torch; from adaptiveload.ops import ln_modulate as lm\n"
        "assert lm._LOAD.loaded, lm._LOAD\n"
        "ks = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)\n"
        "ops = torch.ops.adaptiveload\n"
        "s = torch.randn(2, 1, 16)\n"
        "cu = torch.tensor([0, 2, 6], dtype=torch.int32)\n"
        "calls = [lambda: ops.ln_modulate_fwd.default.redispatch(ks, torch.randn(2, 3, 16), s, s,"
        " 1e-6),\n"
        "         lambda: ops.ln_modulate_fwd.default.redispatch(ks, torch.randn(6, 16), s, s,"
        " 1e-6),\n"
        "         lambda: ops.ln_modulate_bwd.default.redispatch(ks, torch.randn(2, 3, 16),"
        " torch.randn(2, 3, 16), s, torch.randn(2, 3), torch.randn(2, 3)),\n"
        "         lambda: ops.ln_modulate_seg_fwd.default.redispatch(ks, torch.randn(6, 16),"
        " s[:, 0], s[:, 0], cu, 1e-6),\n"
        "         lambda: ops.ln_modulate_seg_fwd.default.redispatch(ks, torch.randn(2, 3, 16),"
        " s[:, 0], s[:, 0], cu, 1e-6),\n"
        "         lambda: ops.ln_modulate_seg_bwd.default.redispatch(ks, torch.randn(6, 16),"
        " torch.randn(6, 16), s[:, 0], cu, torch.randn(6), torch.randn(6))]\n"
        "for call in calls:\n"
        "    try:\n"
        "        call()\n"
        "    except ValueError as err:\n"
        "        print('rejected:', str(err).splitlines()[0])\n"
    )
    out = _run_with_library(built, code)
    assert out.stdout.count("rejected:") == 6, out.stdout
    assert "got x on cpu" in out.stdout and "x must be [B, S, D]" in out.stdout
    assert "ln_modulate_segments: the CUDA kernel got x on cpu" in out.stdout
    assert "ln_modulate_segments: x must be [L, D]" in out.stdout
