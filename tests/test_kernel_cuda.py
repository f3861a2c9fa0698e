"""The fused CUDA kernels against an fp64 reference, on a GPU (skipped without one).

Every case draws fresh random inputs (seeded from the clock, printed on failure), poisons the
allocator's free blocks with NaN before each launch (so an output element the kernel forgot
to write shows up as NaN), and compares by relative norm error: bf16/fp16 I/O <= 1e-2,
fp32 <= 1e-5. Covers odd B and S, both modulation layouts, both modulation dtypes, Wan's
strided chunk views, inputs the kernel must copy first (misaligned / non-unit last stride),
NaN propagation, rejected inputs, bitwise-deterministic backward, and torch.compile.

Runs under pytest or, where pytest is missing (the GPU machine), as a script:
    python tests/test_kernel_cuda.py
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from adaptiveload.ops import ln_modulate as lm

try:
    import pytest
except ImportError:  # the GPU machine may lack pytest: see _main()
    pytest = None


def parametrize(names: str, values: list) -> Callable:
    """pytest.mark.parametrize that also records the cases for script mode (_main)."""

    def deco(fn: Callable) -> Callable:
        fn.cases = [(names, values), *getattr(fn, "cases", [])]
        return pytest.mark.parametrize(names, values)(fn) if pytest else fn

    return deco


SKIP_REASON = (
    "no CUDA device visible" if not torch.cuda.is_available() else lm.fused_unavailable_reason()
)
if pytest is not None:
    pytestmark = [pytest.mark.cuda, pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON)]

PIPELINE_ENV = "ADAPTIVELOAD_LN_BWD_PIPELINE"
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
SHAPES = [(3, 37, 1536), (1, 129, 5120), (5, 3, 8), (2, 17, 264), (3, 11, 4096), (1, 5, 16384)]
LAYOUTS = ["sample", "token"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _seed() -> int:
    seed = time.time_ns() % 2**31
    torch.manual_seed(seed)
    print(f"seed {seed}")  # shown by pytest on failure
    return seed


def _inputs(b, s, d, layout, dtype, mod_dtype, device="cuda"):
    x = (torch.randn(b, s, d, device=device) * 3 + 1).to(dtype)
    ms = 1 if layout == "sample" else s
    scale = (0.5 * torch.randn(b, ms, d, device=device)).to(mod_dtype)
    shift = (0.5 * torch.randn(b, ms, d, device=device)).to(mod_dtype)
    return x, scale, shift


def _fp64(x, scale, shift, eps=lm.EPS):
    return F.layer_norm(x.double(), (x.shape[-1],), eps=eps) * (1 + scale.double()) + shift.double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _poison(*like: tuple[tuple[int, ...], torch.dtype]) -> None:
    """Fill then free blocks of the outputs' sizes: the caching allocator hands them out next."""
    blocks = [torch.full(shape, float("nan"), dtype=dt, device="cuda") for shape, dt in like]
    torch.cuda.synchronize()
    del blocks


def _fwd(x, scale, shift):
    b, s, d = x.shape
    _poison(((b, s, d), x.dtype), ((b, s), torch.float32), ((b, s), torch.float32))
    return torch.ops.adaptiveload.ln_modulate_fwd(x, scale, shift, lm.EPS)


def _grads(x, scale, shift, dy):
    leaves = [t.detach().requires_grad_() for t in (x, scale, shift)]
    y = lm.ln_modulate(*leaves)
    _poison((tuple(x.shape), x.dtype), (tuple(scale.shape), scale.dtype))
    return torch.autograd.grad(y, leaves, dy)


def _ref_grads(x, scale, shift, dy):
    leaves = [t.detach().double().requires_grad_() for t in (x, scale, shift)]
    return torch.autograd.grad(_fp64(*leaves), leaves, dy.double())


@contextlib.contextmanager
def _raises(exc: type[BaseException], match: str) -> Iterator[None]:
    try:
        yield
    except exc as err:
        assert re.search(match, str(err)), f"{err!r} does not match {match!r}"
    else:
        raise AssertionError(f"{exc.__name__} not raised")


