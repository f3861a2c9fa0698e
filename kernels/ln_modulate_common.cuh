// Device helpers shared by the forward and backward kernels: 8-element packs moved with
// 16-byte loads/stores, fp32 conversion, and the row all-reduce.
//
// Thread mapping (both kernels): a CTA is blockDim = (tpr, rows). Threads tx = 0..tpr-1 of one
// threadIdx.y share one row; tpr is a multiple of 32, so a warp never straddles two rows.
// Thread tx owns the 8-element chunks ch = c * tpr + tx (c < CPT): for each c a warp touches
// a contiguous 32 x 16-byte span of the row (coalesced), and the chunk set a thread owns is
// the same for every row it visits (the backward's D-tile).
#pragma once

#include <cassert>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "ln_modulate.h"

namespace adaptiveload {
namespace detail {

using dispatch::kMaxThreads;  // per CTA; launch configs never exceed it
using dispatch::kPack;        // elements per chunk
using dispatch::RowConfig;
constexpr int kMaxWarps = kMaxThreads / 32;

// 8 elements of T in their storage format (16 bytes for fp16/bf16, 32 bytes for fp32).
template <typename T>
struct Pack {
  uint4 v;
};
template <>
struct Pack<float> {
  float4 a, b;
};

template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  Pack<T> r;
  r.v = *reinterpret_cast<const uint4*>(p);
  return r;
}
template <>
__device__ __forceinline__ Pack<float> load_pack<float>(const float* p) {
  Pack<float> r;
  r.a = *reinterpret_cast<const float4*>(p);
  r.b = *reinterpret_cast<const float4*>(p + 4);
  return r;
}

template <typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T>& r) {
  *reinterpret_cast<uint4*>(p) = r.v;
}
template <>
__device__ __forceinline__ void store_pack<float>(float* p, const Pack<float>& r) {
  *reinterpret_cast<float4*>(p) = r.a;
  *reinterpret_cast<float4*>(p + 4) = r.b;
}

