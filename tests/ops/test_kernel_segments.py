"""The segment layout of the ln_modulate op on CPU (the reference kernels): a packed token
stream x [L, D] of G samples, one modulation row per segment ([G, D]) and int32 offsets
cu_seqlens [G + 1]. Numerics against an fp64 oracle that runs each segment alone, agreement
with the dense op on a homogeneous pack, autograd, gradcheck in fp64, torch.library opcheck,
torch.compile(fullgraph=True) with a dynamic L, validation of shapes and of offset values,
and the memory the op saves against the eager gather. These run whether or not the CUDA
library is built (it only adds CUDA kernels)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from segment_packs import gradcheck_fp64, pack

from adaptiveload.ops import ln_modulate as lm

torch.set_num_threads(1)

# segment lengths of packs: images (1 frame) and clips of several lengths, empty segments at
# the start, middle and end, a single segment, one-row segments
PACKS = [(5, 12, 3), (0, 4, 0, 9, 1), (7,), (1, 1, 1, 1), (6, 0)]


def _fp64_each_segment_alone(x, scale, shift, cu, eps=lm.EPS):
    """The oracle: every segment through the dense formula on its own, concatenated."""
    d = x.shape[-1]
    bounds = cu.tolist()
    parts = [
        F.layer_norm(x[a:b].double(), (d,), eps=eps) * (1 + scale[g].double()) + shift[g].double()
        for g, (a, b) in enumerate(itertools.pairwise(bounds))
    ]
    return torch.cat([x[:0].double(), *parts])


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("lengths", PACKS)
@pytest.mark.parametrize(
    ("dtype", "mod_dtype", "tol"),
    [(torch.float32, torch.float32, 1e-6), (torch.bfloat16, torch.float32, 1e-2),
     (torch.bfloat16, torch.bfloat16, 1e-2)],
)
def test_forward_matches_each_segment_alone_in_fp64(lengths, dtype, mod_dtype, tol):
    x, scale, shift, cu = pack(lengths, 40, dtype, mod_dtype)
    y = lm.ln_modulate_segments(x, scale, shift, cu)
    assert y.dtype == dtype and y.shape == x.shape
    assert _rel(y, _fp64_each_segment_alone(x, scale, shift, cu)) <= tol
    torch.testing.assert_close(y, lm.reference_segments(x, scale, shift, cu))


@pytest.mark.parametrize("lengths", PACKS)
def test_backward_matches_fp64_autograd_of_each_segment_alone(lengths):
    """dscale/dshift [G, D] are per-segment sums (zero for an empty segment)."""
    x, scale, shift, cu = pack(lengths, 24, seed=1)
    leaves = [t.clone().requires_grad_() for t in (x, scale, shift)]
    ref = [t.double().detach().requires_grad_() for t in (x, scale, shift)]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    torch.autograd.backward(lm.ln_modulate_segments(*leaves, cu), dy)
    torch.autograd.backward(_fp64_each_segment_alone(*ref, cu), dy.double())
    for got, want in zip(leaves, ref, strict=True):
        assert got.grad.shape == want.shape and got.grad.dtype == got.dtype
        assert _rel(got.grad, want.grad) <= 1e-5
    empty = [g for g, n in enumerate(lengths) if n == 0]
    assert not leaves[1].grad[empty].any() and not leaves[2].grad[empty].any()


def test_homogeneous_pack_equals_the_dense_op():
    """B samples of one length S as B segments: outputs and gradients of the dense op with
    [B, 1, D] modulation."""
    b, s, d = 3, 7, 32
    x, scale, shift, cu = pack((s,) * b, d, seed=3)
    dense = [x.reshape(b, s, d), scale[:, None], shift[:, None]]
    seg_leaves = [t.clone().requires_grad_() for t in (x, scale, shift)]
    dense_leaves = [t.clone().requires_grad_() for t in dense]
    y_seg = lm.ln_modulate_segments(*seg_leaves, cu)
    y_dense = lm.ln_modulate(*dense_leaves)
    torch.testing.assert_close(y_seg, y_dense.reshape(b * s, d), rtol=0, atol=0)
    dy = torch.randn(b, s, d, generator=torch.Generator().manual_seed(4))
    torch.autograd.backward(y_seg, dy.reshape(b * s, d))
    torch.autograd.backward(y_dense, dy)
    for seg, den in zip(seg_leaves, dense_leaves, strict=True):
        torch.testing.assert_close(seg.grad, den.grad.reshape(seg.shape))


@pytest.mark.parametrize("lengths", [(2, 0, 3)])  # one long segment: tests/slow/ops/
def test_gradcheck_fp64(lengths):
    assert gradcheck_fp64(lengths)


@pytest.mark.parametrize("lengths", [(3, 0, 4), (5,)])
def test_opcheck(lengths):
    x, scale, shift, cu = pack(lengths, 16, seed=7)
    args = (x.requires_grad_(), scale.requires_grad_(), shift.requires_grad_(), cu, 1e-6)
    torch.library.opcheck(torch.ops.adaptiveload.ln_modulate_seg_fwd.default, args)
    _, mean, rstd = torch.ops.adaptiveload.ln_modulate_seg_fwd(*args)
    bwd_args = (torch.randn_like(x), x.detach(), scale.detach(), cu, mean.detach(), rstd.detach())
    torch.library.opcheck(torch.ops.adaptiveload.ln_modulate_seg_bwd.default, bwd_args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_dynamic_l_one_graph(backend):
    """One compiled graph serves packs of different total length L (same G): gradients in the
    leaves' shapes, equal to eager's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)

    def block(x, scale, shift, cu):
        return lm.ln_modulate_segments(x, scale, shift, cu).float().square().mean()

    compiled = torch.compile(block, fullgraph=True, backend=counter, dynamic=True)
    frames = []
    for lengths in [(5, 9, 2), (11, 0, 20), (1, 30, 7)]:
        x, scale, shift, cu = pack(lengths, 64, torch.bfloat16, seed=sum(lengths))
        leaves = [t.requires_grad_() for t in (x, scale, shift)]
        got = torch.autograd.grad(compiled(*leaves, cu), leaves)
        want = torch.autograd.grad(block(*leaves, cu), leaves)
        for g, w, leaf in zip(got, want, leaves, strict=True):
            assert g.shape == leaf.shape and g.dtype == leaf.dtype
            torch.testing.assert_close(g, w, rtol=2e-2, atol=1e-5)
        frames.append(counter.frame_count)
    assert frames[0] == frames[-1]  # no recompilation for a new L


