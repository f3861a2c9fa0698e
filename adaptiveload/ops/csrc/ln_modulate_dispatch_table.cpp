// Prints the dispatch table of ln_modulate_dispatch.h as JSON lines: first the limits, then
// one line per kernel launch the library can make, for every supported D and dtype pair.
// Built with the host compiler only (no CUDA) by adaptiveload/ops/kernel_resources.py, whose
// resource check looks every printed `kernel` up among the instances ptxas compiled.
//
//   cd adaptiveload/ops/csrc && g++ -std=c++17 -O1 ln_modulate_dispatch_table.cpp -o t && ./t
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

void line(int64_t D, const Type& x, const Type& m, const char* op, const char* layout,
          int pipeline, const char* kernel, const char* args, int threads, size_t smem,
          int max_registers) {
  std::printf(
      "{\"D\": %lld, \"x\": \"%s\", \"mod\": \"%s\", \"op\": \"%s\", \"layout\": \"%s\", "
      "\"pipeline\": %d, \"kernel\": \"%s<%s>\", \"threads\": %d, \"dynamic_smem\": %zu, "
      "\"opt_in\": %s, \"max_registers\": %d}\n",
      static_cast<long long>(D), x.torch_name, m.torch_name, op, layout, pipeline, kernel, args,
      threads, smem, smem_opt_in(smem) ? "true" : "false", max_registers);
}

void rows_for(int64_t D, const Type& x, const Type& m) {
  char args[160];
  const RowConfig f = fwd_config(D);
  std::snprintf(args, sizeof(args), "%s, %s, %d", x.cpp_name, m.cpp_name, f.cpt);
  line(D, x, m, "fwd", "any", 1, "ln_mod_fwd_kernel", args, f.tpr * f.rows, 0,
       kRegistersPerCta / kMaxThreads);
  const RowConfig b = bwd_config(D);
  for (int pipeline = 1; pipeline >= 0; --pipeline) {
    const int stages = bwd_stages(D, x.bytes, pipeline != 0);
    const bool lean = bwd_lean(x.bytes, b.cpt, stages);
    for (const bool per_token : {false, true}) {
      std::snprintf(args, sizeof(args), "%s, %s, %d, %s, %d", x.cpp_name, m.cpp_name, b.cpt,
                    per_token ? "true" : "false", stages);
      line(D, x, m, "bwd", per_token ? "token" : "sample", pipeline,
           lean ? "ln_mod_bwd_kernel_lean" : "ln_mod_bwd_kernel", args, b.tpr * b.rows,
           bwd_pipe_smem(x.bytes, b, stages),
           lean ? kLeanRegisters : kRegistersPerCta / kMaxThreads);
    }
  }
  line(D, x, m, "bwd_finalize", "sample", 1, "ln_mod_bwd_finalize", m.cpp_name,
       kWarp * kFinWarps, 0, kRegistersPerCta / (kWarp * kFinWarps));
}

}  // namespace

int main() {
  std::printf(
      "{\"kMaxD\": %lld, \"kPack\": %d, \"kMaxThreads\": %d, \"kRegistersPerCta\": %d, "
      "\"kSmemDefault\": %zu, \"kSmemOptInMax\": %zu, \"kMaxPipeSmem\": %zu}\n",
      static_cast<long long>(kMaxD), kPack, kMaxThreads, kRegistersPerCta, kSmemDefault,
      kSmemOptInMax, kMaxPipeSmem);
  for (int64_t D = kPack; D <= kMaxD; D += kPack) {
    for (const Type* x : {&kF32, &kF16, &kBF16}) {
      rows_for(D, *x, kF32);
      if (x->bytes != 4) rows_for(D, *x, *x);
    }
  }
  return 0;
}