__device__ __forceinline__ void unpack(const Pack<float>& r, float (&f)[kPack]) {
  f[0] = r.a.x; f[1] = r.a.y; f[2] = r.a.z; f[3] = r.a.w;
  f[4] = r.b.x; f[5] = r.b.y; f[6] = r.b.z; f[7] = r.b.w;
}
__device__ __forceinline__ void unpack(const Pack<__half>& r, float (&f)[kPack]) {
  const uint32_t w[4] = {r.v.x, r.v.y, r.v.z, r.v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h;
    memcpy(&h, &w[i], sizeof(h));
    const float2 t = __half22float2(h);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void unpack(const Pack<__nv_bfloat16>& r, float (&f)[kPack]) {
  const uint32_t w[4] = {r.v.x, r.v.y, r.v.z, r.v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __nv_bfloat162 h;
    memcpy(&h, &w[i], sizeof(h));
    const float2 t = __bfloat1622float2(h);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <typename T>
__device__ __forceinline__ Pack<T> pack(const float (&f)[kPack]);
template <>
__device__ __forceinline__ Pack<float> pack<float>(const float (&f)[kPack]) {
  Pack<float> r;
  r.a = make_float4(f[0], f[1], f[2], f[3]);
  r.b = make_float4(f[4], f[5], f[6], f[7]);
  return r;
}
template <>
__device__ __forceinline__ Pack<__half> pack<__half>(const float (&f)[kPack]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    memcpy(&w[i], &h, sizeof(h));
  }
  Pack<__half> r;
  r.v = make_uint4(w[0], w[1], w[2], w[3]);
  return r;
}
template <>
__device__ __forceinline__ Pack<__nv_bfloat16> pack<__nv_bfloat16>(const float (&f)[kPack]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    memcpy(&w[i], &h, sizeof(h));
  }
  Pack<__nv_bfloat16> r;
  r.v = make_uint4(w[0], w[1], w[2], w[3]);
  return r;
}

// A pack staged in shared memory as 16-byte slots `stride` uint4 apart (see the backward's
// cp.async pipeline): fp16/bf16 packs are one slot, fp32 packs two.
template <typename T>
__device__ __forceinline__ Pack<T> smem_pack(const uint4* slot, int /*stride*/) {
  Pack<T> r;
  r.v = *slot;
  return r;
}
template <>
__device__ __forceinline__ Pack<float> smem_pack<float>(const uint4* slot, int stride) {
  Pack<float> r;
  const uint4 a = slot[0], b = slot[stride];
  memcpy(&r.a, &a, sizeof(a));
  memcpy(&r.b, &b, sizeof(b));
  return r;
}

// 16-byte global -> shared copy that does not wait (cp.async, sm_80+; L2 only, no L1 fill).
// Completion is per thread: after cp_async_wait<N>() the issuing thread may read its slots.
__device__ __forceinline__ void cp_async16(uint4* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
#else
  *smem = *static_cast<const uint4*>(gmem);
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Row (b, s) of a [B, S, D] operand, as T.
template <typename T>
__device__ __forceinline__ const T* row_of(const Rows& r, int64_t b, int64_t s) {
  return static_cast<const T*>(r.ptr) + b * r.sb + s * r.ss;
}

template <typename T>
__device__ __forceinline__ void load_floats(const T* p, float (&f)[kPack]) {
  unpack(load_pack<T>(p), f);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Sum N values over the tpr threads of this thread's row; every thread gets the totals.
// Must be reached by ALL threads of the CTA (it may contain __syncthreads): callers keep
// their loops CTA-uniform and mask work with a `valid` flag instead of returning early.
// The summation order is fixed, so results are bitwise reproducible.
template <int N>
__device__ __forceinline__ void row_allreduce(float (&v)[N]) {
  __shared__ float red[N][kMaxWarps];
#pragma unroll
  for (int k = 0; k < N; ++k) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
  }
  const int wpr = blockDim.x >> 5;  // warps per row (CTA-uniform)
  if (wpr == 1) return;
  const int lane = threadIdx.x & 31;
  const int first = threadIdx.y * wpr;  // this row's slots
  __syncthreads();                      // previous readers of `red` are done
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) red[k][first + (threadIdx.x >> 5)] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < N; ++k) {
    float s = 0.f;
    for (int w = 0; w < wpr; ++w) s += red[k][first + w];
    v[k] = s;
  }
}

// --- segments ----------------------------------------------------------------------------

// The segment holding stream row r: the last g in [0, G) with cu[g] <= r (binary search; the
// offsets are a few hundred bytes, L1/L2-resident). Clamped to [0, G), so offsets that break
// the rules can give a wrong segment but never an out-of-bounds one.
__device__ __forceinline__ int64_t find_segment(const int32_t* cu, int64_t G, int64_t r) {
  int64_t lo = 0, hi = G;  // for valid offsets: cu[lo] <= r < cu[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (__ldg(cu + mid) <= r) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// The offset rules (0 = cu[0] <= cu[1] <= ... <= cu[G] = L) checked on the device by one CTA
// (the caller's block 0): breaking them stops the kernel with a device-side assert, which
// the host sees as a CUDA error, instead of a silently wrong result. Costs G loads spread
// over the CTA; no barrier.
__device__ __forceinline__ void check_offsets(const int32_t* cu, int64_t G, int64_t L) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nthr = blockDim.x * blockDim.y;
  bool ok = tid != 0 || (cu[0] == 0 && cu[G] == L);
  for (int64_t i = tid; i < G; i += nthr) ok = ok && cu[i] <= cu[i + 1];
  if (!ok)
    __assert_fail("ln_modulate_segments: cu_seqlens must be 0 = cu[0] <= ... <= cu[G] = L",
                  __FILE__, __LINE__, __func__);
}

static_assert(kMaxD == 8192, "update check_shape's message");
inline const char* check_shape(int64_t B, int64_t S, int64_t D) {
  if (D % kPack != 0 || D < kPack || D > kMaxD)
    return "ln_modulate: D must be a multiple of 8 in [8, 8192]";
  if (B < 0 || S < 0) return "ln_modulate: negative B or S";
  return nullptr;
}

// The segment layout's shape rules beyond check_shape (B = 1, S = L).
inline const char* check_segments(const int32_t* cu, int64_t B, int64_t S, int64_t G) {
  if (cu == nullptr) return "ln_modulate_segments: cu_seqlens missing";
  if (B != 1) return "ln_modulate_segments: the token stream is passed as B = 1, S = L";
  if (S > 0x7fffffffLL) return "ln_modulate_segments: L must be < 2**31 (int32 offsets)";
  if (G < 0 || (G == 0 && S > 0)) return "ln_modulate_segments: L > 0 rows need G >= 1";
  if (G > dispatch::kMaxGridY) return "ln_modulate_segments: at most 65535 segments per call";
  return nullptr;
}

inline const char* last_error() {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace detail
}  // namespace adaptiveload