def test_wan_eager_segments_is_wan_eager_per_segment():
    """The eager baseline: each segment through Wan's dense sequence with its own row."""
    x, scale, shift, cu = pack((4, 0, 6), 32, torch.bfloat16, seed=8)
    y = lm.wan_eager_segments(x, scale, shift, cu)
    bounds = cu.tolist()
    pairs = enumerate(itertools.pairwise(bounds))
    want = torch.cat([lm.wan_eager(x[a:b], scale[g], shift[g]) for g, (a, b) in pairs])
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert _rel(lm.ln_modulate_segments(x, scale, shift, cu), y) <= 1e-2


def test_empty_stream_and_no_segments():
    for lengths in [(0, 0), ()]:
        x, scale, shift, cu = pack(lengths, 16)
        leaves = [t.requires_grad_() for t in (x, scale, shift)]
        y = lm.ln_modulate_segments(*leaves, cu)
        assert y.shape == (0, 16)
        grads = torch.autograd.grad(y.sum(), leaves)
        assert [g.shape for g in grads] == [t.shape for t in leaves]
        assert not grads[1].any() and not grads[2].any()


def test_nan_in_one_segment_stays_in_its_row():
    x, scale, shift, cu = pack((3, 4), 16)
    x[5, 2] = float("nan")
    y = lm.ln_modulate_segments(x, scale, shift, cu)
    assert y[5].isnan().all() and not y[:5].isnan().any() and not y[6:].isnan().any()


