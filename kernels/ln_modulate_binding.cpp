// torch binding of the fused LayerNorm-Modulate kernels: the only file that includes torch
// headers (the .cu files stay torch-free so nvcc compiles them in seconds). Registers
//   adaptiveload::ln_modulate_fwd(x, scale, shift, eps) -> (y, mean, rstd)
//   adaptiveload::ln_modulate_bwd(dy, x, scale, mean, rstd) -> (dx, dscale, dshift)
//   adaptiveload::ln_modulate_seg_fwd(x, scale, shift, cu_seqlens, eps) -> (y, mean, rstd)
//   adaptiveload::ln_modulate_seg_bwd(dy, x, scale, cu_seqlens, mean, rstd) -> (dx, dscale, dshift)
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

using adaptiveload::Rows;

// The rows of a [B, S, D] tensor (a size-1 dimension gets stride 0).
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

// Defensive twins of the Python validator (adaptiveload/ops/ln_modulate.py: check_inputs,
// check_segment_inputs), which runs first on every public path; these keep a direct
// torch.ops call from reaching a kernel with an input it cannot read.
void check_x(const at::Tensor& x, int64_t dim, const char* op, const char* dims) {
  TORCH_CHECK_VALUE(x.defined(), op, ": undefined tensor");
  TORCH_CHECK_VALUE(x.dim() == dim, op, ": x must be [", dims, "], got ", x.sizes());
  TORCH_CHECK_VALUE(x.is_cuda(), op, ": the CUDA kernel got x on ", x.device());
  dtype_of(x, "x");
  const int64_t D = x.size(-1);
  TORCH_CHECK_VALUE(D % 8 == 0 && D >= 8 && D <= adaptiveload::kMaxD, op, ": D = ", D,
                    " unsupported; the fused kernel needs D a multiple of 8 in [8, ",
                    adaptiveload::kMaxD, "]");
}

void check_modulation(const at::Tensor& x, const at::Tensor& t, const char* op,
                      const char* name) {
  TORCH_CHECK_VALUE(t.defined(), op, ": undefined tensor");
  TORCH_CHECK_VALUE(t.device() == x.device(), op, ": ", name, " is on ", t.device(), ", x on ",
                    x.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == x.scalar_type(), op,
                    ": ", name, " dtype ", t.scalar_type(), " must be float32 or x's dtype ",
                    x.scalar_type());
}

void check_same(const at::Tensor& scale, const at::Tensor& shift, const char* op) {
  TORCH_CHECK_VALUE(scale.sizes() == shift.sizes() && scale.scalar_type() == shift.scalar_type(),
                    op, ": scale and shift must have the same shape and dtype, got ",
                    scale.sizes(), " ", scale.scalar_type(), " and ", shift.sizes(), " ",
                    shift.scalar_type());
}

void check_inputs(const at::Tensor& x, const at::Tensor& scale, const char* scale_name) {
  check_x(x, 3, "ln_modulate", "B, S, D");
  check_modulation(x, scale, "ln_modulate", scale_name);
  TORCH_CHECK_VALUE(scale.dim() == 3 && scale.size(0) == x.size(0) && scale.size(2) == x.size(2) &&
                        (scale.size(1) == 1 || scale.size(1) == x.size(1)),
                    "ln_modulate: ", scale_name, " must be [B, 1, D] or [B, S, D] for x ",
                    x.sizes(), ", got ", scale.sizes());
}

void check_segment_inputs(const at::Tensor& x, const at::Tensor& scale, const char* scale_name,
                          const at::Tensor& cu) {
  constexpr const char* op = "ln_modulate_segments";
  check_x(x, 2, op, "L, D");
  check_modulation(x, scale, op, scale_name);
  TORCH_CHECK_VALUE(scale.dim() == 2 && scale.size(1) == x.size(1), op, ": ", scale_name,
                    " must be [G, D] for x ", x.sizes(), ", got ", scale.sizes());
  const int64_t G = scale.size(0), L = x.size(0);
  TORCH_CHECK_VALUE(cu.defined(), op, ": undefined cu_seqlens");
  TORCH_CHECK_VALUE(cu.dim() == 1 && cu.size(0) == G + 1 && cu.scalar_type() == at::kInt, op,
                    ": cu_seqlens must be int32 [G + 1] = [", G + 1, "], got ",
                    cu.scalar_type(), " ", cu.sizes());
  TORCH_CHECK_VALUE(cu.device() == x.device(), op, ": cu_seqlens is on ", cu.device(),
                    ", x on ", x.device());
  TORCH_CHECK_VALUE(L <= INT32_MAX, op, ": L = ", L, " rows; int32 offsets address < 2**31");
  TORCH_CHECK_VALUE(G > 0 || L == 0, op, ": x has L = ", L, " rows but no segment (G = 0)");
  TORCH_CHECK_VALUE(G <= 65535, op, ": G = ", G, " segments; at most 65535 per call");
}

