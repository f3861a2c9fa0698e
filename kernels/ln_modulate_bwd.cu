// Backward in one pass over (x, dy): with g = dy * (1 + scale) and xhat = (x - mean) * rstd,
//   dx     = rstd * (g - mean_D(g) - xhat * mean_D(g * xhat))        (one 2-value row reduction)
//   dshift = sum_s dy,  dscale = sum_s dy * xhat                      (per sample, [B, 1, D])
// or, for per-token modulation, dshift = dy and dscale = dy * xhat elementwise.
//
// D-tile reduction (broadcast modulation): the grid is B x P persistent CTAs; CTA (b, p) owns a
// contiguous range of rows of sample b only. Each thread owns a fixed set of columns (its
// chunks) and accumulates dy and dy * xhat for them in fp32 registers over every row it
// visits, so the column sums ride on the loads dx needs anyway. At the end every thread-row
// writes its fp32 partial row to workspace [2, B, P * rows, D]; a finalize kernel sums the
// partials in a fixed order. No atomics: results are bitwise reproducible on a given GPU.
#include "ln_modulate_common.cuh"

namespace adaptiveload {
namespace {

using namespace detail;

struct BwdParams {
  const void* dy;
  int64_t dy_sb, dy_ss;
  const void* x;
  int64_t x_sb, x_ss;
  const void* scale;
  int64_t scale_sb, scale_ss;
  const float* mean;
  const float* rstd;
  void* dx;
  void* dscale;
  void* dshift;
  float* workspace;
  int64_t B, S;
  int64_t parts;  // CTAs per sample (P)
  int64_t span;   // rows of one sample per CTA
  int D;
};

template <typename T, typename M, int CPT, bool PER_TOKEN>
__global__ void __launch_bounds__(kMaxThreads) ln_mod_bwd_kernel(const BwdParams p) {
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int tpr = blockDim.x;
  const int rows = blockDim.y;
  const int nc = p.D / kPack;
  const int64_t b = blockIdx.x / p.parts;
  const int64_t part = blockIdx.x % p.parts;
  const int64_t s0 = part * p.span;
  const int64_t s1 = s0 + p.span < p.S ? s0 + p.span : p.S;
  const float inv_d = 1.f / static_cast<float>(p.D);

  // dscale/dshift column sums for the owned columns (broadcast modulation only)
  float acc_ds[CPT][kPack];
  float acc_dsh[CPT][kPack];
#pragma unroll
  for (int c = 0; c < CPT; ++c) {
#pragma unroll
    for (int i = 0; i < kPack; ++i) {
      acc_ds[c][i] = 0.f;
      acc_dsh[c][i] = 0.f;
    }
  }

  for (int64_t base = s0; base < s1; base += rows) {  // CTA-uniform trip count
    const int64_t s = base + ty;
    const bool valid = s < s1;
    const int64_t row = b * p.S + s;
    Pack<T> xv[CPT], dv[CPT];
    float gam[CPT][kPack];  // 1 + scale; a broadcast row (scale_ss = 0) is an L1 hit
    float mean = 0.f, rstd = 0.f;
    if (valid) {
      mean = p.mean[row];
      rstd = p.rstd[row];
      const T* xr = static_cast<const T*>(p.x) + b * p.x_sb + s * p.x_ss;
      const T* dr = static_cast<const T*>(p.dy) + b * p.dy_sb + s * p.dy_ss;
      const M* sc = static_cast<const M*>(p.scale) + b * p.scale_sb + s * p.scale_ss;
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const int ch = c * tpr + tx;
        if (ch < nc) {
          xv[c] = load_pack<T>(xr + ch * kPack);
          dv[c] = load_pack<T>(dr + ch * kPack);
          load_floats<M>(sc + ch * kPack, gam[c]);
#pragma unroll
          for (int i = 0; i < kPack; ++i) gam[c][i] += 1.f;
        }
      }
    }

    float red[2] = {0.f, 0.f};  // sum g, sum g * xhat
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
      const int ch = c * tpr + tx;
      if (valid && ch < nc) {
        float xf[kPack], df[kPack];
        unpack(xv[c], xf);
        unpack(dv[c], df);
#pragma unroll
        for (int i = 0; i < kPack; ++i) {
          const float xh = (xf[i] - mean) * rstd;
          const float g = df[i] * gam[c][i];
          red[0] += g;
          red[1] += g * xh;
          if (!PER_TOKEN) {
            acc_dsh[c][i] += df[i];
            acc_ds[c][i] += df[i] * xh;
          }
        }
      }
    }
    row_allreduce<2>(red);
    const float c1 = red[0] * inv_d;
    const float c2 = red[1] * inv_d;

