"""The fused CUDA kernels against an fp64 reference, on a GPU (skipped without one).

Every case draws fresh random inputs (seeded from the clock, printed on failure), poisons the
allocator's free blocks with NaN before each launch (so an output element the kernel forgot
to write shows up as NaN), and compares by relative norm error: bf16/fp16 I/O <= 1e-2,
fp32 <= 1e-5. Covers odd B and S, both modulation layouts, both modulation dtypes, Wan's
strided chunk views, inputs the kernel must copy first (misaligned / non-unit last stride),
NaN propagation, rejected inputs, bitwise-deterministic backward, and torch.compile.

Runs under pytest or, where pytest is missing (the GPU machine), as a script (helpers:
tests/support/cuda_cases.py):
    PYTHONPATH=tests/support python tests/ops/test_kernel_cuda.py
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from cuda_cases import TOL, fresh_seed, parametrize, poison, pytest_marks, rel, run_as_script

from adaptiveload.ops import ln_modulate as lm

pytestmark = pytest_marks()

PIPELINE_ENV = "ADAPTIVELOAD_LN_BWD_PIPELINE"
# every Wan / DiT width (1152 Open-Sora, 1536 Wan 1.3B, 2048, 3072 HunyuanVideo-class, 4096,
# 5120 Wan 14B), the smallest and the largest supported D, and an odd one
SHAPES = [(3, 37, 1536), (1, 129, 5120), (5, 3, 8), (2, 17, 264), (3, 11, 4096), (1, 5, 8192),
          (2, 19, 1152), (2, 23, 2048), (1, 31, 3072)]
LAYOUTS = ["sample", "token"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _inputs(b, s, d, layout, dtype, mod_dtype, device="cuda"):
    x = (torch.randn(b, s, d, device=device) * 3 + 1).to(dtype)
    ms = 1 if layout == "sample" else s
    scale = (0.5 * torch.randn(b, ms, d, device=device)).to(mod_dtype)
    shift = (0.5 * torch.randn(b, ms, d, device=device)).to(mod_dtype)
    return x, scale, shift


def _fp64(x, scale, shift, eps=lm.EPS):
    return F.layer_norm(x.double(), (x.shape[-1],), eps=eps) * (1 + scale.double()) + shift.double()


def _fwd(x, scale, shift):
    b, s, d = x.shape
    poison(((b, s, d), x.dtype), ((b, s), torch.float32), ((b, s), torch.float32))
    return torch.ops.adaptiveload.ln_modulate_fwd(x, scale, shift, lm.EPS)


def _grads(x, scale, shift, dy):
    leaves = [t.detach().requires_grad_() for t in (x, scale, shift)]
    y = lm.ln_modulate(*leaves)
    poison((tuple(x.shape), x.dtype), (tuple(scale.shape), scale.dtype))
    return torch.autograd.grad(y, leaves, dy)


def _ref_grads(x, scale, shift, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, scale, shift)]
    return torch.autograd.grad(_fp64(*leaves), leaves, dy.double())


@parametrize("layout", LAYOUTS)
@parametrize("dtype", DTYPES)
@parametrize("mod_fp32", [True, False])
@parametrize("shape", SHAPES)
def test_forward_vs_fp64(shape, mod_fp32, dtype, layout):
    fresh_seed()
    mod_dtype = torch.float32 if mod_fp32 else dtype
    x, scale, shift = _inputs(*shape, layout, dtype, mod_dtype)
    y, mean, rstd = _fwd(x, scale, shift)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert not y.isnan().any() and not mean.isnan().any() and not rstd.isnan().any()
    assert rel(y, _fp64(x, scale, shift)) <= TOL[dtype]
    xd = x.double()
    assert rel(mean, xd.mean(-1)) <= 1e-5
    assert rel(rstd, (xd.var(-1, unbiased=False) + lm.EPS).rsqrt()) <= 1e-5


@parametrize("layout", LAYOUTS)
@parametrize("dtype", DTYPES)
@parametrize("mod_fp32", [True, False])
@parametrize("shape", SHAPES)
def test_backward_vs_fp64(shape, mod_fp32, dtype, layout):
    fresh_seed()
    mod_dtype = torch.float32 if mod_fp32 else dtype
    x, scale, shift = _inputs(*shape, layout, dtype, mod_dtype)
    dy = torch.randn(x.shape, device="cuda").to(dtype)
    got = _grads(x, scale, shift, dy)
    want = _ref_grads(x, scale, shift, dy)
    for name, g, w, t in zip(("dx", "dscale", "dshift"), got, want, (x, scale, shift), strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype, name
        assert not g.isnan().any(), name
        # an output rounded to a 16-bit type carries its rounding error; fp32 outputs are exact
        tol = TOL[t.dtype]
        assert rel(g, w) <= tol, (name, rel(g, w))


@parametrize("layout", LAYOUTS)
@parametrize("dtype", DTYPES)
def test_backward_without_pipeline(dtype, layout):
    """ADAPTIVELOAD_LN_BWD_PIPELINE=0 selects the unpipelined backward kernel: same numerics."""
    fresh_seed()
    previous = os.environ.get(PIPELINE_ENV)
    os.environ[PIPELINE_ENV] = "0"
    try:
        for shape in [(3, 37, 1536), (1, 1029, 5120), (2, 17, 264), (1, 7, 8192)]:
            x, scale, shift = _inputs(*shape, layout, dtype, torch.float32)
            dy = torch.randn(x.shape, device="cuda").to(dtype)
            got = _grads(x, scale, shift, dy)
            for g, w in zip(got, _ref_grads(x, scale, shift, dy), strict=True):
                assert not g.isnan().any() and rel(g, w) <= TOL[g.dtype]
    finally:
        if previous is None:
            os.environ.pop(PIPELINE_ENV)
        else:
            os.environ[PIPELINE_ENV] = previous


@parametrize("layout", LAYOUTS)
def test_long_sequences_many_ctas_per_sample(layout):
    """Wan 14B's longest shape (persistent CTAs, many partials) and several samples."""
    fresh_seed()
    for b, s, d in [(1, 75600, 5120), (3, 20011, 1536)]:
        x, scale, shift = _inputs(b, s, d, layout, torch.bfloat16, torch.float32)
        dy = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
        y, _, _ = _fwd(x, scale, shift)
        assert rel(y, _fp64(x, scale, shift)) <= 1e-2
        for g, w in zip(_grads(x, scale, shift, dy), _ref_grads(x, scale, shift, dy), strict=True):
            assert rel(g, w) <= 1e-2
        del x, scale, shift, dy, y
        torch.cuda.empty_cache()


@parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wan_chunk_views_read_in_place(dtype):
    """Wan hands over scale/shift as chunks of an fp32 [B, 6, D] (per sample) or [B, S, 6, D]
    (per token) tensor: strided views, read without a copy."""
    fresh_seed()
    b, s, d = 3, 33, 1536
    x = torch.randn(b, s, d, device="cuda").to(dtype)
    per_sample = torch.randn(b, 6, d, device="cuda").chunk(6, dim=1)
    per_token = [t.squeeze(2) for t in torch.randn(b, s, 6, d, device="cuda").chunk(6, dim=2)]
    dy = torch.randn(b, s, d, device="cuda").to(dtype)
    for e in (per_sample, per_token):
        shift, scale = e[0], e[1]
        assert not scale.is_contiguous()
        y, _, _ = _fwd(x, scale, shift)
        assert rel(y, _fp64(x, scale, shift)) <= TOL[dtype]
        for g, w in zip(_grads(x, scale, shift, dy), _ref_grads(x, scale, shift, dy), strict=True):
            assert rel(g, w) <= TOL[dtype]


def test_unaligned_and_non_unit_stride_inputs_are_copied_not_misread():
    fresh_seed()
    b, s, d = 2, 9, 264
    x = torch.randn(b, s, d, 2, device="cuda")[..., 0]  # last-dim stride 2
    wide = torch.randn(b, 1, d + 1, device="cuda")
    scale = wide[..., 1:]  # base pointer 4 bytes past a 16-byte boundary
    shift = torch.randn(b, 1, d, device="cuda")
    y, _, _ = _fwd(x, scale, shift)
    assert rel(y, _fp64(x, scale, shift)) <= 1e-5
    dy = torch.randn(b, s, d, device="cuda")
    for g, w in zip(_grads(x, scale, shift, dy), _ref_grads(x, scale, shift, dy), strict=True):
        assert rel(g, w) <= 1e-5


