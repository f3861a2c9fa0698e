// torch binding of the fused LayerNorm-Modulate kernels: the only file that includes torch
// headers (the .cu files stay torch-free so nvcc compiles them in seconds). Registers
//   adaptiveload::ln_modulate_fwd(x, scale, shift, eps) -> (y, mean, rstd)
//   adaptiveload::ln_modulate_bwd(dy, x, scale, mean, rstd) -> (dx, dscale, dshift)
// with a CUDA kernel. CPU kernels, fake (meta) kernels and autograd are registered from Python
// (adaptiveload/ops/ln_modulate.py, named by set_python_module so torch can import it).
//
// Strided inputs: any view whose last dimension is contiguous and whose base pointer and row
// strides are 16-byte aligned is read in place (Wan's chunk views of the modulation tensor);
// anything else is copied with .contiguous() first, so a result is never silently wrong.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

#include "ln_modulate.h"

namespace {

using adaptiveload::DType;

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kF32;
    case at::kHalf: return DType::kF16;
    case at::kBFloat16: return DType::kBF16;
    default:
      TORCH_CHECK_VALUE(false, "ln_modulate: ", name, " has dtype ", t.scalar_type(),
                        "; the fused CUDA kernel takes float32, float16 or bfloat16");
  }
  return DType::kF32;  // unreachable
}

// Row strides of a [B, S, D] tensor; a size-1 dimension gets stride 0 (never stepped over).
struct Rows {
  const void* ptr;
  int64_t sb, ss;
};

Rows rows_of(const at::Tensor& t) {
  return {t.data_ptr(), t.size(0) == 1 ? 0 : t.stride(0), t.size(1) == 1 ? 0 : t.stride(1)};
}

bool kernel_readable(const at::Tensor& t) {
  if (t.numel() == 0) return true;
  const Rows r = rows_of(t);
  const int64_t vec = 16 / static_cast<int64_t>(t.element_size());
  return t.stride(2) == 1 && reinterpret_cast<uintptr_t>(r.ptr) % 16 == 0 && r.sb % vec == 0 &&
         r.ss % vec == 0;
}