def _saved_bytes(fn, *args) -> int:
    """Bytes of the unique storages autograd keeps for backward."""
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def test_saved_memory_has_no_per_token_modulation():
    """The memory argument (docs/kernel.md): the segment op keeps x, the [G, D] rows, the offsets
    and 8 bytes of fp32 statistics per token; the eager gather keeps [L, D] fp32 copies of the
    modulation on top (what a per-token gather costs in every block)."""
    lengths, d = (40, 0, 25, 63), 64
    x, scale, shift, cu = pack(lengths, d, torch.bfloat16)
    leaves = [t.requires_grad_() for t in (x, scale, shift)]
    n = x.shape[0]
    fused = _saved_bytes(lm.ln_modulate_segments, *leaves, cu)
    assert fused == 2 * n * d + 4 * len(lengths) * d + 4 * (len(lengths) + 1) + 8 * n
    eager = _saved_bytes(lm.wan_eager_segments, *leaves, cu)
    assert eager - fused >= 4 * n * d  # at least one [L, D] fp32 copy of a modulation row


# --- validation: the dense op's rules for x and the modulation, plus the offsets ------------


def _t(*shape, dtype=torch.float32, device="cpu"):
    return torch.empty(shape, dtype=dtype, device=device)


def _cu(*values, dtype=torch.int32, device="cpu"):
    return torch.tensor(values, dtype=dtype, device=device)


BAD_SEGMENT_INPUTS = [  # (x, scale, shift, cu_seqlens, error type, message)
    (_t(2, 3, 16), _t(2, 16), _t(2, 16), _cu(0, 3, 6), ValueError, r"x must be \[L, D\]"),
    (_t(6, 12), _t(2, 12), _t(2, 12), _cu(0, 3, 6), ValueError, r"D = 12 unsupported"),
    (_t(6, 16, dtype=torch.int32), _t(2, 16), _t(2, 16), _cu(0, 3, 6), ValueError,
     "dtype int32"),
    (_t(6, 16), _t(2, 1, 16), _t(2, 1, 16), _cu(0, 3, 6), ValueError,
     r"scale must be \[G, D\] for x \(6, 16\)"),
    (_t(6, 16), _t(2, 8), _t(2, 8), _cu(0, 3, 6), ValueError, r"scale must be \[G, D\]"),
    (_t(6, 16), _t(2, 16), _t(3, 16), _cu(0, 3, 6), ValueError, "shift must be"),
    (_t(6, 16), _t(2, 16), _t(2, 16, dtype=torch.float16), _cu(0, 3, 6), ValueError,
     "same shape and dtype"),
    (_t(6, 16, dtype=torch.bfloat16), _t(2, 16, dtype=torch.float16),
     _t(2, 16, dtype=torch.float16), _cu(0, 3, 6), ValueError, "must be float32 or x's dtype"),
    (_t(6, 16), _t(2, 16), _t(2, 16), _cu(0, 3, 6, dtype=torch.int64), ValueError,
     r"cu_seqlens must be int32 \[G \+ 1\] = \[3\].*got int64.*cu_seqlens\.int\(\)"),
    (_t(6, 16), _t(2, 16), _t(2, 16), _cu(0, 6), ValueError, r"got int32 \(2,\)"),
    (_t(6, 16), _t(2, 16), _t(2, 16), _cu(0, 3, 6).reshape(1, 3), ValueError,
     r"cu_seqlens must be int32"),
    (_t(6, 16), _t(2, 16), _t(2, 16), _cu(0, 3, 6, device="meta"), ValueError,
     "cu_seqlens is on meta, x on cpu"),
    (_t(6, 16), _t(2, 16, device="meta"), _t(2, 16, device="meta"), _cu(0, 3, 6), ValueError,
     "scale is on meta"),
    (_t(6, 16), _t(2, 16), _t(2, 16), [0, 3, 6], TypeError, "cu_seqlens must be a torch.Tensor"),
    (_t(6, 16), _t(0, 16), _t(0, 16), _cu(0), ValueError, r"L = 6 rows but .* no segment"),
    (_t(6, 16, device="meta"), _t(65536, 16, device="meta"), _t(65536, 16, device="meta"),
     _t(65537, dtype=torch.int32, device="meta"), ValueError, "G = 65536 segments; .* 65535"),
    (_t(2**31, 8, device="meta"), _t(1, 8, device="meta"), _t(1, 8, device="meta"),
     _cu(0, 1, device="meta"), ValueError, r"int32 offsets address < 2\*\*31"),
]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize(("x", "scale", "shift", "cu", "exc", "match"), BAD_SEGMENT_INPUTS)
def test_validator_rejects_bad_inputs_with_the_same_rules_on_every_device(
    x, scale, shift, cu, exc, match, device_type
):
    with pytest.raises(exc, match=match):
        lm.check_segment_inputs(x, scale, shift, cu, device_type=device_type)


