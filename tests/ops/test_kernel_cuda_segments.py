"""The fused CUDA kernels in the segment layout (a packed token stream x [L, D] of G samples,
scale/shift [G, D], int32 offsets cu_seqlens [G + 1]) against an fp64 reference, on a GPU
(skipped without one).

As tests/ops/test_kernel_cuda.py: fresh random inputs (seed printed on failure), NaN-poisoned
allocator blocks before each launch, relative norm error (bf16/fp16 I/O <= 1e-2, fp32 <=
1e-5). Covers every Wan width and the extremes, both modulation dtypes, empty and one-row
segments, a single segment, 64 uneven segments, 1,000 tiny ones, 65,535 one-row ones, a
75,600-token pack, equality with the dense kernel on a homogeneous pack, Wan's strided
modulation rows, inputs that must be copied, NaN staying in its row, the unpipelined
backward, bitwise-deterministic per-segment sums, offsets that break the rules stopping the
kernels (device-side assert, in a child process), torch.compile with a dynamic L, the memory
the fused op saves against the eager gather, and that the segment kernels are the ones
running. Rejected shapes: test_kernel_cuda.py's child process covers both layouts.

Runs under pytest or, where pytest is missing (the GPU machine), as a script:
    PYTHONPATH=tests/support python tests/ops/test_kernel_cuda_segments.py
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from cuda_cases import TOL, fresh_seed, parametrize, poison, pytest_marks, rel, run_as_script

from adaptiveload.ops import ln_modulate as lm

pytestmark = pytest_marks()

PIPELINE_ENV = "ADAPTIVELOAD_LN_BWD_PIPELINE"
WIDTHS = [8, 264, 1152, 1536, 2048, 3072, 4096, 5120, 8192]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# images and clips with empty segments between and at the end, one-row segments
MIXED = (37, 0, 5, 130, 1, 64, 0)


def _uneven(total: int, count: int) -> tuple[int, ...]:
    """`count` lengths summing to `total`, drawn from the current seed (some may be 0)."""
    cuts = torch.randint(0, total + 1, (count - 1,)).sort().values.tolist()
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in itertools.pairwise(bounds))


def _packs() -> dict[str, tuple[int, ...]]:
    return {
        "single": (300,),
        "empty_ends": (0, 0, 77, 0, 91, 0),
        "g64_uneven": _uneven(16384, 64),
        "g1000_tiny": tuple(int(v) for v in torch.randint(0, 6, (1000,))),
        "g65535_rows": (1,) * 65535,
        "l75600_g8": _uneven(75600, 8),
    }


PACK_NAMES = ["single", "empty_ends", "g64_uneven", "g1000_tiny", "g65535_rows", "l75600_g8"]


def _offsets(lengths) -> torch.Tensor:
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return cu.to(torch.int32).cuda()


def _inputs(lengths, d, dtype, mod_dtype):
    cu = _offsets(lengths)
    total, g = int(cu[-1]), len(lengths)
    x = (torch.randn(total, d, device="cuda") * 3 + 1).to(dtype)
    scale = (0.5 * torch.randn(g, d, device="cuda")).to(mod_dtype)
    shift = (0.5 * torch.randn(g, d, device="cuda")).to(mod_dtype)
    return x, scale, shift, cu


def _fp64(x, scale, shift, cu, eps=lm.EPS):
    rows = lm.segment_ids(cu, x.shape[0])
    y = F.layer_norm(x.double(), (x.shape[-1],), eps=eps)
    return y * (1 + scale.double()[rows]) + shift.double()[rows]


def _fwd(x, scale, shift, cu):
    total, d = x.shape
    poison(((total, d), x.dtype), ((total,), torch.float32), ((total,), torch.float32))
    return torch.ops.adaptiveload.ln_modulate_seg_fwd(x, scale, shift, cu, lm.EPS)


def _grads(x, scale, shift, cu, dy):
    leaves = [t.detach().requires_grad_() for t in (x, scale, shift)]
    y = lm.ln_modulate_segments(*leaves, cu)
    poison((tuple(x.shape), x.dtype), (tuple(scale.shape), scale.dtype))
    return torch.autograd.grad(y, leaves, dy)


def _ref_grads(x, scale, shift, cu, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, scale, shift)]
    return torch.autograd.grad(_fp64(*leaves, cu), leaves, dy.double())


def _check_fwd_bwd(x, scale, shift, cu):
    """Forward (y, mean, rstd) and backward (dx, dscale, dshift) against fp64."""
    y, mean, rstd = _fwd(x, scale, shift, cu)
    assert y.dtype == x.dtype and y.shape == x.shape and not y.isnan().any()
    assert rel(y, _fp64(x, scale, shift, cu)) <= TOL[x.dtype]
    if x.shape[0]:
        xd = x.double()
        assert rel(mean, xd.mean(-1)) <= 1e-5
        assert rel(rstd, (xd.var(-1, unbiased=False) + lm.EPS).rsqrt()) <= 1e-5
    dy = torch.randn(x.shape, device="cuda").to(x.dtype)
    got = _grads(x, scale, shift, cu, dy)
    for name, g, w, t in zip(("dx", "dscale", "dshift"), got, _ref_grads(x, scale, shift, cu, dy),
                             (x, scale, shift), strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype and not g.isnan().any(), name
        assert rel(g, w) <= TOL[t.dtype], (name, rel(g, w))


@parametrize("dtype", DTYPES)
@parametrize("mod_fp32", [True, False])
@parametrize("d", WIDTHS)
def test_mixed_pack_vs_fp64_at_every_width(d, mod_fp32, dtype):
    fresh_seed()
    _check_fwd_bwd(*_inputs(MIXED, d, dtype, torch.float32 if mod_fp32 else dtype))


@parametrize("pack", PACK_NAMES)
@parametrize("d", [1536, 5120])
def test_packs_vs_fp64(d, pack):
    """Few and many segments, long and tiny ones: the chunking of the backward (one chunk per
    thread-row, chunks crossing no segment) and its finalize at both Wan widths."""
    fresh_seed()
    lengths = _packs()[pack]
    if pack == "g65535_rows" and d == 5120:
        lengths = lengths[:20000]  # the same extreme, in less memory and time
    _check_fwd_bwd(*_inputs(lengths, d, torch.bfloat16, torch.float32))
    torch.cuda.empty_cache()


@parametrize("dtype", [torch.bfloat16, torch.float32])
def test_homogeneous_pack_equals_the_dense_kernel(dtype):
    """B samples of length S as B segments: y and dx bit for bit the dense kernel's (the same
    row math), dscale/dshift its per-sample sums up to summation order."""
    fresh_seed()
    b, s, d = 4, 1029, 1536
    x, scale, shift, cu = _inputs((s,) * b, d, dtype, torch.float32)
    y_seg, _, _ = _fwd(x, scale, shift, cu)
    y_dense, _, _ = torch.ops.adaptiveload.ln_modulate_fwd(
        x.view(b, s, d), scale[:, None], shift[:, None], lm.EPS
    )
    assert torch.equal(y_seg, y_dense.view(b * s, d))
    dy = torch.randn(x.shape, device="cuda").to(dtype)
    seg = _grads(x, scale, shift, cu, dy)
    dense_inputs = (x.view(b, s, d), scale[:, None], shift[:, None])
    leaves = [t.detach().requires_grad_() for t in dense_inputs]
    dense = torch.autograd.grad(lm.ln_modulate(*leaves), leaves, dy.view(b, s, d))
    assert torch.equal(seg[0], dense[0].view(b * s, d))
    for g, w in zip(seg[1:], dense[1:], strict=True):
        assert rel(g, w[:, 0]) <= 1e-6


@parametrize("dtype", DTYPES)
def test_backward_without_pipeline(dtype):
    """ADAPTIVELOAD_LN_BWD_PIPELINE=0 selects the unpipelined segment backward: same numerics."""
    fresh_seed()
    previous = os.environ.get(PIPELINE_ENV)
    os.environ[PIPELINE_ENV] = "0"
    try:
        for d in (1536, 5120, 264, 8192):
            _check_fwd_bwd(*_inputs(MIXED, d, dtype, torch.float32))
    finally:
        if previous is None:
            os.environ.pop(PIPELINE_ENV)
        else:
            os.environ[PIPELINE_ENV] = previous


def test_wan_modulation_rows_read_in_place():
    """A packed Wan block hands over scale/shift as rows of a [G, 6, D] fp32 tensor (row stride
    6 D): strided views, read without a copy."""
    fresh_seed()
    x, _, _, cu = _inputs(MIXED, 1536, torch.bfloat16, torch.float32)
    e = 0.5 * torch.randn(len(MIXED), 6, 1536, device="cuda")
    shift, scale = e[:, 0], e[:, 1]
    assert not scale.is_contiguous()
    _check_fwd_bwd(x, scale, shift, cu)


def test_unaligned_and_non_unit_stride_inputs_are_copied_not_misread():
    fresh_seed()
    cu = _offsets((5, 0, 9))
    x = torch.randn(14, 264, 2, device="cuda")[..., 0]  # last-dim stride 2
    scale = torch.randn(3, 265, device="cuda")[:, 1:]  # rows 4 bytes past a 16-byte boundary
    shift = torch.randn(3, 264, device="cuda")
    _check_fwd_bwd(x, scale, shift, cu)


def test_nan_stays_in_its_row_and_segment():
    fresh_seed()
    x, scale, shift, cu = _inputs((3, 4, 5), 1536, torch.bfloat16, torch.float32)
    x[5, 2] = float("nan")
    scale[2, 7] = float("nan")
    y, _, _ = _fwd(x, scale, shift, cu)
    assert y[5].isnan().all() and y[7:, 7].isnan().all()
    assert not y[:5].isnan().any() and not y[6, :7].isnan().any()


def test_backward_is_bitwise_deterministic():
    """Per-segment sums in a fixed order, no atomics: two runs agree bit for bit."""
    fresh_seed()
    x, scale, shift, cu = _inputs(_uneven(40000, 24), 5120, torch.bfloat16, torch.float32)
    dy = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
    first = _grads(x, scale, shift, cu, dy)
    second = _grads(x, scale, shift, cu, dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_empty_stream_gives_zero_modulation_gradients():
    x, scale, shift, cu = _inputs((0, 0, 0), 64, torch.bfloat16, torch.float32)
    y, mean, rstd = _fwd(x, scale, shift, cu)
    assert y.shape == (0, 64) and mean.shape == (0,)
    dx, dscale, dshift = torch.ops.adaptiveload.ln_modulate_seg_bwd(y, x, scale, cu, mean, rstd)
    assert dx.shape == x.shape and not dscale.any() and not dshift.any()


BAD_OFFSETS_SCRIPT = """
import sys, torch
from adaptiveload.ops import ln_modulate as lm
x = torch.randn(10, 64, device="cuda").bfloat16()
s = torch.randn(3, 64, device="cuda")
cu = torch.tensor([int(v) for v in sys.argv[2].split(",")], dtype=torch.int32, device="cuda")
if sys.argv[1] == "fwd":
    y = lm.ln_modulate_segments(x, s, s, cu)