@parametrize("layout", LAYOUTS)
@parametrize("dtype", DTYPES)
@parametrize("mod_fp32", [True, False])
@parametrize("shape", SHAPES)
def test_forward_vs_fp64(shape, mod_fp32, dtype, layout):
    _seed()
    mod_dtype = torch.float32 if mod_fp32 else dtype
    x, scale, shift = _inputs(*shape, layout, dtype, mod_dtype)
    y, mean, rstd = _fwd(x, scale, shift)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    assert not y.isnan().any() and not mean.isnan().any() and not rstd.isnan().any()
    assert _rel(y, _fp64(x, scale, shift)) <= TOL[dtype]
    xd = x.double()
    assert _rel(mean, xd.mean(-1)) <= 1e-5
    assert _rel(rstd, (xd.var(-1, unbiased=False) + lm.EPS).rsqrt()) <= 1e-5


@parametrize("layout", LAYOUTS)
@parametrize("dtype", DTYPES)
@parametrize("mod_fp32", [True, False])
@parametrize("shape", SHAPES)
def test_backward_vs_fp64(shape, mod_fp32, dtype, layout):
    _seed()
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
        assert _rel(g, w) <= tol, (name, _rel(g, w))


@parametrize("layout", LAYOUTS)
@parametrize("dtype", DTYPES)
def test_backward_without_pipeline(dtype, layout):
    """ADAPTIVELOAD_LN_BWD_PIPELINE=0 selects the unpipelined backward kernel: same numerics."""
    _seed()
    previous = os.environ.get(PIPELINE_ENV)
    os.environ[PIPELINE_ENV] = "0"
    try:
        for shape in [(3, 37, 1536), (1, 1029, 5120), (2, 17, 264)]:
            x, scale, shift = _inputs(*shape, layout, dtype, torch.float32)
            dy = torch.randn(x.shape, device="cuda").to(dtype)
            got = _grads(x, scale, shift, dy)
            for g, w in zip(got, _ref_grads(x, scale, shift, dy), strict=True):
                assert not g.isnan().any() and _rel(g, w) <= TOL[g.dtype]
    finally:
        if previous is None:
            os.environ.pop(PIPELINE_ENV)
        else:
            os.environ[PIPELINE_ENV] = previous


@parametrize("layout", LAYOUTS)
def test_long_sequences_many_ctas_per_sample(layout):
    """Wan 14B's longest shape (persistent CTAs, many partials) and several samples."""
    _seed()
    for b, s, d in [(1, 75600, 5120), (3, 20011, 1536)]:
        x, scale, shift = _inputs(b, s, d, layout, torch.bfloat16, torch.float32)
        dy = torch.randn(x.shape, device="cuda").to(torch.bfloat16)
        y, _, _ = _fwd(x, scale, shift)
        assert _rel(y, _fp64(x, scale, shift)) <= 1e-2
        for g, w in zip(_grads(x, scale, shift, dy), _ref_grads(x, scale, shift, dy), strict=True):
            assert _rel(g, w) <= 1e-2
        del x, scale, shift, dy, y
        torch.cuda.empty_cache()


@parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wan_chunk_views_read_in_place(dtype):
    """Wan hands over scale/shift as chunks of an fp32 [B, 6, D] (per sample) or [B, S, 6, D]
    (per token) tensor: strided views, read without a copy."""
    _seed()
    b, s, d = 3, 33, 1536
    x = torch.randn(b, s, d, device="cuda").to(dtype)
    per_sample = torch.randn(b, 6, d, device="cuda").chunk(6, dim=1)
    per_token = [t.squeeze(2) for t in torch.randn(b, s, 6, d, device="cuda").chunk(6, dim=2)]
    dy = torch.randn(b, s, d, device="cuda").to(dtype)
    for e in (per_sample, per_token):
        shift, scale = e[0], e[1]
        assert not scale.is_contiguous()
        y, _, _ = _fwd(x, scale, shift)
        assert _rel(y, _fp64(x, scale, shift)) <= TOL[dtype]
        for g, w in zip(_grads(x, scale, shift, dy), _ref_grads(x, scale, shift, dy), strict=True):
            assert _rel(g, w) <= TOL[dtype]