@pytest.mark.parametrize(("x", "scale", "shift", "cu", "exc", "match"), BAD_SEGMENT_INPUTS)
def test_public_op_rejects_bad_inputs_before_any_kernel(x, scale, shift, cu, exc, match):
    with pytest.raises(exc, match=match):
        lm.ln_modulate_segments(x, scale, shift, cu)


@pytest.mark.parametrize(
    ("values", "match"),
    [((1, 3, 6), r"cu_seqlens\[0\] = 1; the offsets must start at 0"),
     ((0, 3, 5), r"cu_seqlens\[-1\] = 5, but x has L = 6 rows"),
     ((0, 4, 3, 6), r"decreases at index 2 \(4 -> 3\)")],
)
def test_bad_offset_values_raise_in_the_cpu_kernels(values, match):
    g = len(values) - 1
    x, scale, cu = torch.randn(6, 16), torch.randn(g, 16), _cu(*values)
    with pytest.raises(ValueError, match=match):
        lm.ln_modulate_segments(x, scale, scale, cu)
    _, mean, rstd = torch.ops.adaptiveload.ln_modulate_fwd(x[None], scale[:1, None],
                                                           scale[:1, None], lm.EPS)
    with pytest.raises(ValueError, match=match):
        torch.ops.adaptiveload.ln_modulate_seg_bwd(x, x, scale, cu, mean[0], rstd[0])


def test_backward_validator():
    x, s, cu = torch.randn(6, 16), torch.randn(2, 16), _cu(0, 2, 6)
    y, mean, rstd = torch.ops.adaptiveload.ln_modulate_seg_fwd(x, s, s, cu, lm.EPS)
    bwd = torch.ops.adaptiveload.ln_modulate_seg_bwd
    with pytest.raises(ValueError, match="ln_modulate_seg_bwd: dy must match x"):
        bwd(y[:5], x, s, cu, mean, rstd)
    with pytest.raises(ValueError, match=r"mean must be float32 \(6,\)"):
        bwd(y, x, s, cu, mean[:5], rstd)
    with pytest.raises(ValueError, match="rstd must be float32"):
        bwd(y, x, s, cu, mean, rstd.double())
    with pytest.raises(ValueError, match="cu_seqlens must be int32"):
        bwd(y, x, s, cu.long(), mean, rstd)


def test_float64_is_for_the_cpu_oracle_only():
    x, s, cu = _t(6, 16, dtype=torch.float64), _t(2, 16, dtype=torch.float64), _cu(0, 3, 6)
    lm.check_segment_inputs(x, s, s, cu)
    with pytest.raises(ValueError, match="float32, float16, bfloat16 on cuda"):
        lm.check_segment_inputs(x, s, s, cu, device_type="cuda")


@pytest.mark.parametrize("d", [1152, 1536, 2048, 3072, 4096, 5120, 8, 8192])
def test_validator_accepts_every_supported_width_on_cuda_shapes(d):
    """Meta tensors describe a packed Wan micro-batch (L = 75,600 tokens, 64 segments)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _t(75600, d, dtype=dtype, device="meta")
        for mod in {torch.float32, dtype}:
            scale = _t(64, d, dtype=mod, device="meta")
            cu = _t(65, dtype=torch.int32, device="meta")
            lm.check_segment_inputs(x, scale, scale, cu, device_type="cuda")