else:
    mean, rstd = torch.zeros(10, device="cuda"), torch.ones(10, device="cuda")
    y = torch.ops.adaptiveload.ln_modulate_seg_bwd(x, x, s, cu, mean, rstd)[1]
torch.cuda.synchronize()
print("no error:", y.float().sum().item())
"""


@parametrize("case", [("fwd", "0,5,3,10"), ("fwd", "0,4,6,9"), ("bwd", "2,4,6,10"),
                      ("bwd", "0,6,4,10")])
def test_bad_offsets_stop_the_kernels_with_a_device_assert(case):
    """Offsets the validator cannot read without a sync (on the device) break the rules: the
    kernels stop with a device-side assert naming cu_seqlens instead of returning numbers.
    In a child process: the assert ends the CUDA context."""
    op, values = case
    out = subprocess.run([sys.executable, "-c", BAD_OFFSETS_SCRIPT, op, values],
                         capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode != 0 and "no error" not in out.stdout, out.stdout
    assert "cu_seqlens" in out.stderr or "device-side assert" in out.stderr, out.stderr[-3000:]


def test_torch_compile_fullgraph_dynamic_l():
    """Inductor on CUDA through the segment op with a dynamic L: one graph for packs of
    different lengths, gradients equal to eager's."""
    fresh_seed()
    torch._dynamo.reset()

    def block(x, scale, shift, cu):
        return (lm.ln_modulate_segments(x, scale, shift, cu).float() * 2).square().mean()

    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    for lengths in [(65, 0, 300), (1029, 7, 2)]:
        x, scale, shift, cu = _inputs(lengths, 1536, torch.bfloat16, torch.float32)
        leaves = [t.requires_grad_() for t in (x, scale, shift)]
        got = torch.autograd.grad(compiled(*leaves, cu), leaves)
        want = torch.autograd.grad(block(*leaves, cu), leaves)
        for g, w, leaf in zip(got, want, leaves, strict=True):
            assert g.shape == leaf.shape
            torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-6)


