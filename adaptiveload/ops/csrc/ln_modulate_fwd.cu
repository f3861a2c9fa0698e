// Forward: one row per thread-row of a CTA, the row held in registers in its storage format,
// fp32 two-pass statistics (mean, then the centred sum of squares on the register copy), then
// y = xhat * (1 + scale) + shift written with 16-byte stores. HBM traffic: read x, write y,
// 8 bytes of mean/rstd per row; scale/shift rows are re-read per row from L1/L2 (broadcast)
// or HBM (per token), and loaded only after the reductions to keep registers for occupancy.
#include "ln_modulate_common.cuh"

namespace adaptiveload {
namespace {

using namespace detail;

struct FwdParams {
  const void* x;
  int64_t x_sb, x_ss;
  const void* scale;
  int64_t scale_sb, scale_ss;
  const void* shift;
  int64_t shift_sb, shift_ss;
  void* y;
  float* mean;
  float* rstd;
  int64_t rows, S;
  int D;
  float eps;
};

template <typename T, typename M, int CPT>
__global__ void __launch_bounds__(kMaxThreads) ln_mod_fwd_kernel(const FwdParams p) {
  const int tx = threadIdx.x;
  const int tpr = blockDim.x;
  const int nc = p.D / kPack;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < p.rows;
  const int64_t b = valid ? row / p.S : 0;
  const int64_t s = valid ? row % p.S : 0;
  const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + s * p.x_ss;

  Pack<T> xv[CPT];
  float acc[1] = {0.f};
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
    const int ch = c * tpr + tx;
    if (valid && ch < nc) {
      xv[c] = load_pack<T>(xr + ch * kPack);
      float f[kPack];
      unpack(xv[c], f);
#pragma unroll
      for (int i = 0; i < kPack; ++i) acc[0] += f[i];
    }
  }
  row_allreduce<1>(acc);
  const float inv_d = 1.f / static_cast<float>(p.D);
  const float mean = acc[0] * inv_d;

  acc[0] = 0.f;
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
    const int ch = c * tpr + tx;
    if (valid && ch < nc) {
      float f[kPack];
      unpack(xv[c], f);
#pragma unroll
      for (int i = 0; i < kPack; ++i) {
        const float d = f[i] - mean;
        acc[0] += d * d;
      }
    }
  }
  row_allreduce<1>(acc);
  const float rstd = rsqrtf(acc[0] * inv_d + p.eps);
  if (!valid) return;  // no CTA-wide barrier below this point
  if (tx == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }

  const M* sc = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;
  const M* sh = static_cast<const M*>(p.shift) + b * p.shift_sb + s * p.shift_ss;
  T* yr = static_cast<T*>(p.y) + row * p.D;
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
    const int ch = c * tpr + tx;
    if (ch < nc) {
      float f[kPack], g[kPack], h[kPack];
      unpack(xv[c], f);
      load_floats<M>(sc + ch * kPack, g);
      load_floats<M>(sh + ch * kPack, h);
#pragma unroll
      for (int i = 0; i < kPack; ++i) f[i] = fmaf((f[i] - mean) * rstd, 1.f + g[i], h[i]);
      store_pack<T>(yr + ch * kPack, pack<T>(f));
    }
  }
}

template <typename T, typename M, int CPT>
const char* launch(const FwdParams& p, RowConfig cfg, cudaStream_t stream) {
  const dim3 block(cfg.tpr, cfg.rows);
  const int64_t blocks = (p.rows + cfg.rows - 1) / cfg.rows;
  if (blocks > 0x7fffffffLL) return "ln_modulate_fwd: too many rows for one launch";
  ln_mod_fwd_kernel<T, M, CPT><<<static_cast<unsigned>(blocks), block, 0, stream>>>(p);
  return last_error();
}

template <typename T, typename M>
const char* dispatch_cpt(const FwdParams& p, RowConfig cfg, cudaStream_t stream) {
  switch (cfg.cpt) {
    case 4: return launch<T, M, 4>(p, cfg, stream);
    case 5: return launch<T, M, 5>(p, cfg, stream);
    case 6: return launch<T, M, 6>(p, cfg, stream);
    default: return "ln_modulate_fwd: internal error (no kernel for this chunk count)";
  }
}

template <typename T>
const char* dispatch_mod(const FwdParams& p, RowConfig cfg, DType x_dtype, DType mod_dtype,
                         cudaStream_t stream) {
  if (mod_dtype == DType::kF32) return dispatch_cpt<T, float>(p, cfg, stream);
  if (mod_dtype == x_dtype) return dispatch_cpt<T, T>(p, cfg, stream);
  return "ln_modulate_fwd: scale/shift dtype must be float32 or x's dtype";
}

}  // namespace

const char* ln_modulate_fwd(const LnModFwdArgs& a, cudaStream_t stream) {
  if (const char* err = detail::check_shape(a.B, a.S, a.D)) return err;
  if (a.B == 0 || a.S == 0) return nullptr;
  const FwdParams p{a.x,     a.x_sb,    a.x_ss, a.scale, a.scale_sb,         a.scale_ss,
                    a.shift, a.shift_sb, a.shift_ss, a.y, a.mean, a.rstd, a.B * a.S, a.S,
                    static_cast<int>(a.D), a.eps};
  const RowConfig cfg = dispatch::fwd_config(a.D);
  switch (a.x_dtype) {
    case DType::kF32: return dispatch_mod<float>(p, cfg, a.x_dtype, a.mod_dtype, stream);
    case DType::kF16: return dispatch_mod<__half>(p, cfg, a.x_dtype, a.mod_dtype, stream);
    case DType::kBF16:
      return dispatch_mod<__nv_bfloat16>(p, cfg, a.x_dtype, a.mod_dtype, stream);
  }
  return "ln_modulate_fwd: x dtype must be float32, float16 or bfloat16";
}

}  // namespace adaptiveload
