// Backward in one pass over (x, dy): with g = dy * (1 + scale) and xhat = (x - mean) * rstd,
//   dx     = rstd * (g - mean_D(g) - xhat * mean_D(g * xhat))        (one 2-value row reduction)
//   dshift = sum_s dy,  dscale = sum_s dy * xhat                      (per sample, [B, 1, D])
// or, for per-token modulation, dshift = dy and dscale = dy * xhat elementwise, or, for
// segments of an [L, D] stream, dshift[g] = sum over segment g's rows of dy (and dscale[g]).
//
// D-tile reduction (broadcast modulation): the grid is B x P persistent CTAs; CTA (b, p) owns a
// contiguous range of rows of sample b only. Each thread owns a fixed set of columns (its
// chunks) and accumulates dy and dy * xhat for them in fp32 registers over every row it
// visits, so the column sums ride on the loads dx needs anyway. At the end every thread-row
// writes its fp32 partial row to workspace [2, B, P * rows, D]; a finalize kernel sums the
// partials in a fixed order. No atomics: results are bitwise reproducible on a given GPU.
//
// Segments: every segment is cut into chunks of at most T rows (segment g has ceil(len_g / T)),
// one chunk per thread-row, which accumulates its rows exactly like a CTA range of one sample
// and writes one fp32 partial row (workspace [2, V, D], V the upper bound ceil(L / T) + G on
// the chunks, then G int32: each segment's first chunk, written by the thread-row owning
// it). A thread-row finds its chunk by a scan of the offsets on the device, so the loop over
// rows is the per-sample one and costs no register more; the host never reads the offsets.
// A finalize kernel sums, per segment, its chunks' partials in a fixed order (zeros for an
// empty segment) and checks the offsets (a device-side assert).
//
// Latency hiding: the accumulators cost registers, so few warps fit per SM. With STAGES > 0
// each thread streams the x and dy rows it will need STAGES-1 rows ahead into its own
// shared-memory slots with cp.async (no registers held, no CTA barrier: a thread only reads
// slots it filled), keeping several rows of loads in flight per thread.
#include <cstdlib>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "ln_modulate_common.cuh"