    if (valid) {
      T* dxr = static_cast<T*>(p.dx) + row * p.D;
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const int ch = c * tpr + tx;
        if (ch < nc) {
          float xf[kPack], df[kPack], out[kPack];
          unpack(xv[c], xf);
          unpack(dv[c], df);
#pragma unroll
          for (int i = 0; i < kPack; ++i) {
            const float xh = (xf[i] - mean) * rstd;
            out[i] = rstd * (df[i] * gam[c][i] - c1 - xh * c2);
          }
          store_pack<T>(dxr + ch * kPack, pack<T>(out));
          if (PER_TOKEN) {
            float ds[kPack];
#pragma unroll
            for (int i = 0; i < kPack; ++i) ds[i] = df[i] * ((xf[i] - mean) * rstd);
            store_pack<M>(static_cast<M*>(p.dscale) + row * p.D + ch * kPack, pack<M>(ds));
            store_pack<M>(static_cast<M*>(p.dshift) + row * p.D + ch * kPack, pack<M>(df));
          }
        }
      }
    }
  }

  if (!PER_TOKEN) {
    const int64_t q_total = p.parts * rows;
    const int64_t q = part * rows + ty;
    float* wds = p.workspace + ((0 * p.B + b) * q_total + q) * p.D;
    float* wdsh = p.workspace + ((1 * p.B + b) * q_total + q) * p.D;
#pragma unroll
    for (int c = 0; c < CPT; ++c) {
      const int ch = c * tpr + tx;
      if (ch < nc) {
        store_pack<float>(wds + ch * kPack, pack<float>(acc_ds[c]));
        store_pack<float>(wdsh + ch * kPack, pack<float>(acc_dsh[c]));
      }
    }
  }
}

// Column sums of the partials: grid (ceil(D / 128), B, 2 = {dscale, dshift}), block (32, 8).
// Lane x owns 4 columns (one float4), the 8 warps stride over the partial rows, then warp 0
// adds the 8 warp sums in order. Reads 2 * B * Q * D * 4 bytes (a few MB).
constexpr int kFinWarps = 8;

template <typename M>
__global__ void __launch_bounds__(32 * kFinWarps)
    ln_mod_bwd_finalize(const float* __restrict__ ws, M* dscale, M* dshift, int64_t B,
                        int64_t Q, int D) {
  __shared__ float4 sums[kFinWarps][32];
  const int which = blockIdx.z;
  const int64_t b = blockIdx.y;
  const int col = (blockIdx.x * 32 + threadIdx.x) * 4;
  const float* src = ws + (which * B + b) * Q * D;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (col < D) {
    for (int64_t q = threadIdx.y; q < Q; q += kFinWarps) {
      const float4 v = *reinterpret_cast<const float4*>(src + q * D + col);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || col >= D) return;
  float4 t = sums[0][threadIdx.x];
  for (int w = 1; w < kFinWarps; ++w) {
    const float4 v = sums[w][threadIdx.x];
    t.x += v.x;
    t.y += v.y;
    t.z += v.z;
    t.w += v.w;
  }
  M* out = (which == 0 ? dscale : dshift) + b * D + col;
  out[0] = from_float<M>(t.x);
  out[1] = from_float<M>(t.y);
  out[2] = from_float<M>(t.z);
  out[3] = from_float<M>(t.w);
}

// ~16 elements per thread keeps x, dy, (1 + scale) and the two accumulators in registers.
RowConfig bwd_config(int64_t D) {
  if (D == 1536) return {96, 2, 2};
  if (D == 5120) return {320, 2, 1};
  return D <= 8192 ? generic_config(D, 2) : generic_config(D, 4);
}

template <typename T, typename M, int CPT, bool PER_TOKEN>
const void* kernel_ptr() {
  return reinterpret_cast<const void*>(&ln_mod_bwd_kernel<T, M, CPT, PER_TOKEN>);
}

// Persistent grid: as many CTAs as fit on the GPU at once, split evenly over the samples;
// each CTA gets >= `rows` rows so no thread-row idles for the whole kernel.
struct Plan {
  RowConfig cfg;
  int64_t parts, span;
};

const char* make_plan(const LnModBwdArgs& a, const void* kernel, Plan* plan) {
  plan->cfg = bwd_config(a.D);
  int dev = 0, sms = 0, occ = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel,
                                                      plan->cfg.tpr * plan->cfg.rows, 0);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const int64_t ctas = static_cast<int64_t>(sms) * (occ > 0 ? occ : 1);
  const int64_t max_parts = (a.S + plan->cfg.rows - 1) / plan->cfg.rows;
  int64_t parts = (ctas + a.B - 1) / a.B;
  parts = parts < 1 ? 1 : (parts > max_parts ? max_parts : parts);
  plan->span = (a.S + parts - 1) / parts;
  plan->parts = (a.S + plan->span - 1) / plan->span;  // no CTA with an empty range
  return nullptr;
}