void check_stats(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& mean,
                 const at::Tensor& rstd, const char* op) {
  TORCH_CHECK_VALUE(dy.defined() && dy.sizes() == x.sizes() &&
                        dy.scalar_type() == x.scalar_type() && dy.device() == x.device(),
                    op, ": dy must match x (", x.sizes(), " ", x.scalar_type(), " on ",
                    x.device(), "), got ", dy.sizes(), " ", dy.scalar_type(), " on ",
                    dy.device());
  const auto rows = x.sizes().slice(0, x.dim() - 1);
  for (const at::Tensor* t : {&mean, &rstd}) {
    TORCH_CHECK_VALUE(t->defined() && t->scalar_type() == at::kFloat && t->sizes() == rows &&
                          t->device() == x.device(),
                      op, ": mean/rstd must be float32 ", rows, " on x's device, got ",
                      t->sizes(), " ", t->scalar_type());
  }
}

void check_launch(const char* err) { TORCH_CHECK(err == nullptr, err); }

// The kernel arguments of [B, S, D] views (the segment layout passes x as [1, L, D] and
// scale/shift as [G, 1, D]); outputs are fresh contiguous tensors. Both directions fill the
// shared part (LnModArgs) here, then their own.
void fill_shared(adaptiveload::LnModArgs& a, const at::Tensor& x, const at::Tensor& scale) {
  a.x = rows_of(x);
  a.scale = rows_of(scale);
  a.B = x.size(0);
  a.S = x.size(1);
  a.D = x.size(2);
  a.x_dtype = dtype_of(x, "x");
  a.mod_dtype = dtype_of(scale, "scale");
}

adaptiveload::LnModFwdArgs fwd_args(const at::Tensor& x, const at::Tensor& scale,
                                    const at::Tensor& shift, at::Tensor& y, at::Tensor& mean,
                                    at::Tensor& rstd, double eps) {
  adaptiveload::LnModFwdArgs a{};
  fill_shared(a, x, scale);
  a.shift = rows_of(shift);
  a.y = y.data_ptr();
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.eps = static_cast<float>(eps);
  return a;
}

adaptiveload::LnModBwdArgs bwd_args(const at::Tensor& dy, const at::Tensor& x,
                                    const at::Tensor& scale, const at::Tensor& mean,
                                    const at::Tensor& rstd, at::Tensor& dx, at::Tensor& dscale,
                                    at::Tensor& dshift, int layout) {
  adaptiveload::LnModBwdArgs a{};
  fill_shared(a, x, scale);
  a.dy = rows_of(dy);
  a.mean = mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.dx = dx.data_ptr();
  a.dscale = dscale.data_ptr();
  a.dshift = dshift.data_ptr();
  a.layout = layout;
  return a;
}

// Allocates the workspace the plan asks for, then runs the backward.
void run_bwd(adaptiveload::LnModBwdArgs& a, const at::Tensor& x) {
  int64_t floats = 0;
  check_launch(adaptiveload::ln_modulate_bwd_workspace(a, &floats));
  at::Tensor workspace;
  if (floats > 0) {
    workspace = at::empty({floats}, x.options().dtype(at::kFloat));
    a.workspace = workspace.data_ptr<float>();
  }
  check_launch(adaptiveload::ln_modulate_bwd(a, c10::cuda::getCurrentCUDAStream().stream()));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& x_in,
                                                        const at::Tensor& scale_in,
                                                        const at::Tensor& shift_in,
                                                        double eps) {
  check_inputs(x_in, scale_in, "scale");
  check_inputs(x_in, shift_in, "shift");
  check_same(scale_in, shift_in, "ln_modulate");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = readable(x_in), scale = readable(scale_in), shift = readable(shift_in);
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor mean = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  if (x.numel() == 0) return {y, mean, rstd};
  const adaptiveload::LnModFwdArgs a = fwd_args(x, scale, shift, y, mean, rstd, eps);
  check_launch(adaptiveload::ln_modulate_fwd(a, c10::cuda::getCurrentCUDAStream().stream()));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& dy_in,
                                                        const at::Tensor& x_in,
                                                        const at::Tensor& scale_in,
                                                        const at::Tensor& mean_in,
                                                        const at::Tensor& rstd_in) {
  check_inputs(x_in, scale_in, "scale");
  check_stats(x_in, dy_in, mean_in, rstd_in, "ln_modulate_bwd");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor dy = readable(dy_in), x = readable(x_in), scale = readable(scale_in);
  const at::Tensor mean = mean_in.contiguous(), rstd = rstd_in.contiguous();
  const int layout = scale.size(1) != 1 || x.size(1) == 1 ? adaptiveload::dispatch::kPerToken
                                                          : adaptiveload::dispatch::kPerSample;
  at::Tensor dx = at::empty(x.sizes(), x.options());
  at::Tensor dscale = at::empty(scale.sizes(), scale.options());
  at::Tensor dshift = at::empty(scale.sizes(), scale.options());
  if (x.numel() == 0) return {dx, dscale.zero_(), dshift.zero_()};
  adaptiveload::LnModBwdArgs a =
      bwd_args(dy, x, scale, mean, rstd, dx, dscale, dshift, layout);
  run_bwd(a, x);
  return {dx, dscale, dshift};
}