namespace adaptiveload {
namespace {

using namespace detail;

// The backward's kernel parameters: its arguments (ln_modulate.h) plus the launch plan.
struct BwdParams : LnModBwdArgs {
  int64_t parts;   // CTAs per sample (P); segments: CTAs of the stream
  int64_t span;    // rows of one sample per CTA; segments: rows per chunk (T)
  int64_t chunks;  // segments: the bound V on the chunks, one per thread-row
};

// Chunk v, the k-th chunk of segment g: g, its rows [begin, end) and whether k = 0, found by the 32 lanes of a
// warp together (a warp belongs to one thread-row, so all lanes ask for the same v), 32
// segments per step: each lane counts one segment's chunks and a warp scan gives where they
// start. No chunk v (past the last): begin = end = 0. Rows are clamped to [0, L], so
// offsets that break the rules can give wrong rows but never out-of-bounds ones.
struct Chunk {
  int64_t seg, begin, end;
  bool first;
};

__device__ __forceinline__ int64_t clamp(int64_t v, int64_t lo, int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

__device__ __forceinline__ Chunk find_chunk(const int32_t* cu, int64_t G, int64_t L, int64_t T,
                                            int64_t v) {
  const int lane = threadIdx.x & 31;
  int64_t before = 0;  // chunks of the segments already passed
  for (int64_t g0 = 0; g0 < G; g0 += 32) {
    const int64_t g = g0 + lane;
    const int64_t a = g < G ? clamp(cu[g], 0, L) : 0;
    const int64_t e = g < G ? clamp(cu[g + 1], a, L) : 0;
    const int64_t n = (e - a + T - 1) / T;
    int64_t incl = n;  // inclusive scan of the chunk counts over the lanes
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int64_t t = __shfl_up_sync(0xffffffffu, incl, off);
      if (lane >= off) incl += t;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, before + incl - n <= v && v < before + incl);
    if (hit != 0) {
      const int src = __ffs(hit) - 1;
      const int64_t k = v - before - __shfl_sync(0xffffffffu, incl - n, src);
      const int64_t begin = __shfl_sync(0xffffffffu, a, src) + k * T;
      return {g0 + src, begin, clamp(begin + T, begin, __shfl_sync(0xffffffffu, e, src)),
              k == 0};
    }
    before += __shfl_sync(0xffffffffu, incl, 31);
  }
  return {0, 0, 0, false};
}

// The segment workspace's int32 tail: each segment's first chunk (after the [2, V, D] rows).
__host__ __device__ __forceinline__ int64_t first_chunks_offset(int64_t chunks, int64_t D) {
  return 2 * chunks * D;
}

// 16-byte shared-memory slots one thread needs per pipeline stage (x and dy packs).
template <typename T, int CPT>
__host__ __device__ constexpr int stage_slots() {
  static_assert(sizeof(Pack<T>) == kPack * sizeof(T), "Pack<T> is 8 elements");
  return dispatch::bwd_stage_slots(sizeof(T), CPT);
}

template <typename T, typename M, int CPT, int LAYOUT, int STAGES>
__device__ __forceinline__ void bwd_body(const BwdParams& p) {
  constexpr bool PER_TOKEN = LAYOUT == dispatch::kPerToken;
  constexpr bool SEGMENTS = LAYOUT == dispatch::kPerSegment;
  const int tx = threadIdx.x;
  const int ty = threadIdx.y;
  const int tpr = blockDim.x;
  const int rows = blockDim.y;
  const int D = static_cast<int>(p.D);  // <= kMaxD (check_shape)
  const int nc = D / kPack;
  const float inv_d = 1.f / static_cast<float>(D);

  // The rows this thread-row visits: first, first + step, ... below s1, in `trips`
  // iterations that are the same for the whole CTA (row_allreduce holds barriers). Per
  // sample/token: CTA (b, part) owns rows [s0, s1) of sample b, its thread-rows interleaved.
  // Segments (B = 1, S = L): thread-row q = (CTA, ty) owns the rows of chunk q.
  const int64_t part = SEGMENTS ? 0 : blockIdx.x % p.parts;
  const int64_t b = SEGMENTS ? 0 : blockIdx.x / p.parts;
  const int64_t q = (SEGMENTS ? blockIdx.x : part) * rows + ty;  // this thread-row's partial
  int64_t s0 = part * p.span;
  int64_t s1 = s0 + p.span < p.S ? s0 + p.span : p.S;
  int64_t mod_b = b;  // the modulation row: the sample's, or the chunk's segment's
  if constexpr (SEGMENTS) {
    const Chunk chunk = find_chunk(p.cu_seqlens, p.G, p.S, p.span, q);
    mod_b = chunk.seg;
    s0 = chunk.begin;
    s1 = chunk.end;
    if (chunk.first && tx == 0) {  // where the finalize finds this segment's chunks
      int32_t* first_chunk =
          reinterpret_cast<int32_t*>(p.workspace + first_chunks_offset(p.chunks, D));
      first_chunk[chunk.seg] = static_cast<int32_t>(q);
    }
  }
  const int64_t first = SEGMENTS ? s0 : s0 + ty;
  const int64_t step = SEGMENTS ? 1 : rows;
  const int64_t trips = SEGMENTS ? p.span : (s1 - s0 + rows - 1) / rows;
  // segments: a CTA past the last chunk leaves at once (its partial rows are never read)
  if (SEGMENTS && !__syncthreads_or(first < s1)) return;

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

  // pipeline slots: [STAGES][SLOTS][threads] uint4, consecutive threads adjacent (no bank
  // conflicts); slot k < CPT*VPC holds x, the rest dy
  extern __shared__ uint4 pipe[];
  constexpr int VPC = static_cast<int>(sizeof(Pack<T>) / sizeof(uint4));
  constexpr int SLOTS = stage_slots<T, CPT>();
  constexpr int NS = STAGES > 0 ? STAGES : 1;  // modulus that is never 0
  const int nthr = tpr * rows;
  const int tid = ty * tpr + tx;
  auto issue = [&](int stage, int64_t s) {  // start loading row s into `stage`; always commits
    if (s < s1) {
      const T* xr = row_of<T>(p.x, b, s);
      const T* dr = row_of<T>(p.dy, b, s);
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const int ch = c * tpr + tx;
        if (ch < nc) {
#pragma unroll
          for (int v = 0; v < VPC; ++v) {
            const int k = c * VPC + v;
            const int off = ch * kPack + v * (kPack / VPC);
            cp_async16(&pipe[(stage * SLOTS + k) * nthr + tid], xr + off);
            cp_async16(&pipe[(stage * SLOTS + CPT * VPC + k) * nthr + tid], dr + off);
          }
        }
      }
    }
    cp_async_commit();
  };
  if constexpr (STAGES > 0) {
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(k, first + k * step);
  }

