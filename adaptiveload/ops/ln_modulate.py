"""LayerNorm-Modulate: ``y = LayerNorm(x) * (1 + scale) + shift`` (no affine, eps 1e-6, fp32 stats).

Three implementations of one op, in two layouts:
- `wan_eager` / `wan_eager_segments`: Wan 2.1's exact eager op sequence (the unfused baseline of
  benchmarks and the model's `eager` switch);
- `reference` / `reference_segments`: fp32 math in plain PyTorch ops, the tests' oracle;
- `ln_modulate` / `ln_modulate_segments`: the custom ops `adaptiveload::ln_modulate_fwd` and
  `adaptiveload::ln_modulate_seg_fwd` with their own backward ops, autograd and fake kernels,
  so they work under torch.compile. On CUDA they run the fused kernels (`kernels/`, built by
  `adaptiveload kernel build`); on CPU, or when the library is not built, the same ops run
  fp32 reference math.

Dense layout: x is ``[B, S, D]``; scale and shift are ``[B, 1, D]`` (per sample, Wan 2.1) or
``[B, S, D]`` (per token). Segment layout (a packed micro-batch): x is the ``[L, D]`` token
stream of G samples, scale and shift are ``[G, D]`` (one row per segment) and int32
``cu_seqlens [G + 1]`` holds the offsets, ``0 = cu[0] <= ... <= cu[G] = L`` (empty segments
allowed); row r is modulated by the row of the segment holding it, which the kernels look up
themselves instead of reading a per-token copy. Modulation is float32 or x's dtype, scale and
shift with equal shapes and dtypes. The ops return y in x's dtype plus per-row fp32 mean/rstd,
which autograd saves instead of any normalised activation: the backward recomputes xhat from
x. The segment backward returns dscale/dshift ``[G, D]``, per-segment sums.

Validation: `check_inputs` / `check_segment_inputs` (and their backward forms) are the one set
of rules for every device, sharing the rules of x and of the modulation. They run in the
public functions before the op is called, in the CPU kernels and in the fake kernels (so
torch.compile rejects a bad input while tracing), and raise ValueError/TypeError naming the
problem before anything reaches a CUDA kernel. The offsets' values are data: `check_offsets`
reads them where that costs no device sync (the CPU kernels, the reference on CUDA), and the
CUDA kernels check the same rules on the device, stopping with a device-side assert rather
than returning a wrong result. The C++ binding repeats the shape rules defensively for direct
`torch.ops` calls. Strided views are accepted: the binding reads 16-byte-aligned rows in
place and copies anything else first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaptiveload.ops import kernel_lib

EPS = 1e-6
FWD_SCHEMA = "(Tensor x, Tensor scale, Tensor shift, float eps) -> (Tensor, Tensor, Tensor)"
BWD_SCHEMA = (
    "(Tensor dy, Tensor x, Tensor scale, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)"
)
SEG_FWD_SCHEMA = (
    "(Tensor x, Tensor scale, Tensor shift, Tensor cu_seqlens, float eps) -> "
    "(Tensor, Tensor, Tensor)"
)
SEG_BWD_SCHEMA = (
    "(Tensor dy, Tensor x, Tensor scale, Tensor cu_seqlens, Tensor mean, Tensor rstd) -> "
    "(Tensor, Tensor, Tensor)"
)
FWD_OP = "adaptiveload::ln_modulate_fwd"
SEG_FWD_OP = "adaptiveload::ln_modulate_seg_fwd"
SEG_BWD_OP = "adaptiveload::ln_modulate_seg_bwd"
# The kernels' limits (kernels/ln_modulate_dispatch.h: kPack, kMaxD; the resource check test
# asserts they agree): D a multiple of PACK in [PACK, MAX_D].
PACK = 8
MAX_D = 8192
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROWS = 2**31 - 1  # the largest L int32 offsets can address
MAX_SEGMENTS = 65535  # segments per call (kMaxGridY: the backward's finalize grid rows)


def wan_eager(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """As `wan/modules/model.py` does it: fp32 LayerNorm, cast back, upcast, modulate (fp32 out)."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x)
    return normed.float() * (1 + scale) + shift


def reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """fp32 statistics and math, output in x's dtype: the semantics the fused kernel matches."""
    y = F.layer_norm(x.float(), (x.shape[-1],), eps=eps) * (1 + scale.float()) + shift.float()
    return y.to(x.dtype)