// clone, not contiguous(): a contiguous but misaligned view would come back unchanged
at::Tensor readable(const at::Tensor& t) {
  return kernel_readable(t) ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Defensive twins of the Python validator (adaptiveload/ops/ln_modulate.py: check_inputs),
// which runs first on every public path; these keep a direct torch.ops call from reaching a
// kernel with an input it cannot read.
void check_inputs(const at::Tensor& x, const at::Tensor& scale, const char* scale_name) {
  TORCH_CHECK_VALUE(x.defined() && scale.defined(), "ln_modulate: undefined tensor");
  TORCH_CHECK_VALUE(x.dim() == 3, "ln_modulate: x must be [B, S, D], got ", x.sizes());
  TORCH_CHECK_VALUE(x.is_cuda(), "ln_modulate: the CUDA kernel got x on ", x.device());
  dtype_of(x, "x");
  const int64_t D = x.size(2);
  TORCH_CHECK_VALUE(D % 8 == 0 && D >= 8 && D <= adaptiveload::kMaxD,
                    "ln_modulate: D = ", D, " unsupported; the fused kernel needs D a multiple "
                    "of 8 in [8, ", adaptiveload::kMaxD, "]");
  TORCH_CHECK_VALUE(scale.dim() == 3 && scale.size(0) == x.size(0) && scale.size(2) == D &&
                        (scale.size(1) == 1 || scale.size(1) == x.size(1)),
                    "ln_modulate: ", scale_name, " must be [B, 1, D] or [B, S, D] for x ",
                    x.sizes(), ", got ", scale.sizes());
  TORCH_CHECK_VALUE(scale.device() == x.device(), "ln_modulate: ", scale_name, " is on ",
                    scale.device(), ", x on ", x.device());
  TORCH_CHECK_VALUE(scale.scalar_type() == at::kFloat || scale.scalar_type() == x.scalar_type(),
                    "ln_modulate: ", scale_name, " dtype ", scale.scalar_type(),
                    " must be float32 or x's dtype ", x.scalar_type());
}

void check_launch(const char* err) { TORCH_CHECK(err == nullptr, err); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& x_in,
                                                        const at::Tensor& scale_in,
                                                        const at::Tensor& shift_in,
                                                        double eps) {
  check_inputs(x_in, scale_in, "scale");
  check_inputs(x_in, shift_in, "shift");
  TORCH_CHECK_VALUE(scale_in.sizes() == shift_in.sizes() &&
                        scale_in.scalar_type() == shift_in.scalar_type(),
                    "ln_modulate: scale and shift must have the same shape and dtype, got ",
                    scale_in.sizes(), " ", scale_in.scalar_type(), " and ", shift_in.sizes(),
                    " ", shift_in.scalar_type());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = readable(x_in), scale = readable(scale_in), shift = readable(shift_in);
  const int64_t B = x.size(0), S = x.size(1), D = x.size(2);
  at::Tensor y = at::empty({B, S, D}, x.options());
  at::Tensor mean = at::empty({B, S}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({B, S}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {y, mean, rstd};

  const Rows xr = rows_of(x), sc = rows_of(scale), sh = rows_of(shift);
  adaptiveload::LnModFwdArgs a{};
  a.x = xr.ptr;
  a.x_sb = xr.sb;
  a.x_ss = xr.ss;
  a.scale = sc.ptr;
  a.scale_sb = sc.sb;
  a.scale_ss = sc.ss;
  a.shift = sh.ptr;
  a.shift_sb = sh.sb;
  a.shift_ss = sh.ss;
  a.y = y.data_ptr();
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.B = B;
  a.S = S;
  a.D = D;
  a.eps = static_cast<float>(eps);
  a.x_dtype = dtype_of(x, "x");
  a.mod_dtype = dtype_of(scale, "scale");
  check_launch(adaptiveload::ln_modulate_fwd(a, c10::cuda::getCurrentCUDAStream().stream()));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& dy_in,
                                                        const at::Tensor& x_in,
                                                        const at::Tensor& scale_in,
                                                        const at::Tensor& mean_in,
                                                        const at::Tensor& rstd_in) {
  check_inputs(x_in, scale_in, "scale");
  TORCH_CHECK_VALUE(dy_in.defined() && dy_in.sizes() == x_in.sizes() &&
                        dy_in.scalar_type() == x_in.scalar_type() &&
                        dy_in.device() == x_in.device(),
                    "ln_modulate_bwd: dy must match x (", x_in.sizes(), " ", x_in.scalar_type(),
                    " on ", x_in.device(), "), got ", dy_in.sizes(), " ",
                    dy_in.scalar_type(), " on ", dy_in.device());
  const int64_t B = x_in.size(0), S = x_in.size(1), D = x_in.size(2);
  for (const at::Tensor* t : {&mean_in, &rstd_in}) {
    TORCH_CHECK_VALUE(t->defined() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == B &&
                          t->size(1) == S && t->device() == x_in.device(),
                      "ln_modulate_bwd: mean/rstd must be float32 [B, S] on x's device, got ",
                      t->sizes(), " ", t->scalar_type());
  }
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor dy = readable(dy_in), x = readable(x_in), scale = readable(scale_in);
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const bool per_token = scale.size(1) != 1 || S == 1;
  at::Tensor dx = at::empty({B, S, D}, x.options());
  at::Tensor dscale = at::empty(scale.sizes(), scale.options());
  at::Tensor dshift = at::empty(scale.sizes(), scale.options());
  if (x.numel() == 0) return {dx, dscale.zero_(), dshift.zero_()};

  const Rows dr = rows_of(dy), xr = rows_of(x), sc = rows_of(scale);
  adaptiveload::LnModBwdArgs a{};
  a.dy = dr.ptr;
  a.dy_sb = dr.sb;
  a.dy_ss = dr.ss;
  a.x = xr.ptr;
  a.x_sb = xr.sb;
  a.x_ss = xr.ss;
  a.scale = sc.ptr;
  a.scale_sb = sc.sb;
  a.scale_ss = sc.ss;
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.dx = dx.data_ptr();
  a.dscale = dscale.data_ptr();
  a.dshift = dshift.data_ptr();
  a.B = B;
  a.S = S;
  a.D = D;
  a.per_token = per_token;
  a.x_dtype = dtype_of(x, "x");
  a.mod_dtype = dtype_of(scale, "scale");
  int64_t floats = 0;
  check_launch(adaptiveload::ln_modulate_bwd_workspace(a, &floats));
  at::Tensor workspace;
  if (floats > 0) {
    workspace = at::empty({floats}, x.options().dtype(at::kFloat));
    a.workspace = workspace.data_ptr<float>();
  }
  check_launch(adaptiveload::ln_modulate_bwd(a, c10::cuda::getCurrentCUDAStream().stream()));
  return {dx, dscale, dshift};
}

}  // namespace

TORCH_LIBRARY(adaptiveload, m) {
  m.set_python_module("adaptiveload.ops.ln_modulate");
  m.def("ln_modulate_fwd(Tensor x, Tensor scale, Tensor shift, float eps) -> (Tensor, Tensor, "
        "Tensor)");
  m.def("ln_modulate_bwd(Tensor dy, Tensor x, Tensor scale, Tensor mean, Tensor rstd) -> "
        "(Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(adaptiveload, CUDA, m) {
  m.impl("ln_modulate_fwd", &fwd_cuda);
  m.impl("ln_modulate_bwd", &bwd_cuda);
}