  // the row statistics are loaded one row ahead too (their latency would otherwise stall
  // every row); values for rows past s1 are never used
  float mean_next = 0.f, rstd_next = 0.f;
  if (first < s1) {
    mean_next = p.mean[b * p.S + first];
    rstd_next = p.rstd[b * p.S + first];
  }

  for (int64_t it = 0; it < trips; ++it) {  // CTA-uniform trip count
    const int64_t s = first + it * step;
    const bool valid = s < s1;
    const int64_t row = b * p.S + s;
    const float mean = mean_next, rstd = rstd_next;
    if (s + step < s1) {
      mean_next = p.mean[row + step];
      rstd_next = p.rstd[row + step];
    }
    if constexpr (STAGES > 0) {
      // refill the stage read in the previous iteration, then wait for this row's stage
      issue(static_cast<int>((it + STAGES - 1) % NS), s + (STAGES - 1) * step);
      cp_async_wait<STAGES - 1>();
    }
    Pack<T> xv[CPT], dv[CPT];
    float gam[CPT][kPack];  // 1 + scale; a broadcast row (scale.ss = 0) is an L1 hit
    if (valid) {
      const T* xr = row_of<T>(p.x, b, s);
      const T* dr = row_of<T>(p.dy, b, s);
      const M* sc = row_of<M>(p.scale, mod_b, s);
      const int stage = static_cast<int>(it % NS);
#pragma unroll
      for (int c = 0; c < CPT; ++c) {
        const int ch = c * tpr + tx;
        if (ch < nc) {
          if constexpr (STAGES > 0) {
            const uint4* slot = &pipe[(stage * SLOTS + c * VPC) * nthr + tid];
            xv[c] = smem_pack<T>(slot, nthr);
            dv[c] = smem_pack<T>(slot + CPT * VPC * nthr, nthr);
          } else {
            xv[c] = load_pack<T>(xr + ch * kPack);
            dv[c] = load_pack<T>(dr + ch * kPack);
          }
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
      T* dxr = static_cast<T*>(p.dx) + row * D;
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
            store_pack<M>(static_cast<M*>(p.dscale) + row * D + ch * kPack, pack<M>(ds));
            store_pack<M>(static_cast<M*>(p.dshift) + row * D + ch * kPack, pack<M>(df));
          }
        }
      }
    }
  }

  if constexpr (STAGES > 0) cp_async_wait<0>();  // nothing left in flight at exit