def ln_modulate(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = EPS
) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift in x's dtype; differentiable in x, scale and shift.
    Unsupported inputs raise ValueError/TypeError here, before any kernel runs."""
    check_inputs(x, scale, shift)
    return torch.ops.adaptiveload.ln_modulate_fwd(x, scale, shift, eps)[0]


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The segment of every row of an `[total, D]` token stream (int64 `[total]`), from the
    offsets; `output_size` keeps it free of a device sync on CUDA."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    segments = torch.arange(lengths.shape[0], device=cu_seqlens.device)
    return torch.repeat_interleave(segments, lengths, output_size=total)


def wan_eager_segments(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    cu_seqlens: torch.Tensor,
    eps: float = EPS,
) -> torch.Tensor:
    """Wan's eager sequence on a token stream: every token's scale and shift row gathered
    (two transient [L, D] fp32 copies per call, and autograd keeps `1 + scale` per token: the
    cost the segment kernel avoids, docs/kernel.md), then `wan_eager` (fp32 out)."""
    rows = segment_ids(cu_seqlens, x.shape[0])
    return wan_eager(x, scale[rows], shift[rows], eps)


def reference_segments(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    cu_seqlens: torch.Tensor,
    eps: float = EPS,
) -> torch.Tensor:
    """`reference` with each row's segment modulation (output in x's dtype): the tests' oracle."""
    rows = segment_ids(cu_seqlens, x.shape[0])
    return reference(x, scale[rows], shift[rows], eps)


def ln_modulate_segments(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    cu_seqlens: torch.Tensor,
    eps: float = EPS,
) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale[g]) + shift[g] for the rows of each segment g of a packed
    stream, in x's dtype; differentiable in x, scale and shift (dscale/dshift: per-segment
    sums). Unsupported shapes and dtypes raise here, before any kernel runs; bad offset values
    raise in the CPU kernel and stop the CUDA kernel with a device-side assert."""
    check_segment_inputs(x, scale, shift, cu_seqlens)
    return torch.ops.adaptiveload.ln_modulate_seg_fwd(x, scale, shift, cu_seqlens, eps)[0]


def fused_available() -> bool:
    """True when `ln_modulate` and `ln_modulate_segments` run the fused CUDA kernels for CUDA
    tensors."""
    return not fused_unavailable_reason()


def fused_unavailable_reason() -> str:
    """Why the fused kernel is not used ('' when it is)."""
    if not _LOAD.loaded:
        return _LOAD.reason
    if _MISSING_FROM_LIBRARY:
        return (
            f"{_LOAD.path} predates {', '.join(_MISSING_FROM_LIBRARY)}: rebuild with "
            "`adaptiveload kernel build`"
        )
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    return ""


# --- validation: one set of rules per layout, shared rules for x and the modulation --------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _require_tensors(op: str, **tensors: object) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def _check_x(op: str, x: torch.Tensor, dims: str, device_type: str) -> None:
    """x's rank (`dims` spells it, e.g. 'B, S, D'), dtype and width D."""
    if x.dim() != dims.count(",") + 1:
        raise ValueError(f"{op}: x must be [{dims}], got {tuple(x.shape)}")
    allowed = KERNEL_DTYPES + (() if device_type == "cuda" else (torch.float64,))
    if x.dtype not in allowed:
        raise ValueError(
            f"{op}: x has dtype {_dtype_name(x.dtype)}; the fused op takes "
            f"{', '.join(_dtype_name(d) for d in allowed)} on {device_type}"
        )
    d = x.shape[-1]
    if d % PACK or not PACK <= d <= MAX_D:
        raise ValueError(
            f"{op}: D = {d} unsupported; the fused kernel needs D a multiple of {PACK} "
            f"in [{PACK}, {MAX_D}] (MAX_D, the largest width whose backward fits the GPU)"
        )


