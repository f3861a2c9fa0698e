// Forward: one row per thread-row of a CTA, the row held in registers in its storage format,
// fp32 two-pass statistics (mean, then the centred sum of squares on the register copy), then
// y = xhat * (1 + scale) + shift written with 16-byte stores. HBM traffic: read x, write y,
// 8 bytes of mean/rstd per row; scale/shift rows are re-read per row from L1/L2 (broadcast)
// or HBM (per token), and loaded only after the reductions to keep registers for occupancy.
// Segment layout: row r of the [L, D] stream reads the modulation row of its segment, found
// by a binary search of the offsets issued while the row's loads are in flight. A one-CTA
// kernel checks the offsets first (kept out of the row kernel: the assert's call costs
// registers there, ptxas spilled).
#include "ln_modulate_common.cuh"

namespace adaptiveload {
namespace {

using namespace detail;

using dispatch::kCheckThreads;

__global__ void __launch_bounds__(kCheckThreads)
    ln_mod_check_offsets(const int32_t* cu, int64_t G, int64_t L) {
  check_offsets(cu, G, L);
}

// The forward's parameters are its arguments (ln_modulate.h): it needs nothing else.
// (kMaxThreads, 1): up to 128 registers, as the bound alone allows; without the explicit
// minimum ptxas held the segment instance at 5 chunks to 64 registers and spilled
template <typename T, typename M, int CPT, bool SEGMENTS>
__global__ void __launch_bounds__(kMaxThreads, 1) ln_mod_fwd_kernel(const LnModFwdArgs p) {
  const int tx = threadIdx.x;
  const int tpr = blockDim.x;
  const int D = static_cast<int>(p.D);  // <= kMaxD (check_shape)
  const int nc = D / kPack;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool valid = row < p.B * p.S;
  // dense: sample b, position s; segments: the stream is B = 1, S = L, so b = 0 and s = row
  const int64_t b = SEGMENTS || !valid ? 0 : row / p.S;
  const int64_t s = !valid ? 0 : (SEGMENTS ? row : row % p.S);
  const T* xr = row_of<T>(p.x, b, s);

  Pack<T> xv[CPT];
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
    const int ch = c * tpr + tx;
    if (valid && ch < nc) xv[c] = load_pack<T>(xr + ch * kPack);
  }
  // the modulation row: the sample's (position s for per-token) or, searched while the row's
  // loads are in flight, the row's segment's (warp-uniform: a warp never straddles rows)
  const int64_t mod_b = SEGMENTS ? (valid ? find_segment(p.cu_seqlens, p.G, row) : 0) : b;
  const int64_t mod_s = SEGMENTS ? 0 : s;
  float acc[1] = {0.f};
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
    const int ch = c * tpr + tx;
    if (valid && ch < nc) {
      float f[kPack];
      unpack(xv[c], f);
#pragma unroll
      for (int i = 0; i < kPack; ++i) acc[0] += f[i];
    }
  }
  row_allreduce<1>(acc);
  const float inv_d = 1.f / static_cast<float>(D);
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

  const M* sc = row_of<M>(p.scale, mod_b, mod_s);
  const M* sh = row_of<M>(p.shift, mod_b, mod_s);
  T* yr = static_cast<T*>(p.y) + row * D;
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

template <typename T, typename M, int CPT, bool SEGMENTS>
const char* launch(const LnModFwdArgs& p, RowConfig cfg, cudaStream_t stream) {
  const dim3 block(cfg.tpr, cfg.rows);
  const int64_t blocks = (p.B * p.S + cfg.rows - 1) / cfg.rows;
  if (blocks > 0x7fffffffLL) return "ln_modulate_fwd: too many rows for one launch";
  if (SEGMENTS) {
    ln_mod_check_offsets<<<1, kCheckThreads, 0, stream>>>(p.cu_seqlens, p.G, p.S);
    if (const char* err = last_error()) return err;
  }
  ln_mod_fwd_kernel<T, M, CPT, SEGMENTS><<<static_cast<unsigned>(blocks), block, 0, stream>>>(p);
  return last_error();
}

template <typename T, typename M, bool SEGMENTS>
const char* dispatch_cpt(const LnModFwdArgs& p, RowConfig cfg, cudaStream_t stream) {
  switch (cfg.cpt) {
    case 4: return launch<T, M, 4, SEGMENTS>(p, cfg, stream);
    case 5: return launch<T, M, 5, SEGMENTS>(p, cfg, stream);
    case 6: return launch<T, M, 6, SEGMENTS>(p, cfg, stream);
    default: return "ln_modulate_fwd: internal error (no kernel for this chunk count)";
  }
}

template <typename T, typename M>
const char* dispatch_layout(const LnModFwdArgs& p, RowConfig cfg, cudaStream_t stream) {
  return p.cu_seqlens != nullptr ? dispatch_cpt<T, M, true>(p, cfg, stream)
                         : dispatch_cpt<T, M, false>(p, cfg, stream);
}

template <typename T>
const char* dispatch_mod(const LnModFwdArgs& p, RowConfig cfg, cudaStream_t stream) {
  if (p.mod_dtype == DType::kF32) return dispatch_layout<T, float>(p, cfg, stream);
  if (p.mod_dtype == p.x_dtype) return dispatch_layout<T, T>(p, cfg, stream);
  return "ln_modulate_fwd: scale/shift dtype must be float32 or x's dtype";
}

}  // namespace

const char* ln_modulate_fwd(const LnModFwdArgs& a, cudaStream_t stream) {
  if (const char* err = detail::check_shape(a.B, a.S, a.D)) return err;
  if (a.cu_seqlens != nullptr) {
    if (const char* err = detail::check_segments(a.cu_seqlens, a.B, a.S, a.G)) return err;
  }
  if (a.B == 0 || a.S == 0) return nullptr;
  const RowConfig cfg = dispatch::fwd_config(a.D);
  switch (a.x_dtype) {
    case DType::kF32: return dispatch_mod<float>(a, cfg, stream);
    case DType::kF16: return dispatch_mod<__half>(a, cfg, stream);
    case DType::kBF16: return dispatch_mod<__nv_bfloat16>(a, cfg, stream);
  }
  return "ln_modulate_fwd: x dtype must be float32, float16 or bfloat16";
}

}  // namespace adaptiveload
