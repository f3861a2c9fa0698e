"""LayerNorm-Modulate: ``y = LayerNorm(x) * (1 + scale) + shift`` (no affine, eps 1e-6, fp32 stats).

Three implementations of one op:
- `wan_eager`: Wan 2.1's exact eager op sequence (the unfused baseline of benchmarks and the
  model's `eager` switch);
- `reference`: fp32 math in plain PyTorch ops, the tests' oracle;
- `ln_modulate`: the custom op `adaptiveload::ln_modulate_fwd` with its own backward
  (`adaptiveload::ln_modulate_bwd`), autograd and fake kernels, so it works under
  torch.compile. On CUDA it runs the fused kernel (`csrc/`, built by `adaptiveload kernel
  build`); on CPU, or when the library is not built, the same op runs fp32 reference math.

x is ``[B, S, D]``; scale and shift are ``[B, 1, D]`` (per sample, Wan 2.1) or ``[B, S, D]``
(per token), in float32 or x's dtype, with equal shapes and dtypes. The op returns y in x's
dtype plus per-row fp32 mean/rstd, which autograd saves instead of any normalised
activation: the backward recomputes xhat from x.

Validation: `check_inputs` / `check_backward_inputs` are the one set of rules for every
device. They run in `ln_modulate` before the op is called, in the CPU kernels and in the fake
kernels (so torch.compile rejects a bad input while tracing), and raise ValueError/TypeError
naming the problem before anything reaches a CUDA kernel. The C++ binding repeats them
defensively for direct `torch.ops` calls. Strided views are accepted: the binding reads
16-byte-aligned rows in place and copies anything else first.
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
FWD_OP = "adaptiveload::ln_modulate_fwd"
BWD_OP = "adaptiveload::ln_modulate_bwd"
# The kernels' limits (csrc/ln_modulate_dispatch.h: kPack, kMaxD; the resource check test
# asserts they agree): D a multiple of PACK in [PACK, MAX_D].
PACK = 8
MAX_D = 8192
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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


def fused_available() -> bool:
    """True when `ln_modulate` runs the fused CUDA kernel for CUDA tensors."""
    return not fused_unavailable_reason()


def fused_unavailable_reason() -> str:
    """Why the fused kernel is not used ('' when it is)."""
    if not _LOAD.loaded:
        return _LOAD.reason
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    return ""


# --- reference kernels (CPU always; CUDA too when the library is not loaded) ----------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
    for name, t in (("x", x), ("scale", scale), ("shift", shift)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"ln_modulate: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 3:
        raise ValueError(f"ln_modulate: x must be [B, S, D], got {tuple(x.shape)}")
    device_type = device_type or x.device.type
    allowed = KERNEL_DTYPES + (() if device_type == "cuda" else (torch.float64,))
    if x.dtype not in allowed:
        raise ValueError(
            f"ln_modulate: x has dtype {_dtype_name(x.dtype)}; the fused op takes "
            f"{', '.join(_dtype_name(d) for d in allowed)} on {device_type}"
        )
    b, s, d = x.shape
    if d % PACK or not PACK <= d <= MAX_D:
        raise ValueError(
            f"ln_modulate: D = {d} unsupported; the fused kernel needs D a multiple of {PACK} "
            f"in [{PACK}, {MAX_D}] (MAX_D, the largest width whose backward fits the GPU)"
        )
    for name, t in (("scale", scale), ("shift", shift)):
        if t.dim() != 3 or t.shape[0] != b or t.shape[2] != d or t.shape[1] not in (1, s):
            raise ValueError(
                f"ln_modulate: {name} must be [B, 1, D] or [B, S, D] for x {tuple(x.shape)},"
                f" got {tuple(t.shape)}"
            )
        if t.device != x.device:
            raise ValueError(f"ln_modulate: {name} is on {t.device}, x on {x.device}")
    if scale.shape != shift.shape or scale.dtype != shift.dtype:
        raise ValueError(
            "ln_modulate: scale and shift must have the same shape and dtype, got "
            f"{tuple(scale.shape)} {scale.dtype} and {tuple(shift.shape)} {shift.dtype}"
        )
    if scale.dtype not in (torch.float32, x.dtype):
        raise ValueError(
            f"ln_modulate: scale/shift dtype {_dtype_name(scale.dtype)} must be float32 or x's "
            f"dtype {_dtype_name(x.dtype)}"
        )


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
    for name, t in (("dy", dy), ("mean", mean), ("rstd", rstd)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                f"ln_modulate_bwd: {name} must be a torch.Tensor, got {type(t).__name__}"
            )
        if t.device != x.device:
            raise ValueError(f"ln_modulate_bwd: {name} is on {t.device}, x on {x.device}")
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(
            f"ln_modulate_bwd: dy must match x ({tuple(x.shape)} {_dtype_name(x.dtype)}), got "
            f"{tuple(dy.shape)} {_dtype_name(dy.dtype)}"
        )
    stat = _math_dtype(x)
    for name, t in (("mean", mean), ("rstd", rstd)):
        if t.shape != x.shape[:2] or t.dtype != stat:
            raise ValueError(
                f"ln_modulate_bwd: {name} must be {_dtype_name(stat)} {tuple(x.shape[:2])}, got "
                f"{tuple(t.shape)} {_dtype_name(t.dtype)}"
            )


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 math like the kernel; fp64 inputs stay fp64 (gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _out(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous tensor (custom-op outputs must not alias inputs; fakes are contiguous)."""
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