  if constexpr (!PER_TOKEN) {  // this thread-row's partial: workspace [2, B, P * rows, D] or
    // [2, V, D] (segments: B = 1, P * rows >= V); a thread-row past the last chunk has zeros
    const int64_t q_total = SEGMENTS ? p.chunks : p.parts * rows;
    float* wds = p.workspace + ((0 * p.B + b) * q_total + q) * D;
    float* wdsh = p.workspace + ((1 * p.B + b) * q_total + q) * D;
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

template <typename T, typename M, int CPT, int LAYOUT, int STAGES>
__global__ void __launch_bounds__(kMaxThreads) ln_mod_bwd_kernel(const BwdParams p) {
  bwd_body<T, M, CPT, LAYOUT, STAGES>(p);
}

// The lean instances (dispatch::bwd_lean) cap registers at 96 instead of the 128 of
// __launch_bounds__(512), so more CTAs share an SM and more loads are in flight.
template <typename T, int CPT, int STAGES>
constexpr bool lean_kernel() {
  return dispatch::bwd_lean(sizeof(T), CPT, STAGES);
}

template <typename T, typename M, int CPT, int LAYOUT, int STAGES>
__global__ void __maxnreg__(dispatch::kLeanRegisters) ln_mod_bwd_kernel_lean(const BwdParams p) {
  bwd_body<T, M, CPT, LAYOUT, STAGES>(p);
}

template <typename T, typename M, int CPT, int LAYOUT, int STAGES>
const void* bwd_kernel_ptr() {
  if constexpr (lean_kernel<T, CPT, STAGES>())
    return reinterpret_cast<const void*>(&ln_mod_bwd_kernel_lean<T, M, CPT, LAYOUT, STAGES>);
  else
    return reinterpret_cast<const void*>(&ln_mod_bwd_kernel<T, M, CPT, LAYOUT, STAGES>);
}

// Column sums of fp32 partial rows, shared by both finalize kernels: grid (ceil(D / 128), rows
// of the output, 2 = {dscale, dshift}), block (32, kFinWarps). Lane x owns 4 columns (one
// float4); warp y adds partials y, y + kFinWarps, ... (`partial(k)` is the k-th of n), then
// warp 0 adds the warp sums in order and writes output row `out_row`: a fixed order, so the
// sums are bitwise reproducible. Must be reached by the whole CTA (one barrier).
using dispatch::kFinWarps;

template <typename M, typename Partial>
__device__ __forceinline__ void column_sums(Partial partial, int64_t n, M* dscale, M* dshift,
                                            int64_t out_row, int D) {
  __shared__ float4 sums[kFinWarps][32];
  const int col = (blockIdx.x * 32 + threadIdx.x) * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (col < D) {
    for (int64_t k = threadIdx.y; k < n; k += kFinWarps) {
      const float4 v = *reinterpret_cast<const float4*>(partial(k) + col);
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
  M* out = (blockIdx.z == 0 ? dscale : dshift) + out_row * D + col;
  out[0] = from_float<M>(t.x);
  out[1] = from_float<M>(t.y);
  out[2] = from_float<M>(t.z);
  out[3] = from_float<M>(t.w);
}

// Per sample: sample b's Q partial rows of workspace [2, B, Q, D] (a few MB).
template <typename M>
__global__ void __launch_bounds__(32 * kFinWarps)
    ln_mod_bwd_finalize(const float* __restrict__ ws, M* dscale, M* dshift, int64_t B,
                        int64_t Q, int D) {
  const int64_t b = blockIdx.y;
  const float* src = ws + (blockIdx.z * B + b) * Q * D;
  column_sums<M>([&](int64_t q) { return src + q * D; }, Q, dscale, dshift, b, D);
}

// Per segment g (grid row g): the sum of its chunks' partials, chunks c0 .. c0 + n - 1 with
// n = ceil(len_g / T) and c0 the first chunk the main kernel recorded; zeros for an empty
// segment. Chunk indices are clamped, so any offsets stay in bounds; block (0, 0, 0) checks
// the offsets on the device.
template <typename M>
__global__ void __launch_bounds__(32 * kFinWarps)
    ln_mod_bwd_seg_finalize(const float* __restrict__ ws, M* dscale, M* dshift,
                            const int32_t* cu, int64_t G, int64_t L, int64_t chunks,
                            int64_t span, int D) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) check_offsets(cu, G, L);
  const int64_t g = blockIdx.y;
  const int64_t a = clamp(cu[g], 0, L);
  int64_t n = (clamp(cu[g + 1], a, L) - a + span - 1) / span;
  int64_t c0 = 0;
  if (n > 0) {
    const auto* first_chunk = reinterpret_cast<const int32_t*>(ws + first_chunks_offset(chunks, D));
    c0 = clamp(first_chunk[g], 0, chunks);
    n = clamp(n, 0, chunks - c0);
  }
  const float* src = ws + blockIdx.z * chunks * D;
  column_sums<M>([&](int64_t k) { return src + (c0 + k) * D; }, n, dscale, dshift, g, D);
}

// Persistent grid: as many CTAs as fit on the GPU at once. Per sample/token they are split
// evenly over the samples, each CTA getting >= `rows` rows so no thread-row idles for the
// whole kernel; for segments one thread-row per chunk.
struct Plan {
  RowConfig cfg;
  int64_t parts, span, chunks;
  size_t smem;  // dynamic shared memory of the cp.async pipeline
};

// ADAPTIVELOAD_LN_BWD_PIPELINE=0 selects the unpipelined kernel (for A/B measurements).
bool pipeline_enabled() {
  const char* env = std::getenv("ADAPTIVELOAD_LN_BWD_PIPELINE");
  return env == nullptr || env[0] != '0';
}

// SM count and CTAs per SM of `kernel` on the current device, queried once per (kernel,
// device, block size, smem) (the queries cost microseconds of host time per call otherwise).
const char* occupancy(const void* kernel, int threads, size_t smem, int* sms, int* occ) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, size_t>, std::pair<int, int>> cache;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(kernel, dev, threads, smem);
  if (const auto hit = cache.find(key); hit != cache.end()) {
    *sms = hit->second.first;
    *occ = hit->second.second;
    return nullptr;
  }
  e = cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev);
  // always the same opt-in size, so a later call never shrinks the limit under a cached
  // larger configuration
  if (e == cudaSuccess && dispatch::smem_opt_in(smem))
    e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(dispatch::kMaxPipeSmem));
  if (e == cudaSuccess)
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(occ, kernel, threads, smem);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  cache.emplace(key, std::make_pair(*sms, *occ));
  return nullptr;
}

