"""LayerNorm-Modulate: ``y = LayerNorm(x) * (1 + scale) + shift`` (no affine, eps 1e-6, fp32 stats).

Three implementations of one op:
- `wan_eager`: Wan 2.1's exact eager op sequence (the unfused baseline of benchmarks and the
  model's `eager` switch);
- `reference`: fp32 math in plain PyTorch ops, the tests' oracle;
- `ln_modulate`: the custom op `adaptiveload::ln_modulate_fwd` with its own backward
  (`adaptiveload::ln_modulate_bwd`), autograd and fake kernels, so it works under
  torch.compile. On CUDA it runs the fused kernel (`kernels/`, built by `adaptiveload kernel
  build`); on CPU, or when the library is not built, the same op runs fp32 reference math.

x is ``[B, S, D]``; scale and shift are ``[B, 1, D]`` (per sample, Wan 2.1) or ``[B, S, D]``
(per token), in float32 or x's dtype, with equal shapes and dtypes. The op returns y in x's
dtype plus per-row fp32 mean/rstd, which autograd saves instead of any normalised
activation: the backward recomputes xhat from x.
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
    """LayerNorm(x) * (1 + scale) + shift in x's dtype; differentiable in x, scale and shift."""
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


def _check(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(f"ln_modulate: x must be [B, S, D], got {tuple(x.shape)}")
    b, s, d = x.shape
    for name, t in (("scale", scale), ("shift", shift)):
        if t.dim() != 3 or t.shape[0] != b or t.shape[2] != d or t.shape[1] not in (1, s):
            raise ValueError(
                f"ln_modulate: {name} must be [B, 1, D] or [B, S, D] for x {tuple(x.shape)},"
                f" got {tuple(t.shape)}"
            )
    if scale.shape != shift.shape or scale.dtype != shift.dtype:
        raise ValueError(
            "ln_modulate: scale and shift must have the same shape and dtype, got "
            f"{tuple(scale.shape)} {scale.dtype} and {tuple(shift.shape)} {shift.dtype}"
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
    _check(x, scale, shift)
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
    _check(x, scale, shift)
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