def _check_modulation(
    op: str, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, shapes: dict[str, tuple]
) -> None:
    """scale and shift: one of the allowed shapes (`shapes` maps each shape's spelling to it;
    compared with ==, since a dynamic dimension under torch.compile is not hashable), on x's
    device, the same shape and dtype, float32 or x's dtype."""
    for name, t in (("scale", scale), ("shift", shift)):
        if not any(tuple(t.shape) == shape for shape in shapes.values()):
            raise ValueError(
                f"{op}: {name} must be {' or '.join(shapes)} for x {tuple(x.shape)},"
                f" got {tuple(t.shape)}"
            )
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")
    if scale.shape != shift.shape or scale.dtype != shift.dtype:
        raise ValueError(
            f"{op}: scale and shift must have the same shape and dtype, got "
            f"{tuple(scale.shape)} {scale.dtype} and {tuple(shift.shape)} {shift.dtype}"
        )
    if scale.dtype not in (torch.float32, x.dtype):
        raise ValueError(
            f"{op}: scale/shift dtype {_dtype_name(scale.dtype)} must be float32 or x's "
            f"dtype {_dtype_name(x.dtype)}"
        )


def _check_grad_and_stats(
    op: str, dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> None:
    """dy like x; mean and rstd the forward's per-row statistics (x's shape without D)."""
    _require_tensors(op, dy=dy, mean=mean, rstd=rstd)
    for name, t in (("dy", dy), ("mean", mean), ("rstd", rstd)):
        if t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(
            f"{op}: dy must match x ({tuple(x.shape)} {_dtype_name(x.dtype)}), got "
            f"{tuple(dy.shape)} {_dtype_name(dy.dtype)}"
        )
    stat = _math_dtype(x)
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.shape != x.shape[:-1] or t.dtype != stat:
            raise ValueError(
                f"{op}: {name} must be {_dtype_name(stat)} {tuple(x.shape[:-1])}, got "
                f"{tuple(t.shape)} {_dtype_name(t.dtype)}"
            )


def check_inputs(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, device_type: str | None = None
) -> None:
    """Raise ValueError (TypeError for a non-tensor) unless the fused op supports the inputs.

    The rules are the same on every device: x [B, S, D] in float32/float16/bfloat16 with D a
    multiple of 8 in [8, MAX_D]; scale and shift both [B, 1, D] or both [B, S, D], in float32 or
    x's dtype, all on x's device. Off CUDA, float64 is also accepted (the reference math is
    the oracle of gradcheck). Empty B or S is fine (empty outputs, zero gradients).
    `device_type` applies another device's rules (tests check the CUDA rules on CPU tensors).
    """
    _require_tensors("ln_modulate", x=x, scale=scale, shift=shift)
    _check_x("ln_modulate", x, "B, S, D", device_type or x.device.type)
    b, s, d = x.shape
    shapes = {"[B, 1, D]": (b, 1, d), "[B, S, D]": (b, s, d)}
    _check_modulation("ln_modulate", x, scale, shift, shapes)


def check_backward_inputs(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    device_type: str | None = None,
) -> None:
    """`check_inputs` for the backward op: x and scale as in the forward, dy like x, mean and
    rstd the forward's [B, S] statistics (float32; float64 for float64 x)."""
    check_inputs(x, scale, scale, device_type)
    _check_grad_and_stats("ln_modulate_bwd", dy, x, mean, rstd)


def check_segment_inputs(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    cu_seqlens: torch.Tensor,
    device_type: str | None = None,
) -> None:
    """`check_inputs` for the segment layout: x [L, D] (L < 2**31) under the same dtype and
    width rules; scale and shift [G, D] (1 <= G <= MAX_SEGMENTS, or G = 0 for an empty stream)
    under the same modulation rules; cu_seqlens an int32 vector of G + 1 offsets on x's
    device. Shapes and dtypes only: `check_offsets` checks the values (it reads them)."""
    op = "ln_modulate_segments"
    _require_tensors(op, x=x, scale=scale, shift=shift, cu_seqlens=cu_seqlens)
    _check_x(op, x, "L, D", device_type or x.device.type)
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"{op}: L = {x.shape[0]} rows; int32 offsets address < 2**31")
    g = scale.shape[0] if scale.dim() == 2 else -1
    _check_modulation(op, x, scale, shift, {"[G, D]": (g, x.shape[1])})
    if g == 0 and x.shape[0] > 0:
        raise ValueError(f"{op}: x has L = {x.shape[0]} rows but scale has no segment (G = 0)")
    if g > MAX_SEGMENTS:
        raise ValueError(f"{op}: G = {g} segments; the kernels take at most {MAX_SEGMENTS}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != g + 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(
            f"{op}: cu_seqlens must be int32 [G + 1] = [{g + 1}] for scale {tuple(scale.shape)}, "
            f"got {_dtype_name(cu_seqlens.dtype)} {tuple(cu_seqlens.shape)}"
            + (" (use cu_seqlens.int())" if cu_seqlens.dtype != torch.int32 else "")
        )
    if cu_seqlens.device != x.device:
        raise ValueError(f"{op}: cu_seqlens is on {cu_seqlens.device}, x on {x.device}")


