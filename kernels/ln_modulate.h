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
// passed as B = 1, S = L (x.sb unused, x.ss the row stride); scale/shift are [G, D] with row
// stride scale.sb (scale.ss = 0); cu_seqlens holds G + 1 int32 offsets, 0 = cu[0] <= ... <=
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

// One [B, S, D] operand read by rows: row (b, s) starts at ptr + b * sb + s * ss (elements);
// a size-1 dimension has stride 0 (it is never stepped over).
struct Rows {
  const void* ptr;
  int64_t sb, ss;
};

// The arguments the forward and the backward share, which each direction's struct extends
// (as flash-attention's Flash_fwd_params and Flash_bwd_params extend Qkv_params): the input
// x, the scale modulation, the shape, the dtypes and the segment offsets. The kernels take
// these structs as their parameters; the backward's adds its launch plan.
struct LnModArgs {
  Rows x;
  Rows scale;
  int64_t B, S, D;
  DType x_dtype;
  DType mod_dtype;            // scale (and shift): kF32 or x_dtype
  const int32_t* cu_seqlens;  // segment layout only (else nullptr)
  int64_t G;                  // segments
};

// Forward: adds the shift modulation, the outputs and eps.
struct LnModFwdArgs : LnModArgs {
  Rows shift;
  void* y;
  float* mean;
  float* rstd;
  float eps;
};

// Backward: adds dy, the forward's statistics, the gradients and the layout.
struct LnModBwdArgs : LnModArgs {
  Rows dy;
  const float* mean;
  const float* rstd;
  void* dx;
  void* dscale;
  void* dshift;
  float* workspace;  // per sample or segment: ln_modulate_bwd_workspace() floats
  int layout;        // dispatch::kPerSample, kPerToken or kPerSegment (segments: cu_seqlens set)
};

// All functions return nullptr on success, else a static message (validation or CUDA error).
const char* ln_modulate_fwd(const LnModFwdArgs& args, cudaStream_t stream);

// fp32 floats of scratch the backward needs (0 for per-token modulation; for segments four
// partial rows per tile of the plan, known from L alone: the offsets stay on the device). Depends on the
// current device's SM count; call on the device that will run the backward.
const char* ln_modulate_bwd_workspace(const LnModBwdArgs& args, int64_t* floats);

const char* ln_modulate_bwd(const LnModBwdArgs& args, cudaStream_t stream);

}  // namespace adaptiveload