def test_fused_op_keeps_less_memory_than_the_eager_gather():
    """The memory argument: fwd+bwd peak of the eager sequence with per-token modulation rows
    exceeds the fused op's by at least the two [L, D] fp32 gathers (measured, printed)."""
    fresh_seed()
    x, scale, shift, cu = _inputs(_uneven(32768, 8), 1536, torch.bfloat16, torch.float32)
    peaks = {}
    for name, fn in (("fused", lm.ln_modulate_segments), ("eager", lm.wan_eager_segments)):
        leaves = [t.detach().requires_grad_() for t in (x, scale, shift)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        y = fn(*leaves, cu)
        torch.autograd.grad(y, leaves, torch.ones_like(y))
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        del y, leaves
    print(f"peak above inputs, L = 32768, D = 1536: {peaks}")
    assert peaks["eager"] - peaks["fused"] >= 2 * 4 * x.numel()


def test_the_segment_kernels_are_the_ones_running():
    """A CUDA call reaches the segment kernels (check, forward, backward, finalize), not the
    reference math (registered for CPU)."""
    assert lm.fused_available(), lm.fused_unavailable_reason()
    for op in (lm.SEG_FWD_OP, lm.SEG_BWD_OP):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")
    x, scale, shift, cu = _inputs(MIXED, 1536, torch.bfloat16, torch.float32)
    leaves = [t.requires_grad_() for t in (x, scale, shift)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = lm.ln_modulate_segments(*leaves, cu)
        torch.autograd.grad(y, leaves, torch.ones_like(y))
        torch.cuda.synchronize()
    names = " ".join(e.name for e in prof.events())
    for kernel in ("ln_mod_check_offsets", "ln_mod_fwd_kernel", "ln_mod_bwd_kernel",
                   "ln_mod_bwd_seg_finalize"):
        assert kernel in names, (kernel, names[:2000])


if __name__ == "__main__":
    sys.exit(run_as_script(globals()))
