// The dispatch table of the fused LayerNorm-Modulate kernels: for a hidden size D and the
// element sizes, which kernel instance runs with how many threads and how much dynamic shared
// memory. Plain host C++ (no CUDA, no torch), so three readers share ONE copy of the rules:
//   - ln_modulate_fwd.cu / ln_modulate_bwd.cu pick their launch from it;
//   - ln_modulate_dispatch_table.cpp prints it for every supported D (the CPU resource check,
//     adaptiveload/ops/kernel_resources.py, compares every printed choice with what ptxas
//     reports for that instance: registers x threads, shared memory, spills);
//   - the Python validator's D limit is checked against kMaxD by that same test.
#pragma once

#include <cstddef>
#include <cstdint>

namespace adaptiveload {
namespace dispatch {

constexpr int kPack = 8;            // elements per 16-byte chunk of bf16/fp16 (8 of fp32: 32 B)
constexpr int64_t kMaxD = 8192;     // largest supported hidden size (a multiple of kPack)
constexpr int kMaxThreads = 512;    // __launch_bounds__ of the kernels: <= 128 registers each
constexpr int kWarp = 32;

// sm_90 limits the resource check holds every instance to (CUDA C Programming Guide, compute
// capability 9.0): 64 K 32-bit registers per SM and per CTA, 48 KB of shared memory per CTA
// without opting in, 227 KB with cudaFuncAttributeMaxDynamicSharedMemorySize.
constexpr int kRegistersPerCta = 65536;
constexpr size_t kSmemDefault = 48 * 1024;
constexpr size_t kSmemOptInMax = 227 * 1024;

// Modulation layouts (the backward's LAYOUT template argument; the forward only tells
// segments apart): per sample [B, 1, D], per token [B, S, D], or per segment [G, D] of an
// [L, D] token stream with int32 offsets cu_seqlens [G + 1].
constexpr int kPerSample = 0;
constexpr int kPerToken = 1;
constexpr int kPerSegment = 2;

// Launch shape: tpr threads per row (a multiple of 32, so a warp never straddles two rows),
// cpt 8-element chunks per thread, rows per CTA.
struct RowConfig {
  int tpr;
  int cpt;
  int rows;
};

constexpr int round_up(int v, int m) { return (v + m - 1) / m * m; }

constexpr RowConfig generic_config(int64_t D, int cpt) {
  const int nc = static_cast<int>(D / kPack);
  const int tpr = round_up((nc + cpt - 1) / cpt, kWarp);
  return {tpr, cpt, tpr >= 128 ? 1 : 128 / tpr};
}

// Forward: the row in registers. Tuned shapes first (TransformerEngine's table: a warp per row
// at 1536, 4 warps at 5120), otherwise 4 chunks (32 elements) per thread: <= 256 threads.
constexpr RowConfig fwd_config(int64_t D) {
  if (D == 1536) return {32, 6, 4};
  if (D == 5120) return {128, 5, 2};
  return generic_config(D, 4);
}

// Backward: 2 chunks (16 elements) per thread keep x, dy, (1 + scale) and the two column
// accumulators in registers without spilling at any D <= kMaxD (<= 512 threads). 4 chunks
// per thread spilled 136-484 bytes per thread at 128 registers (ptxas, sm_90), so there is no
// such instance and D stops at kMaxD.
constexpr int kBwdCpt = 2;
constexpr RowConfig bwd_config(int64_t D) {
  if (D == 1536) return {96, kBwdCpt, 2};
  if (D == 5120) return {320, kBwdCpt, 1};
  return generic_config(D, kBwdCpt);
}

// The backward's cp.async pipeline: STAGES rows of x and dy per thread in shared memory.
constexpr int kBwdStages = 4;                 // the current row + 3 rows in flight per thread
constexpr size_t kMaxPipeSmem = 100 * 1024;   // per CTA; larger configurations run unpipelined

// 16-byte shared-memory slots one thread needs per pipeline stage (an x and a dy pack).
constexpr int bwd_stage_slots(int x_bytes, int cpt) { return 2 * cpt * (kPack * x_bytes / 16); }

constexpr size_t bwd_pipe_smem(int x_bytes, RowConfig cfg, int stages) {
  return static_cast<size_t>(stages) * bwd_stage_slots(x_bytes, cfg.cpt) * cfg.tpr * cfg.rows *
         16;
}

// Stages of the instance that runs (0: unpipelined); `pipeline` is false when the environment
// asks for the unpipelined kernel (A/B measurements).
constexpr int bwd_stages(int64_t D, int x_bytes, bool pipeline) {
  return pipeline && bwd_pipe_smem(x_bytes, bwd_config(D), kBwdStages) <= kMaxPipeSmem
             ? kBwdStages
             : 0;
}

// 16-bit x, 2 chunks per thread, pipelined: fits 96 registers without spilling (ptxas -v,
// sm_90), so two 320-thread CTAs share an SM at D = 5120 instead of one. The unpipelined
// variant with fp32 modulation spilled 4 bytes at 96, so it keeps the 128-register budget.
constexpr int kLeanRegisters = 96;
constexpr bool bwd_lean(int x_bytes, int cpt, int stages) {
  return x_bytes == 2 && cpt == 2 && stages > 0;
}

// Any dynamic shared memory: opt the kernel in to kMaxPipeSmem. Static + dynamic shared memory
// above 48 KB needs the opt-in, and the static part (the row reduction's scratch) is not known
// here, so every pipelined kernel opts in: 48 KB of pipeline + 128 B of static scratch at
// D = 1536 is what failed to launch without it.
constexpr bool smem_opt_in(size_t dynamic_smem) { return dynamic_smem > 0; }

// Column-sum finalize kernels of the per-sample and per-segment backward: (32, kFinWarps)
// threads, one grid row per sample or segment (gridDim.y <= 65535).
constexpr int kFinWarps = 8;
constexpr int64_t kMaxGridY = 65535;

// The one-CTA check of the segment offsets before the forward.
constexpr int kCheckThreads = 256;

}  // namespace dispatch
}  // namespace adaptiveload
