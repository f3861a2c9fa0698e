"""The segment layout of the ln_modulate op on CPU (the reference kernels): a packed token
stream x [L, D] of G samples, one modulation row per segment ([G, D]) and int32 offsets
cu_seqlens [G + 1]. Numerics against an fp64 oracle that runs each segment alone, agreement
with the dense op on a homogeneous pack, autograd, gradcheck in fp64, torch.library opcheck,
torch.compile(fullgraph=True) with a dynamic L, validation of shapes and of offset values,
and the memory the op saves against the eager gather. These run whether or not the CUDA
library is built (it only adds CUDA kernels)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from segment_packs import gradcheck_fp64, offsets

from adaptiveload.ops import ln_modulate as lm

torch.set_num_threads(1)


@pytest.mark.parametrize("lengths", [(4,)])
def test_gradcheck_fp64(lengths):
    assert gradcheck_fp64(lengths)


def test_gradcheck_fp64_strided_chunk_views():
    """scale/shift as rows of a [G, 6, D] modulation tensor (row stride 6 D), like a packed Wan
    block's per-sample chunks."""
    gen = torch.Generator().manual_seed(6)
    cu = offsets((3, 2))
    x = torch.randn(5, 16, generator=gen, dtype=torch.float64).requires_grad_()
    e = (0.3 * torch.randn(2, 6, 16, generator=gen, dtype=torch.float64)).requires_grad_()

    def fn(x, e):
        return lm.ln_modulate_segments(x, e[:, 1], e[:, 0], cu)

    assert e[:, 1].stride() == (96, 1)
    assert torch.autograd.gradcheck(fn, (x, e))


STALE_LIBRARY = """
import torch
from pathlib import Path
from adaptiveload.ops import kernel_lib
# what loading a library built before the segment kernels leaves: only the dense ops defined
old = torch.library.Library("adaptiveload", "DEF")
old.define("ln_modulate_fwd(Tensor x, Tensor scale, Tensor shift, float eps) -> "
           "(Tensor, Tensor, Tensor)")
old.define("ln_modulate_bwd(Tensor dy, Tensor x, Tensor scale, Tensor mean, Tensor rstd) -> "
           "(Tensor, Tensor, Tensor)")
kernel_lib._STATE = kernel_lib.LoadState(loaded=True, path=Path("old.so"), reason="loaded")
from adaptiveload.ops import ln_modulate as lm
print(lm.fused_unavailable_reason())
x, s, cu = torch.randn(5, 16), torch.randn(2, 16), torch.tensor([0, 2, 5], dtype=torch.int32)
torch.testing.assert_close(lm.ln_modulate_segments(x, s, s, cu), lm.reference_segments(x, s, s, cu))
print(torch.ops.adaptiveload.ln_modulate_seg_fwd.default._schema)
"""


def test_library_without_the_segment_ops_still_imports_and_says_rebuild():
    """A library built from older sources defines only the dense ops: the segment ops are
    defined here (reference math), and the fused path is reported unavailable until rebuilt."""
    env = dict(os.environ, ADAPTIVELOAD_BUILD_DIR="/nonexistent")
    out = subprocess.run([sys.executable, "-c", STALE_LIBRARY], env=env, capture_output=True,
                         text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "old.so predates ln_modulate_seg_fwd, ln_modulate_seg_bwd: rebuild" in out.stdout
    assert "ln_modulate_seg_fwd" + lm.SEG_FWD_SCHEMA in out.stdout