def _fwd_reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(x, scale, shift)
    ct = _math_dtype(x)
    xf = x.to(ct)
    mean = xf.mean(-1)
    centred = xf - mean[..., None]
    rstd = torch.rsqrt((centred * centred).mean(-1) + eps)
    y = centred * rstd[..., None] * (1 + scale.to(ct)) + shift.to(ct)
    return _out(y, x.dtype), _out(mean, ct), _out(rstd, ct)


def _bwd_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_backward_inputs(dy, x, scale, mean, rstd)
    ct = _math_dtype(x)
    rstd_c = rstd.to(ct)[..., None]
    xhat = (x.to(ct) - mean.to(ct)[..., None]) * rstd_c
    dyf = dy.to(ct)
    g = dyf * (1 + scale.to(ct))
    dx = rstd_c * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    dscale, dshift = dyf * xhat, dyf
    if scale.shape[1] == 1:  # per-sample modulation: column sums over S
        dscale, dshift = dscale.sum(1, keepdim=True), dshift.sum(1, keepdim=True)
    return _out(dx, x.dtype), _out(dscale, scale.dtype), _out(dshift, scale.dtype)


# --- fake (meta) kernels: shapes, dtypes and strides of what the real kernels return --------


def _fwd_fake(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_inputs(x, scale, shift)
    b, s, d = x.shape
    stat = _math_dtype(x)
    return (
        x.new_empty((b, s, d)),
        x.new_empty((b, s), dtype=stat),
        x.new_empty((b, s), dtype=stat),
    )


def _bwd_fake(
    dy: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_backward_inputs(dy, x, scale, mean, rstd)
    return x.new_empty(x.shape), scale.new_empty(scale.shape), scale.new_empty(scale.shape)


# --- autograd: the backward is itself the custom op ----------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    x, scale, _shift, _eps = inputs
    _y, mean, rstd = output
    ctx.save_for_backward(x, scale, mean, rstd)


def _backward(ctx, dy, _dmean, _drstd):
    """mean and rstd are treated as non-differentiable outputs (their grads are ignored)."""
    x, scale, mean, rstd = ctx.saved_tensors
    dx, dscale, dshift = torch.ops.adaptiveload.ln_modulate_bwd(dy, x, scale, mean, rstd)
    return dx, dscale, dshift, None


def _register() -> kernel_lib.LoadState:
    """Load the CUDA library if built, else define the ops here; add the Python kernels."""
    state = kernel_lib.load()
    if state.loaded:
        devices: tuple[str, ...] = ("cpu",)
    else:
        lib = torch.library.Library("adaptiveload", "FRAGMENT")
        lib.define("ln_modulate_fwd" + FWD_SCHEMA)
        lib.define("ln_modulate_bwd" + BWD_SCHEMA)
        _KEEP_ALIVE.append(lib)
        devices = ("cpu", "cuda")
    torch.library.register_kernel(FWD_OP, devices, _fwd_reference)
    torch.library.register_kernel(BWD_OP, devices, _bwd_reference)
    torch.library.register_fake(FWD_OP, _fwd_fake)
    torch.library.register_fake(BWD_OP, _bwd_fake)
    torch.library.register_autograd(FWD_OP, _backward, setup_context=_setup_context)
    return state


_KEEP_ALIVE: list[torch.library.Library] = []
# At import: torch imports this module (the library's set_python_module) to find the fakes.
_LOAD = _register()