def check_segment_backward_inputs(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    device_type: str | None = None,
) -> None:
    """`check_segment_inputs` for the backward op: dy like x, mean and rstd [L]."""
    check_segment_inputs(x, scale, scale, cu_seqlens, device_type)
    _check_grad_and_stats("ln_modulate_seg_bwd", dy, x, mean, rstd)


def check_offsets(cu_seqlens: torch.Tensor, total: int) -> None:
    """Raise ValueError unless `0 = cu[0] <= cu[1] <= ... <= cu[G] = total` (empty segments
    allowed). Reads the values: a device sync for a CUDA tensor, which is why the CUDA kernels
    check these rules on the device instead."""
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    op = "ln_modulate_segments"
    if cu[0] != 0:
        raise ValueError(f"{op}: cu_seqlens[0] = {int(cu[0])}; the offsets must start at 0")
    if cu[-1] != total:
        raise ValueError(
            f"{op}: cu_seqlens[-1] = {int(cu[-1])}, but x has L = {total} rows; the last "
            "offset must be L"
        )
    if (down := (cu[1:] < cu[:-1]).nonzero()).numel():
        i = int(down[0])
        raise ValueError(
            f"{op}: cu_seqlens decreases at index {i + 1} ({int(cu[i])} -> {int(cu[i + 1])}); "
            "the offsets must be nondecreasing"
        )


# --- reference kernels (CPU always; CUDA too when the library is not loaded) ----------------


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 math like the kernel; fp64 inputs stay fp64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _out(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous tensor (custom-op outputs must not alias inputs; fakes are contiguous)."""
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def _fwd_math(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, mean, rstd) with scale/shift broadcastable to x, as the kernels compute them."""
    ct = _math_dtype(x)
    xf = x.to(ct)
    mean = xf.mean(-1)
    centred = xf - mean[..., None]
    rstd = torch.rsqrt((centred * centred).mean(-1) + eps)
    y = centred * rstd[..., None] * (1 + scale.to(ct)) + shift.to(ct)
    return _out(y, x.dtype), _out(mean, ct), _out(rstd, ct)


def _bwd_math(
    dy: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dy * xhat, dy) in the math dtype, scale broadcastable to x: the per-row gradients
    before any reduction of the modulation's."""
    ct = _math_dtype(x)
    rstd_c = rstd.to(ct)[..., None]
    xhat = (x.to(ct) - mean.to(ct)[..., None]) * rstd_c
    dyf = dy.to(ct)
    g = dyf * (1 + scale.to(ct))
    dx = rstd_c * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx, dyf * xhat, dyf


def _fwd_reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(x, scale, shift)
    return _fwd_math(x, scale, shift, eps)


def _bwd_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_backward_inputs(dy, x, scale, mean, rstd)
    dx, dscale, dshift = _bwd_math(dy, x, scale, mean, rstd)
    if scale.shape[1] == 1:  # per-sample modulation: column sums over S
        dscale, dshift = dscale.sum(1, keepdim=True), dshift.sum(1, keepdim=True)
    return _out(dx, x.dtype), _out(dscale, scale.dtype), _out(dshift, scale.dtype)


def _seg_fwd_reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, cu_seqlens: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_segment_inputs(x, scale, shift, cu_seqlens)
    check_offsets(cu_seqlens, x.shape[0])
    rows = segment_ids(cu_seqlens, x.shape[0])
    return _fwd_math(x, scale[rows], shift[rows], eps)


def _seg_bwd_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_segment_backward_inputs(dy, x, scale, cu_seqlens, mean, rstd)
    check_offsets(cu_seqlens, x.shape[0])
    rows = segment_ids(cu_seqlens, x.shape[0])
    dx, dscale_rows, dshift_rows = _bwd_math(dy, x, scale[rows], mean, rstd)
    # per-segment sums, accumulated in row order (deterministic on the CPU)
    dscale = dscale_rows.new_zeros(scale.shape).index_add_(0, rows, dscale_rows)
    dshift = dshift_rows.new_zeros(scale.shape).index_add_(0, rows, dshift_rows)
    return _out(dx, x.dtype), _out(dscale, scale.dtype), _out(dshift, scale.dtype)


# --- fake (meta) kernels: shapes, dtypes and strides of what the real kernels return --------


def _stats_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[:-1], dtype=_math_dtype(x))