template <typename T, typename M, int CPT, bool PER_TOKEN>
const char* run(const LnModBwdArgs& a, const Plan& plan, cudaStream_t stream) {
  if (!PER_TOKEN && a.B > 65535) return "ln_modulate_bwd: at most 65535 samples per call";
  const BwdParams p{a.dy,     a.dy_sb,    a.dy_ss,  a.x,          a.x_sb,       a.x_ss,
                    a.scale,  a.scale_sb, a.scale_ss, a.mean,     a.rstd,       a.dx,
                    a.dscale, a.dshift,   a.workspace, a.B,       a.S,          plan.parts,
                    plan.span, static_cast<int>(a.D)};
  const int64_t blocks = a.B * plan.parts;
  if (blocks > 0x7fffffffLL) return "ln_modulate_bwd: too many CTAs for one launch";
  const dim3 block(plan.cfg.tpr, plan.cfg.rows);
  ln_mod_bwd_kernel<T, M, CPT, PER_TOKEN><<<static_cast<unsigned>(blocks), block, 0, stream>>>(p);
  if (const char* err = last_error()) return err;
  if (PER_TOKEN) return nullptr;
  const dim3 fgrid((a.D / 4 + 31) / 32, static_cast<unsigned>(a.B), 2);
  ln_mod_bwd_finalize<M><<<fgrid, dim3(32, kFinWarps), 0, stream>>>(
      a.workspace, static_cast<M*>(a.dscale), static_cast<M*>(a.dshift), a.B,
      plan.parts * plan.cfg.rows, static_cast<int>(a.D));
  return last_error();
}

// Both entry points (workspace size and run) go through here so they agree on the plan.
template <typename T, typename M, int CPT, bool PER_TOKEN>
const char* plan_and_maybe_run(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  Plan plan;
  if (const char* err = make_plan(a, kernel_ptr<T, M, CPT, PER_TOKEN>(), &plan)) return err;
  if (floats != nullptr) {
    *floats = PER_TOKEN ? 0 : 2 * a.B * plan.parts * plan.cfg.rows * a.D;
    return nullptr;
  }
  if (!PER_TOKEN && a.workspace == nullptr) return "ln_modulate_bwd: workspace missing";
  return run<T, M, CPT, PER_TOKEN>(a, plan, stream);
}

template <typename T, typename M, int CPT>
const char* dispatch_layout(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  return a.per_token ? plan_and_maybe_run<T, M, CPT, true>(a, stream, floats)
                     : plan_and_maybe_run<T, M, CPT, false>(a, stream, floats);
}

template <typename T, typename M>
const char* dispatch_cpt(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  switch (bwd_config(a.D).cpt) {
    case 2: return dispatch_layout<T, M, 2>(a, stream, floats);
    case 4: return dispatch_layout<T, M, 4>(a, stream, floats);
    default: return "ln_modulate_bwd: internal error (no kernel for this chunk count)";
  }
}

template <typename T>
const char* dispatch_mod(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  if (a.mod_dtype == DType::kF32) return dispatch_cpt<T, float>(a, stream, floats);
  if (a.mod_dtype == a.x_dtype) return dispatch_cpt<T, T>(a, stream, floats);
  return "ln_modulate_bwd: scale dtype must be float32 or x's dtype";
}

const char* dispatch(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  if (const char* err = detail::check_shape(a.B, a.S, a.D)) return err;
  if (a.B == 0 || a.S == 0) {
    if (floats != nullptr) *floats = 0;
    return nullptr;
  }
  switch (a.x_dtype) {
    case DType::kF32: return dispatch_mod<float>(a, stream, floats);
    case DType::kF16: return dispatch_mod<__half>(a, stream, floats);
    case DType::kBF16: return dispatch_mod<__nv_bfloat16>(a, stream, floats);
  }
  return "ln_modulate_bwd: x dtype must be float32, float16 or bfloat16";
}

}  // namespace

const char* ln_modulate_bwd_workspace(const LnModBwdArgs& args, int64_t* floats) {
  return dispatch(args, nullptr, floats);
}

const char* ln_modulate_bwd(const LnModBwdArgs& args, cudaStream_t stream) {
  return dispatch(args, stream, nullptr);
}

}  // namespace adaptiveload