// Segment layout: x [L, D] as [1, L, D], scale/shift [G, D] as [G, 1, D] (rows_of gives the
// segment row stride as scale.sb and 0 as scale.ss), the offsets as they are (contiguous).
std::tuple<at::Tensor, at::Tensor, at::Tensor> seg_fwd_cuda(const at::Tensor& x_in,
                                                            const at::Tensor& scale_in,
                                                            const at::Tensor& shift_in,
                                                            const at::Tensor& cu_in,
                                                            double eps) {
  check_segment_inputs(x_in, scale_in, "scale", cu_in);
  check_segment_inputs(x_in, shift_in, "shift", cu_in);
  check_same(scale_in, shift_in, "ln_modulate_segments");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = readable(x_in.unsqueeze(0)), scale = readable(scale_in.unsqueeze(1));
  const at::Tensor shift = readable(shift_in.unsqueeze(1)), cu = cu_in.contiguous();
  const int64_t L = x_in.size(0), D = x_in.size(1);
  at::Tensor y = at::empty({L, D}, x.options());
  at::Tensor mean = at::empty({L}, x.options().dtype(at::kFloat));
  at::Tensor rstd = at::empty({L}, x.options().dtype(at::kFloat));
  if (L == 0) return {y, mean, rstd};
  at::Tensor y3 = y.unsqueeze(0), mean2 = mean.unsqueeze(0), rstd2 = rstd.unsqueeze(0);
  adaptiveload::LnModFwdArgs a = fwd_args(x, scale, shift, y3, mean2, rstd2, eps);
  a.cu_seqlens = cu.data_ptr<int32_t>();
  a.G = scale_in.size(0);
  check_launch(adaptiveload::ln_modulate_fwd(a, c10::cuda::getCurrentCUDAStream().stream()));
  return {y, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> seg_bwd_cuda(const at::Tensor& dy_in,
                                                            const at::Tensor& x_in,
                                                            const at::Tensor& scale_in,
                                                            const at::Tensor& cu_in,
                                                            const at::Tensor& mean_in,
                                                            const at::Tensor& rstd_in) {
  check_segment_inputs(x_in, scale_in, "scale", cu_in);
  check_stats(x_in, dy_in, mean_in, rstd_in, "ln_modulate_seg_bwd");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor dy = readable(dy_in.unsqueeze(0)), x = readable(x_in.unsqueeze(0));
  const at::Tensor scale = readable(scale_in.unsqueeze(1)), cu = cu_in.contiguous();
  const at::Tensor mean = mean_in.contiguous().unsqueeze(0);
  const at::Tensor rstd = rstd_in.contiguous().unsqueeze(0);
  at::Tensor dx = at::empty(x_in.sizes(), x.options());
  at::Tensor dscale = at::empty(scale_in.sizes(), scale.options());
  at::Tensor dshift = at::empty(scale_in.sizes(), scale.options());
  if (x_in.size(0) == 0) return {dx, dscale.zero_(), dshift.zero_()};
  at::Tensor dx3 = dx.unsqueeze(0);
  adaptiveload::LnModBwdArgs a = bwd_args(dy, x, scale, mean, rstd, dx3, dscale, dshift,
                                          adaptiveload::dispatch::kPerSegment);
  a.cu_seqlens = cu.data_ptr<int32_t>();
  a.G = scale_in.size(0);
  run_bwd(a, x);
  return {dx, dscale, dshift};
}

}  // namespace

TORCH_LIBRARY(adaptiveload, m) {
  m.set_python_module("adaptiveload.ops.ln_modulate");
  m.def("ln_modulate_fwd(Tensor x, Tensor scale, Tensor shift, float eps) -> (Tensor, Tensor, "
        "Tensor)");
  m.def("ln_modulate_bwd(Tensor dy, Tensor x, Tensor scale, Tensor mean, Tensor rstd) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("ln_modulate_seg_fwd(Tensor x, Tensor scale, Tensor shift, Tensor cu_seqlens, float eps) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("ln_modulate_seg_bwd(Tensor dy, Tensor x, Tensor scale, Tensor cu_seqlens, Tensor mean, "
        "Tensor rstd) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(adaptiveload, CUDA, m) {
  m.impl("ln_modulate_fwd", &fwd_cuda);
  m.impl("ln_modulate_bwd", &bwd_cuda);
  m.impl("ln_modulate_seg_fwd", &seg_fwd_cuda);
  m.impl("ln_modulate_seg_bwd", &seg_bwd_cuda);
}
