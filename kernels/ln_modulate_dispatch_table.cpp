// Prints the dispatch table of ln_modulate_dispatch.h as JSON lines: first the limits, then
// one line per kernel launch the library can make, for every supported D and dtype pair.
// Built with the host compiler only (no CUDA) by adaptiveload/ops/kernel_resources.py, whose
// resource check looks every printed `kernel` up among the instances ptxas compiled.
//
//   g++ -std=c++17 -O1 kernels/ln_modulate_dispatch_table.cpp -o /tmp/dt && /tmp/dt
//
// Kernel names are spelled as c++filt demangles the instances (template arguments included).
#include <cstdio>
#include <initializer_list>

#include "ln_modulate_dispatch.h"

namespace {

using namespace adaptiveload::dispatch;

struct Type {
  const char* torch_name;  // as the Python side names dtypes
  const char* cpp_name;    // as c++filt prints the template argument
  int bytes;
};

constexpr Type kF32{"float32", "float", 4};
constexpr Type kF16{"float16", "__half", 2};
constexpr Type kBF16{"bfloat16", "__nv_bfloat16", 2};
constexpr const char* kLayoutNames[] = {"sample", "token", "segment"};  // by kPer* value

void line(int64_t D, const Type& x, const Type& m, const char* op, const char* layout,
          int pipeline, const char* kernel, const char* args, int threads, size_t smem,
          int max_registers) {
  std::printf(
      "{\"D\": %lld, \"x\": \"%s\", \"mod\": \"%s\", \"op\": \"%s\", \"layout\": \"%s\", "
      "\"pipeline\": %d, \"kernel\": \"%s%s%s%s\", \"threads\": %d, \"dynamic_smem\": %zu, "
      "\"opt_in\": %s, \"max_registers\": %d}\n",
      static_cast<long long>(D), x.torch_name, m.torch_name, op, layout, pipeline, kernel,
      *args ? "<" : "", args, *args ? ">" : "", threads, smem, smem_opt_in(smem) ? "true" : "false",
      max_registers);
}

void rows_for(int64_t D, const Type& x, const Type& m) {
  char args[160];
  const RowConfig f = fwd_config(D);
  for (const bool segments : {false, true}) {
    std::snprintf(args, sizeof(args), "%s, %s, %d, %s", x.cpp_name, m.cpp_name, f.cpt,
                  segments ? "true" : "false");
    line(D, x, m, "fwd", segments ? "segment" : "dense", 1, "ln_mod_fwd_kernel", args,
         f.tpr * f.rows, 0, kRegistersPerCta / kMaxThreads);
  }
  const RowConfig b = bwd_config(D);
  for (int pipeline = 1; pipeline >= 0; --pipeline) {
    const int stages = bwd_stages(D, x.bytes, pipeline != 0);
    const bool lean = bwd_lean(x.bytes, b.cpt, stages);
    for (const int layout : {kPerSample, kPerToken, kPerSegment}) {
      std::snprintf(args, sizeof(args), "%s, %s, %d, %d, %d", x.cpp_name, m.cpp_name, b.cpt,
                    layout, stages);
      line(D, x, m, "bwd", kLayoutNames[layout], pipeline,
           lean ? "ln_mod_bwd_kernel_lean" : "ln_mod_bwd_kernel", args, b.tpr * b.rows,
           bwd_pipe_smem(x.bytes, b, stages),
           lean ? kLeanRegisters : kRegistersPerCta / kMaxThreads);
    }
  }
  line(D, x, m, "bwd_finalize", "sample", 1, "ln_mod_bwd_finalize", m.cpp_name,
       kWarp * kFinWarps, 0, kRegistersPerCta / (kWarp * kFinWarps));
  line(D, x, m, "bwd_finalize", "segment", 1, "ln_mod_bwd_seg_finalize", m.cpp_name,
       kWarp * kFinWarps, 0, kRegistersPerCta / (kWarp * kFinWarps));
}

}  // namespace

int main() {
  std::printf(
      "{\"kMaxD\": %lld, \"kPack\": %d, \"kMaxThreads\": %d, \"kRegistersPerCta\": %d, "
      "\"kSmemDefault\": %zu, \"kSmemOptInMax\": %zu, \"kMaxPipeSmem\": %zu, "
      "\"kMaxGridY\": %lld}\n",
      static_cast<long long>(kMaxD), kPack, kMaxThreads, kRegistersPerCta, kSmemDefault,
      kSmemOptInMax, kMaxPipeSmem, static_cast<long long>(kMaxGridY));
  for (int64_t D = kPack; D <= kMaxD; D += kPack) {
    for (const Type* x : {&kF32, &kF16, &kBF16}) {
      rows_for(D, *x, kF32);
      if (x->bytes != 4) rows_for(D, *x, *x);
    }
    // the segment forward's offset check: one CTA, any dtypes
    line(D, kF32, kF32, "check", "segment", 1, "ln_mod_check_offsets", "", kCheckThreads, 0,
         kRegistersPerCta / kCheckThreads);
  }
  return 0;
}