def test_nan_in_nan_out_like_reference():
    fresh_seed()
    x, scale, shift = _inputs(3, 7, 1536, "sample", torch.bfloat16, torch.float32)
    x[1, 2, 5] = float("nan")
    scale[2, 0, 7] = float("nan")
    y, _, _ = _fwd(x, scale, shift)
    want = lm.reference(x.cpu(), scale.cpu(), shift.cpu())
    assert torch.equal(y.isnan().cpu(), want.isnan())
    assert y[1, 2].isnan().all() and y[2, :, 7].isnan().all() and not y[0].isnan().any()


def test_backward_is_bitwise_deterministic():
    fresh_seed()
    x, scale, shift = _inputs(2, 4099, 5120, "sample", torch.bfloat16, torch.float32)
    dy = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
    first = _grads(x, scale, shift, dy)
    second = _grads(x, scale, shift, dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_empty_sequence():
    x, scale, shift = _inputs(2, 0, 64, "sample", torch.bfloat16, torch.float32)
    y, mean, rstd = _fwd(x, scale, shift)
    assert y.shape == (2, 0, 64) and mean.shape == (2, 0)
    dx, dscale, dshift = torch.ops.adaptiveload.ln_modulate_bwd(y, x, scale, mean, rstd)
    assert dx.shape == x.shape and torch.equal(dscale, torch.zeros_like(scale))
    assert torch.equal(dshift, torch.zeros_like(shift))


REJECT_SCRIPT = """
import re, torch
from adaptiveload.ops import ln_modulate as lm
ops = torch.ops.adaptiveload
x = torch.randn(2, 3, 16, device="cuda")
s = torch.randn(2, 1, 16, device="cuda")
big = torch.randn(1, 2, 8200, device="cuda")
xs, ss = x.reshape(6, 16), s[:, 0]  # the segment layout: a stream of 2 segments
cu = torch.tensor([0, 2, 6], dtype=torch.int32, device="cuda")


def dense(*args):  # the public function (Python validator) and the raw op (C++ checks)
    return lambda: lm.ln_modulate(*args), lambda: ops.ln_modulate_fwd(*args, lm.EPS)


def packed(*args):
    return lambda: lm.ln_modulate_segments(*args), lambda: ops.ln_modulate_seg_fwd(*args, lm.EPS)


cases = [
    ("D = 12 unsupported", dense(x[..., :12], s[..., :12], s[..., :12])),
    ("D = 8200 unsupported", dense(big, big[:, :1], big[:, :1])),
    ("float32, float16", dense(x.double(), s.double(), s.double())),
    ("must be float32 or x's dtype", dense(x.bfloat16(), s.half(), s.half())),
    ("scale must be", dense(x, s[:1], s[:1])),
    ("same shape and dtype", dense(x, s, torch.randn(2, 3, 16, device="cuda"))),
    ("is on cpu", dense(x, s.cpu(), s.cpu())),
    ("D = 12 unsupported", packed(xs[:, :12], ss[:, :12], ss[:, :12], cu)),
    ("float32, float16", packed(xs.double(), ss.double(), ss.double(), cu)),
    ("must be float32 or x's dtype", packed(xs.bfloat16(), ss.half(), ss.half(), cu)),
    (r"scale must be \\[G, D\\]", packed(xs, s, s, cu)),
    ("same shape and dtype", packed(xs.bfloat16(), ss, ss.bfloat16(), cu)),
    ("cu_seqlens must be int32", packed(xs, ss, ss, cu.long())),
    ("cu_seqlens must be int32", packed(xs, ss, ss, cu[:2])),
    ("is on cpu", packed(xs, ss, ss, cu.cpu())),
    ("x must be", packed(x, ss, ss, cu)),
]
for match, calls in cases:
    for call in calls:
        try:
            call()
        except (ValueError, TypeError, RuntimeError) as err:
            assert re.search(match, str(err)), (match, str(err))
        else:
            raise AssertionError(f"not rejected: {match}")
y, mean, rstd = ops.ln_modulate_fwd(x, s, s, lm.EPS)
ys, means, rstds = ops.ln_modulate_seg_fwd(xs, ss, ss, cu, lm.EPS)
for bad_bwd in (lambda: ops.ln_modulate_bwd(y, x, s, mean[:, :2], rstd),
                lambda: ops.ln_modulate_seg_bwd(ys, xs, ss, cu, means[:5], rstds)):
    try:
        bad_bwd()
    except ValueError as err:
        assert "mean/rstd" in str(err) or "mean must be" in str(err), str(err)
    else:
        raise AssertionError("bwd with bad mean not rejected")
print("all rejected")
"""


def test_rejects_unsupported_inputs_clearly():
    """In a child process, so a crash is a failed test, not a dead test run (the first H200 run
    segfaulted here); both the public function and the raw op, fwd and bwd, dense and segment
    layouts."""
    out = subprocess.run([sys.executable, "-c", REJECT_SCRIPT], capture_output=True, text=True,
                         check=False, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stdout[-2000:], out.stderr[-4000:])
    assert "all rejected" in out.stdout


@parametrize("b", [1, 2])
def test_torch_compile_fullgraph(b):
    """Inductor on CUDA through the op, with Wan's [1, 1, D] / [B, 1, D] chunk-view modulation
    and a dynamic S: gradients in the leaves' shapes, equal to eager's."""
    fresh_seed()
    torch._dynamo.reset()

    def block(x, scale, shift):
        return (lm.ln_modulate(x, scale, shift).float() * 2).square().mean()

    compiled = torch.compile(block, fullgraph=True)
    for s in (65, 1029):
        x = torch.randn(b, s, 1536, device="cuda").to(torch.bfloat16).requires_grad_()
        e = 0.3 * torch.randn(b, 6, 1536, device="cuda")
        leaves = [x, e[:, 1:2].detach().requires_grad_(), e[:, 0:1].detach().requires_grad_()]
        torch._dynamo.maybe_mark_dynamic(x, 1)
        got = torch.autograd.grad(compiled(*leaves), leaves)
        want = torch.autograd.grad(block(*leaves), leaves)
        for g, w, leaf in zip(got, want, leaves, strict=True):
            assert g.shape == leaf.shape
            # Inductor may reorder the fp32 pointwise math
            torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-6)


