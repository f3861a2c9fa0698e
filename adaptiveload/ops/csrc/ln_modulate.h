// Fused LayerNorm-Modulate, y = LayerNorm(x) * (1 + scale) + shift, forward and backward.
//
// Plain C++/CUDA interface (raw pointers, element strides, a dtype enum, a stream): no torch
// headers here or in the .cu files, so nvcc compiles them in seconds. The torch binding
// (ln_modulate_binding.cpp) validates tensors, allocates outputs and calls these functions.
//
// Layouts (all strides in elements; the last dimension is always contiguous):
//   x, dy          [B, S, D]  row (b, s) starts at b*sb + s*ss; base and row strides 16-byte aligned
//   scale, shift   [B, 1, D] (ss = 0, "broadcast") or [B, S, D] ("per token"); same alignment rule
//   y, dx          [B, S, D]  contiguous, x's dtype
//   mean, rstd     [B, S]     contiguous fp32
//   dscale, dshift contiguous, scale's dtype: [B, 1, D] (broadcast) or [B, S, D] (per token)
//
// Segment layout (cu_seqlens set): x, dy, y, dx are the [L, D] token stream of G segments,
// passed as B = 1, S = L (x_sb unused, x_ss the row stride); scale/shift are [G, D] with row
// stride scale_sb (scale_ss = 0); cu_seqlens holds G + 1 int32 offsets, 0 = cu[0] <= ... <=
// cu[G] = L, on the device; mean, rstd are [L]; dscale, dshift [G, D] contiguous (per-segment
// sums). The kernels check the offsets on the device (a device-side assert if they break the
// rules) and never read or write out of bounds whatever their values.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "ln_modulate_dispatch.h"

namespace adaptiveload {

enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// D must be a multiple of 8 (one 16-byte vector of bf16/fp16) within [8, kMaxD].
using dispatch::kMaxD;

struct LnModFwdArgs {
  const void* x;
  int64_t x_sb, x_ss;
  const void* scale;
  int64_t scale_sb, scale_ss;
  const void* shift;
  int64_t shift_sb, shift_ss;
  void* y;
  float* mean;
  float* rstd;
  int64_t B, S, D;
  float eps;
  DType x_dtype;
  DType mod_dtype;  // scale and shift: kF32 or x_dtype
  const int32_t* cu_seqlens;  // segment layout only (else nullptr)
  int64_t G;                  // segments
};

struct LnModBwdArgs {
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
  float* workspace;  // per sample or segment: ln_modulate_bwd_workspace() floats
  int64_t B, S, D;
  int layout;  // dispatch::kPerSample, kPerToken or kPerSegment
  DType x_dtype;
  DType mod_dtype;
  const int32_t* cu_seqlens;  // kPerSegment only
  int64_t G;
};

// All functions return nullptr on success, else a static message (validation or CUDA error).
const char* ln_modulate_fwd(const LnModFwdArgs& args, cudaStream_t stream);

// fp32 floats of scratch the backward needs (0 for per-token modulation; for segments four
// partial rows per tile of the plan, known from L alone: the offsets stay on the device). Depends on the
// current device's SM count; call on the device that will run the backward.
const char* ln_modulate_bwd_workspace(const LnModBwdArgs& args, int64_t* floats);

const char* ln_modulate_bwd(const LnModBwdArgs& args, cudaStream_t stream);

}  // namespace adaptiveload