def _fwd_fake(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(x, scale, shift)
    return x.new_empty(x.shape), _stats_fake(x), _stats_fake(x)


def _bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_backward_inputs(dy, x, scale, mean, rstd)
    return x.new_empty(x.shape), scale.new_empty(scale.shape), scale.new_empty(scale.shape)


def _seg_fwd_fake(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, cu_seqlens: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_segment_inputs(x, scale, shift, cu_seqlens)
    return x.new_empty(x.shape), _stats_fake(x), _stats_fake(x)


def _seg_bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    cu_seqlens: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_segment_backward_inputs(dy, x, scale, cu_seqlens, mean, rstd)
    return x.new_empty(x.shape), scale.new_empty(scale.shape), scale.new_empty(scale.shape)


# --- autograd: the backward is itself the custom op ----------------------------------------
# mean and rstd are treated as non-differentiable outputs (their grads are ignored).


def _setup_context(ctx, inputs, output) -> None:
    x, scale, _shift, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, scale, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    x, scale, mean, rstd = ctx.saved_tensors
    dx, dscale, dshift = torch.ops.adaptiveload.ln_modulate_bwd(dy, x, scale, mean, rstd)
    return dx, dscale, dshift, None


def _seg_setup_context(ctx, inputs, output) -> None:
    x, scale, _shift, cu_seqlens, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, scale, cu_seqlens, mean, rstd)


def _seg_backward(ctx, dy, _dmean, _drstd):
    x, scale, cu_seqlens, mean, rstd = ctx.saved_tensors
    dx, dscale, dshift = torch.ops.adaptiveload.ln_modulate_seg_bwd(
        dy, x, scale, cu_seqlens, mean, rstd
    )
    return dx, dscale, dshift, None, None


# op name -> (schema, reference kernel, fake kernel, (backward, setup_context) or None)
_OPS = {
    "ln_modulate_fwd": (FWD_SCHEMA, _fwd_reference, _fwd_fake, (_backward, _setup_context)),
    "ln_modulate_bwd": (BWD_SCHEMA, _bwd_reference, _bwd_fake, None),
    "ln_modulate_seg_fwd": (
        SEG_FWD_SCHEMA, _seg_fwd_reference, _seg_fwd_fake, (_seg_backward, _seg_setup_context)
    ),
    "ln_modulate_seg_bwd": (SEG_BWD_SCHEMA, _seg_bwd_reference, _seg_bwd_fake, None),
}


def _register() -> tuple[kernel_lib.LoadState, tuple[str, ...]]:
    """Load the CUDA library if built; define here every op it does not (all of them without a
    library; the newer ones for a library built from older sources), with the reference math
    as their CUDA kernel too; add the CPU, fake and autograd kernels of every op. Returns the
    load state and the ops a loaded library lacks."""
    state = kernel_lib.load()
    lib = torch.library.Library("adaptiveload", "FRAGMENT")
    _KEEP_ALIVE.append(lib)
    missing = []
    for name, (schema, kernel, fake, grad) in _OPS.items():
        qualified = f"adaptiveload::{name}"
        devices: tuple[str, ...] = ("cpu",)
        if not (state.loaded and hasattr(torch.ops.adaptiveload, name)):
            lib.define(name + schema)
            devices = ("cpu", "cuda")
            missing += [name] if state.loaded else []
        torch.library.register_kernel(qualified, devices, kernel)
        torch.library.register_fake(qualified, fake)
        if grad is not None:
            torch.library.register_autograd(qualified, grad[0], setup_context=grad[1])
    return state, tuple(missing)


_KEEP_ALIVE: list[torch.library.Library] = []
# At import: torch imports this module (the library's set_python_module) to find the fakes.
_LOAD, _MISSING_FROM_LIBRARY = _register()