def test_unaligned_and_non_unit_stride_inputs_are_copied_not_misread():
    _seed()
    b, s, d = 2, 9, 264
    x = torch.randn(b, s, d, 2, device="cuda")[..., 0]  # last-dim stride 2
    wide = torch.randn(b, 1, d + 1, device="cuda")
    scale = wide[..., 1:]  # base pointer 4 bytes past a 16-byte boundary
    shift = torch.randn(b, 1, d, device="cuda")
    y, _, _ = _fwd(x, scale, shift)
    assert _rel(y, _fp64(x, scale, shift)) <= 1e-5
    dy = torch.randn(b, s, d, device="cuda")
    for g, w in zip(_grads(x, scale, shift, dy), _ref_grads(x, scale, shift, dy), strict=True):
        assert _rel(g, w) <= 1e-5


def test_nan_in_nan_out_like_reference():
    _seed()
    x, scale, shift = _inputs(3, 7, 1536, "sample", torch.bfloat16, torch.float32)
    x[1, 2, 5] = float("nan")
    scale[2, 0, 7] = float("nan")
    y, _, _ = _fwd(x, scale, shift)
    want = lm.reference(x.cpu(), scale.cpu(), shift.cpu())
    assert torch.equal(y.isnan().cpu(), want.isnan())
    assert y[1, 2].isnan().all() and y[2, :, 7].isnan().all() and not y[0].isnan().any()


def test_backward_is_bitwise_deterministic():
    _seed()
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


def test_rejects_unsupported_inputs_clearly():
    x = torch.randn(2, 3, 16, device="cuda")
    s = torch.randn(2, 1, 16, device="cuda")
    with _raises(ValueError, "D = 12 unsupported"):
        lm.ln_modulate(x[..., :12], s[..., :12], s[..., :12])
    with _raises(ValueError, "D = 16392 unsupported"):
        big = torch.randn(1, 2, 16392, device="cuda")
        lm.ln_modulate(big, big[:, :1], big[:, :1])
    with _raises(ValueError, "float32, float16 or bfloat16"):
        lm.ln_modulate(x.double(), s.double(), s.double())
    with _raises(ValueError, "must be float32 or x's dtype"):
        lm.ln_modulate(x.bfloat16(), s.half(), s.half())


def test_torch_compile_fullgraph():
    _seed()
    x, scale, shift = _inputs(2, 65, 1536, "sample", torch.bfloat16, torch.float32)
    leaves = [t.requires_grad_() for t in (x, scale, shift)]

    def block(x, scale, shift):
        return (lm.ln_modulate(x, scale, shift).float() * 2).square().mean()

    compiled = torch.compile(block, fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    want = torch.autograd.grad(block(*leaves), leaves)
    for g, w in zip(got, want, strict=True):  # Inductor may reorder the fp32 pointwise math
        torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-6)


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


def _main() -> int:
    """Script mode: run every test_* with the cartesian product of its recorded cases."""
    if SKIP_REASON:
        print(f"SKIPPED: {SKIP_REASON}")
        return 0
    failures = total = 0
    for name, fn in list(globals().items()):
        if not name.startswith("test_") or not callable(fn):
            continue
        groups = getattr(fn, "cases", [])
        keys = [g[0] for g in groups]
        for combo in itertools.product(*(g[1] for g in groups)):
            total += 1
            label = f"{name}[{', '.join(f'{k}={v}' for k, v in zip(keys, combo, strict=True))}]"
            try:
                fn(**dict(zip(keys, combo, strict=True)))
                print(f"PASS {label}")
            except Exception:
                failures += 1
                print(f"FAIL {label}\n{traceback.format_exc()}")
    print(f"{total - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(_main())
