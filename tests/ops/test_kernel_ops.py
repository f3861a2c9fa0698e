"""The ln_modulate custom op on CPU (the reference kernels): numerics against fp64, autograd,
torch.library registration (opcheck), torch.compile tracing and input validation. These run
whether or not the CUDA library is built (it only adds CUDA kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from repo_paths import ROOT

from adaptiveload.ops import kernel_lib
from adaptiveload.ops import ln_modulate as lm

torch.set_num_threads(1)


def _inputs(b, s, d, layout, dtype=torch.float32, mod_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, s, d, generator=gen, dtype=torch.float64) * 2 + 0.5).to(dtype)
    ms = 1 if layout == "sample" else s
    scale = (0.3 * torch.randn(b, ms, d, generator=gen, dtype=torch.float64)).to(mod_dtype)
    shift = (0.3 * torch.randn(b, ms, d, generator=gen, dtype=torch.float64)).to(mod_dtype)
    return x, scale, shift


def _fp64(x, scale, shift, eps=lm.EPS):
    d = x.shape[-1]
    return F.layer_norm(x.double(), (d,), eps=eps) * (1 + scale.double()) + shift.double()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("layout", ["sample", "token"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_forward_matches_fp64(layout, dtype, tol):
    x, scale, shift = _inputs(3, 7, 40, layout, dtype)
    y = lm.ln_modulate(x, scale, shift)
    assert y.dtype == dtype and y.shape == x.shape
    assert _rel(y, _fp64(x, scale, shift)) <= tol


@pytest.mark.parametrize("layout", ["sample", "token"])
def test_backward_matches_fp64_autograd(layout):
    x, scale, shift = _inputs(3, 5, 24, layout)
    leaves = [t.clone().requires_grad_() for t in (x, scale, shift)]
    ref = [t.double().detach().requires_grad_() for t in (x, scale, shift)]
    dy = torch.randn(3, 5, 24)
    torch.autograd.backward(lm.ln_modulate(*leaves), dy)
    torch.autograd.backward(_fp64(*ref), dy.double())
    for got, want in zip(leaves, ref, strict=True):
        assert got.grad.shape == want.shape and got.grad.dtype == got.dtype
        assert _rel(got.grad, want.grad) <= 1e-5


@pytest.mark.parametrize("layout", ["sample", "token"])
def test_gradcheck_fp64(layout):
    x, scale, shift = (
        t.double().requires_grad_() for t in _inputs(2, 3, 16, layout, torch.float64)
    )
    assert torch.autograd.gradcheck(lm.ln_modulate, (x, scale, shift))


@pytest.mark.parametrize("layout", ["sample", "token"])
def test_opcheck(layout):
    x, scale, shift = _inputs(2, 3, 16, layout)
    args = (x.requires_grad_(), scale.requires_grad_(), shift.requires_grad_(), 1e-6)
    torch.library.opcheck(torch.ops.adaptiveload.ln_modulate_fwd.default, args)
    _, mean, rstd = torch.ops.adaptiveload.ln_modulate_fwd(*args)
    dy = torch.randn_like(x)
    bwd_args = (dy, x.detach(), scale.detach(), mean.detach(), rstd.detach())
    torch.library.opcheck(torch.ops.adaptiveload.ln_modulate_bwd.default, bwd_args)


def test_compile_fullgraph_traces_fake_and_autograd():
    x, scale, shift = (t.requires_grad_() for t in _inputs(2, 6, 32, "sample"))

    def block(x, scale, shift):
        return (lm.ln_modulate(x, scale, shift) * 2).sum()

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(x, scale, shift), (x, scale, shift))
    want = torch.autograd.grad(block(x, scale, shift), (x, scale, shift))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_strided_chunk_views_like_wan():
    b, s, d = 2, 5, 16
    x = torch.randn(b, s, d)
    e = torch.randn(b, 6, d)
    shift, scale = e[:, 0:1], e[:, 1:2]  # what Wan's .chunk(6, dim=1) hands over
    assert scale.stride(0) == 6 * d
    torch.testing.assert_close(lm.ln_modulate(x, scale, shift), lm.reference(x, scale, shift))


def test_nan_in_nan_out_like_reference():
    x, scale, shift = _inputs(2, 4, 16, "sample")
    x[1, 2, 3] = float("nan")
    y, want = lm.ln_modulate(x, scale, shift), lm.reference(x, scale, shift)
    assert torch.equal(y.isnan(), want.isnan())
    assert y[1, 2].isnan().all() and not y[0].isnan().any()


@pytest.mark.parametrize(
    ("x_shape", "scale_shape", "match"),
    [
        ((4, 16), (1, 16), "x must be"),
        ((2, 3, 16), (2, 2, 16), "scale must be"),
        ((2, 3, 16), (1, 1, 16), "scale must be"),
        ((2, 3, 16), (2, 1, 8), "scale must be"),
    ],
)
def test_bad_shapes_raise_value_error(x_shape, scale_shape, match):
    with pytest.raises(ValueError, match=match):
        lm.ln_modulate(torch.randn(x_shape), torch.randn(scale_shape), torch.randn(scale_shape))


def test_scale_shift_must_agree():
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="same shape and dtype"):
        lm.ln_modulate(x, torch.randn(2, 1, 16), torch.randn(2, 3, 16))
    with pytest.raises(ValueError, match="same shape and dtype"):
        lm.ln_modulate(x, torch.randn(2, 1, 16), torch.randn(2, 1, 16).bfloat16())


def test_fused_unavailable_without_gpu_says_why():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the CUDA tests cover this machine")
    assert not lm.fused_available()
    assert lm.fused_unavailable_reason()


def test_build_dir_is_the_env_vars_else_the_checkouts(monkeypatch, tmp_path):
    """One folder for the build and the loader: $ADAPTIVELOAD_BUILD_DIR, else build/kernels of
    this checkout (an installed package's user-cache default: tests/slow/repo/test_install.py)."""
    monkeypatch.delenv(kernel_lib.BUILD_DIR_ENV, raising=False)
    assert kernel_lib.default_build_dir() == ROOT / "build" / "kernels"
    monkeypatch.setenv(kernel_lib.BUILD_DIR_ENV, str(tmp_path))
    assert kernel_lib.library_path() == tmp_path / "adaptiveload_kernels.so"


# --- validation: one set of rules for every device, before any kernel ---------------------


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.empty(shape, dtype=dtype, device=device)


BAD_INPUTS = [  # (x, scale, shift, error type, message)
    (_t(2, 3, 12), _t(2, 1, 12), _t(2, 1, 12), ValueError, r"D = 12 unsupported.*\[8, 8192\]"),
    (_t(1, 2, 8200), _t(1, 1, 8200), _t(1, 1, 8200), ValueError, r"D = 8200 unsupported"),
    (_t(1, 2, 0), _t(1, 1, 0), _t(1, 1, 0), ValueError, r"D = 0 unsupported"),
    (_t(2, 3, 16, dtype=torch.int32), _t(2, 1, 16), _t(2, 1, 16), ValueError, "dtype int32"),
    (_t(2, 3, 16, dtype=torch.bfloat16), _t(2, 1, 16, dtype=torch.float16),
     _t(2, 1, 16, dtype=torch.float16), ValueError, "must be float32 or x's dtype bfloat16"),
    (_t(2, 3, 16), _t(2, 1, 16), _t(2, 3, 16), ValueError, "same shape and dtype"),
    (_t(2, 3, 16), _t(2, 1, 16), _t(2, 1, 16, dtype=torch.float16), ValueError, "same shape"),
    (_t(2, 3, 16), _t(1, 1, 16), _t(1, 1, 16), ValueError, r"scale must be \[B, 1, D\]"),
    (_t(2, 3, 16), _t(2, 2, 16), _t(2, 2, 16), ValueError, r"scale must be"),
    (_t(2, 3, 16), _t(2, 16), _t(2, 16), ValueError, r"scale must be"),
    (_t(48), _t(1, 1, 48), _t(1, 1, 48), ValueError, r"x must be \[B, S, D\]"),
    (_t(2, 3, 16), _t(2, 1, 16, device="meta"), _t(2, 1, 16, device="meta"), ValueError,
     "scale is on meta, x on cpu"),
    (_t(2, 3, 16), 0.5, _t(2, 1, 16), TypeError, "scale must be a torch.Tensor"),
]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize(("x", "scale", "shift", "exc", "match"), BAD_INPUTS)
def test_validator_rejects_bad_inputs_with_the_same_rules_on_every_device(
    x, scale, shift, exc, match, device_type
):
    with pytest.raises(exc, match=match):
        lm.check_inputs(x, scale, shift, device_type=device_type)


@pytest.mark.parametrize(("x", "scale", "shift", "exc", "match"), BAD_INPUTS)
def test_public_op_rejects_bad_inputs_before_any_kernel(x, scale, shift, exc, match):
    with pytest.raises(exc, match=match):
        lm.ln_modulate(x, scale, shift)


def test_float64_is_for_the_cpu_oracle_only():
    x, s = _t(2, 3, 16, dtype=torch.float64), _t(2, 1, 16, dtype=torch.float64)
    lm.check_inputs(x, s, s)  # gradcheck's dtype on CPU
    with pytest.raises(ValueError, match="float32, float16, bfloat16 on cuda"):
        lm.check_inputs(x, s, s, device_type="cuda")


@pytest.mark.parametrize("d", [1152, 1536, 2048, 3072, 4096, 5120, 8, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_validator_accepts_every_supported_width_on_cuda_shapes(d, dtype):
    """Meta tensors describe the CUDA shapes of a Wan step (S = 75,600) without memory."""
    x = _t(1, 75600, d, dtype=dtype, device="meta")
    for mod in {torch.float32, dtype}:
        for ms in (1, 75600):
            scale = _t(1, ms, d, dtype=mod, device="meta")
            lm.check_inputs(x, scale, scale, device_type="cuda")


def test_backward_validator():
    x, s = torch.randn(2, 3, 16), torch.randn(2, 1, 16)
    y, mean, rstd = torch.ops.adaptiveload.ln_modulate_fwd(x, s, s, lm.EPS)
    bwd = torch.ops.adaptiveload.ln_modulate_bwd
    with pytest.raises(ValueError, match="dy must match x"):
        bwd(y[:, :2], x, s, mean, rstd)
    with pytest.raises(ValueError, match="dy must match x"):
        bwd(y.bfloat16(), x, s, mean, rstd)
    with pytest.raises(ValueError, match=r"mean must be float32 \(2, 3\)"):
        bwd(y, x, s, mean[:, :2], rstd)
    with pytest.raises(ValueError, match="rstd must be float32"):
        bwd(y, x, s, mean, rstd.double())
    with pytest.raises(ValueError, match="D = 12 unsupported"):
        bwd(y[..., :12], x[..., :12], s[..., :12], mean, rstd)
    with pytest.raises(TypeError, match=r"mean must be a torch\.Tensor"):
        lm.check_backward_inputs(y, x, s, None, rstd)


@pytest.mark.parametrize(("b", "s"), [(0, 3), (2, 0)])
def test_empty_batch_or_sequence_gives_empty_outputs_and_zero_grads(b, s):
    x = torch.randn(b, s, 16, requires_grad=True)
    scale, shift = (torch.randn(b, 1, 16, requires_grad=True) for _ in range(2))
    y = lm.ln_modulate(x, scale, shift)
    assert y.shape == (b, s, 16)
    gx, gs, gt = torch.autograd.grad(y.sum(), (x, scale, shift), allow_unused=False)
    assert gx.shape == x.shape and gs.shape == scale.shape and gt.shape == shift.shape
    assert not gs.any() and not gt.any()


# --- broadcast modulation through autograd and torch.compile (the path CUDA runs) ----------


def _wan_chunk_leaves(b: int, s: int, d: int, dtype=torch.bfloat16):
    """x and Wan-style scale/shift: [B, 1, D] chunk views (row stride 6D) of a modulation."""
    gen = torch.Generator().manual_seed(b * 1000 + s)
    x = torch.randn(b, s, d, generator=gen).to(dtype).requires_grad_()
    e = 0.1 * torch.randn(b, 6, d, generator=gen)
    return x, e[:, 1:2].detach().requires_grad_(), e[:, 0:1].detach().requires_grad_()


@pytest.mark.parametrize("b", [1, 3])
def test_gradcheck_broadcast_chunk_views(b):
    x, scale, shift = _wan_chunk_leaves(b, 4, 16, torch.float64)
    scale, shift = (t.detach().double().requires_grad_() for t in (scale, shift))
    assert torch.autograd.gradcheck(lm.ln_modulate, (x, scale, shift))


def test_opcheck_single_sample_broadcast():
    x, scale, shift = _wan_chunk_leaves(1, 5, 16, torch.float32)
    torch.library.opcheck(torch.ops.adaptiveload.ln_modulate_fwd.default, (x, scale, shift, 1e-6))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("b", [1, 2])
def test_compile_fullgraph_broadcast_grads_keep_input_shapes(b, backend):
    """[1, 1, D] and [B, 1, D] modulation with a dynamic S: dscale/dshift come back in their
    leaves' shapes (on the first H200 run a compiled backward returned [D] for [1, 1, D])."""
    torch._dynamo.reset()

    def block(x, scale, shift):
        return lm.ln_modulate(x, scale, shift).float().square().mean()

    compiled = torch.compile(block, fullgraph=True, backend=backend)
    for s in (24, 40):
        leaves = _wan_chunk_leaves(b, s, 64)
        torch._dynamo.maybe_mark_dynamic(leaves[0], 1)
        got = torch.autograd.grad(compiled(*leaves), leaves)
        want = torch.autograd.grad(block(*leaves), leaves)
        for g, w, leaf in zip(got, want, leaves, strict=True):
            assert g.shape == leaf.shape and g.dtype == leaf.dtype
            torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-5)