def test_compiled_eager_baseline_keeps_broadcast_grad_shapes():
    """The benchmark's torch.compile baseline at B = 1, D = 1536 (it returned [1536] for a
    [1, 1, 1536] leaf on the first H200 run, with a dynamic S)."""
    from adaptiveload.ops import kernel_bench

    x = torch.randn(1, 4096, 1536, device="cuda").to(torch.bfloat16).requires_grad_()
    e = 0.1 * torch.randn(1, 6, 1536, device="cuda")
    leaves = [x, e[:, 1:2].detach().requires_grad_(), e[:, 0:1].detach().requires_grad_()]
    fn = kernel_bench.compiled_baseline()
    y = fn(*leaves)
    got = torch.autograd.grad(y, leaves, torch.randn_like(y))
    assert [tuple(g.shape) for g in got] == [tuple(t.shape) for t in leaves]


def test_fused_path_is_the_one_running():
    """A CUDA call must reach the CUDA kernel, not the reference (which is registered too)."""
    assert lm.fused_available(), lm.fused_unavailable_reason()
    assert torch._C._dispatch_has_kernel_for_dispatch_key(lm.FWD_OP, "CUDA")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        x, scale, shift = _inputs(1, 8, 1536, "sample", torch.bfloat16, torch.float32)
        _fwd(x, scale, shift)
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    assert "ln_mod_fwd_kernel" in names, names[:2000]


if __name__ == "__main__":
    sys.exit(run_as_script(globals()))