const char* make_plan(const LnModBwdArgs& a, const void* kernel, RowConfig cfg, size_t smem,
                      Plan* plan) {
  plan->cfg = cfg;
  plan->smem = smem;
  int sms = 0, occ = 0;
  if (const char* err = occupancy(kernel, cfg.tpr * cfg.rows, smem, &sms, &occ)) return err;
  if (occ < 1)  // the CPU resource check (ptxas) should make this unreachable on sm_90
    return "ln_modulate_bwd: kernel does not fit on this GPU (registers/smem); run "
           "tests/test_kernel_resources.py for this GPU's architecture";
  const int64_t ctas = static_cast<int64_t>(sms) * occ;
  if (a.layout == dispatch::kPerSegment) {  // B = 1, S = L >= 1, G >= 1
    // chunks of T rows: at most ceil(L / T) + G of them; T is chosen so that they fit in one
    // wave of thread-rows while G is small against it
    const int64_t thread_rows = ctas * cfg.rows;
    const int64_t room = thread_rows > 2 * a.G ? thread_rows - a.G : (thread_rows + 1) / 2;
    plan->span = (a.S + room - 1) / room;
    plan->parts = ((a.S + plan->span - 1) / plan->span + a.G + cfg.rows - 1) / cfg.rows;
    plan->chunks = plan->parts * cfg.rows;
    return nullptr;
  }
  const int64_t max_parts = (a.S + cfg.rows - 1) / cfg.rows;
  int64_t parts = (ctas + a.B - 1) / a.B;
  parts = parts < 1 ? 1 : (parts > max_parts ? max_parts : parts);
  plan->span = (a.S + parts - 1) / parts;
  plan->parts = (a.S + plan->span - 1) / plan->span;  // no CTA with an empty range
  plan->chunks = 0;
  return nullptr;
}

// fp32 floats of the workspace: per-sample partial rows, per-segment head/tail rows, or none.
int64_t workspace_floats(const LnModBwdArgs& a, const Plan& plan) {
  switch (a.layout) {
    case dispatch::kPerSample: return 2 * a.B * plan.parts * plan.cfg.rows * a.D;
    case dispatch::kPerSegment: return first_chunks_offset(plan.chunks, a.D) + a.G;
    default: return 0;
  }
}

template <typename M>
const char* finalize(const LnModBwdArgs& a, const Plan& plan, cudaStream_t stream) {
  const unsigned cols = static_cast<unsigned>((a.D / 4 + 31) / 32);
  if (a.layout == dispatch::kPerSegment) {
    ln_mod_bwd_seg_finalize<M><<<dim3(cols, static_cast<unsigned>(a.G), 2), dim3(32, kFinWarps),
                                 0, stream>>>(
        a.workspace, static_cast<M*>(a.dscale), static_cast<M*>(a.dshift), a.cu_seqlens, a.G,
        a.S, plan.chunks, plan.span, static_cast<int>(a.D));
  } else {
    ln_mod_bwd_finalize<M><<<dim3(cols, static_cast<unsigned>(a.B), 2), dim3(32, kFinWarps), 0,
                             stream>>>(a.workspace, static_cast<M*>(a.dscale),
                                       static_cast<M*>(a.dshift), a.B,
                                       plan.parts * plan.cfg.rows, static_cast<int>(a.D));
  }
  return last_error();
}

template <typename T, typename M, int CPT, int LAYOUT, int STAGES>
const char* run(const LnModBwdArgs& a, const Plan& plan, cudaStream_t stream) {
  if (LAYOUT == dispatch::kPerSample && a.B > dispatch::kMaxGridY)
    return "ln_modulate_bwd: at most 65535 samples per call";
  const BwdParams p{a, plan.parts, plan.span, plan.chunks};
  const int64_t blocks = a.B * plan.parts;
  if (blocks > 0x7fffffffLL) return "ln_modulate_bwd: too many CTAs for one launch";
  const dim3 block(plan.cfg.tpr, plan.cfg.rows);
  if constexpr (lean_kernel<T, CPT, STAGES>())
    ln_mod_bwd_kernel_lean<T, M, CPT, LAYOUT, STAGES>
        <<<static_cast<unsigned>(blocks), block, plan.smem, stream>>>(p);
  else
    ln_mod_bwd_kernel<T, M, CPT, LAYOUT, STAGES>
        <<<static_cast<unsigned>(blocks), block, plan.smem, stream>>>(p);
  if (const char* err = last_error()) return err;
  return LAYOUT == dispatch::kPerToken ? nullptr : finalize<M>(a, plan, stream);
}

template <typename T, typename M, int CPT, int LAYOUT, int STAGES>
const char* plan_and_maybe_run_stages(const LnModBwdArgs& a, RowConfig cfg, cudaStream_t stream,
                                      int64_t* floats) {
  const size_t smem = dispatch::bwd_pipe_smem(sizeof(T), cfg, STAGES);
  const void* kernel = bwd_kernel_ptr<T, M, CPT, LAYOUT, STAGES>();
  Plan plan;
  if (const char* err = make_plan(a, kernel, cfg, smem, &plan)) return err;
  if (floats != nullptr) {
    *floats = workspace_floats(a, plan);
    return nullptr;
  }
  if (workspace_floats(a, plan) > 0 && a.workspace == nullptr)
    return "ln_modulate_bwd: workspace missing";
  return run<T, M, CPT, LAYOUT, STAGES>(a, plan, stream);
}

// Both entry points (workspace size and run) go through here so they agree on the plan.
template <typename T, typename M, int CPT, int LAYOUT>
const char* plan_and_maybe_run(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  const RowConfig cfg = dispatch::bwd_config(a.D);
  if (dispatch::bwd_stages(a.D, sizeof(T), pipeline_enabled()) == dispatch::kBwdStages)
    return plan_and_maybe_run_stages<T, M, CPT, LAYOUT, dispatch::kBwdStages>(a, cfg, stream,
                                                                           floats);
  return plan_and_maybe_run_stages<T, M, CPT, LAYOUT, 0>(a, cfg, stream, floats);
}

template <typename T, typename M, int CPT>
const char* dispatch_layout(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  switch (a.layout) {
    case dispatch::kPerSample:
      return plan_and_maybe_run<T, M, CPT, dispatch::kPerSample>(a, stream, floats);
    case dispatch::kPerToken:
      return plan_and_maybe_run<T, M, CPT, dispatch::kPerToken>(a, stream, floats);
    case dispatch::kPerSegment:
      return plan_and_maybe_run<T, M, CPT, dispatch::kPerSegment>(a, stream, floats);
    default: return "ln_modulate_bwd: unknown modulation layout";
  }
}

template <typename T, typename M>
const char* dispatch_cpt(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  switch (dispatch::bwd_config(a.D).cpt) {
    case dispatch::kBwdCpt: return dispatch_layout<T, M, dispatch::kBwdCpt>(a, stream, floats);
    default: return "ln_modulate_bwd: internal error (no kernel for this chunk count)";
  }
}

template <typename T>
const char* dispatch_mod(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  if (a.mod_dtype == DType::kF32) return dispatch_cpt<T, float>(a, stream, floats);
  if (a.mod_dtype == a.x_dtype) return dispatch_cpt<T, T>(a, stream, floats);
  return "ln_modulate_bwd: scale dtype must be float32 or x's dtype";
}

const char* run_or_size(const LnModBwdArgs& a, cudaStream_t stream, int64_t* floats) {
  if (const char* err = detail::check_shape(a.B, a.S, a.D)) return err;
  if (a.layout == dispatch::kPerSegment) {
    if (const char* err = detail::check_segments(a.cu_seqlens, a.B, a.S, a.G)) return err;
  }
  if (a.B == 0 || a.S == 0) {  // the binding zero-fills the modulation gradients
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
  return run_or_size(args, nullptr, floats);
}

const char* ln_modulate_bwd(const LnModBwdArgs& args, cudaStream_t stream) {
  return run_or_size(args, stream, nullptr);
}

}  // namespace adaptiveload
