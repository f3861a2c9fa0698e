#!/usr/bin/env bash
# Build, check, test and benchmark the fused LayerNorm-Modulate kernel on a GPU machine, in one
# go, writing everything under OUTDIR (target: ~4 minutes on an H200).
#
#   experiments/gpu/kernel_check.sh OUTDIR
#
# Needs only python with torch (CUDA build), nvcc and ninja: no `pip install -e .` (the repo
# goes on PYTHONPATH), no typer/mlflow (the build, bench and end-to-end modules run directly).
# Uses pytest when importable, else runs the CUDA test modules as scripts (their helpers are
# tests/support/, which pytest finds through pyproject.toml and a script through PYTHONPATH).
# Every part runs under its own `timeout`, and OUTDIR is packed into $PACK after each part, so a
# cut window still leaves an archive of everything finished.
# The sources are kernels/ at the top of the repo.
# Outputs: env.txt (versions, the kernel sources' folder and digest), build.json, build.log,
# resources.txt (ptxas -v per instance vs the dispatch table: registers x threads, smem,
# spills; the CPU resource check), cuda_tests.log (+ .xml),
# cuda_segment_tests.log (+ .xml; the segment layout of packed micro-batches), cpu_op_tests.log,
# bench.csv/.log (D 1536 and 5120 at the target lengths), bench_segments.csv/.log (packed
# streams of G = 1, 8, 64 segments at both widths: fused vs the eager gather vs the dense
# kernel on the same stream) and bench_widths.csv/.log (the other DiT widths at one length):
# TB/s, fraction of the copy bandwidth, speed-ups vs eager and torch.compile, saved
# activations; bench_nopipe.csv (backward
# without its cp.async pipeline), e2e.csv/.log (Wan 2.1 1.3B training step, eager vs fused:
# step time, peak memory), ncu_bwd.txt (optional: Nsight Compute on the backward),
# summary.txt, steps.tsv (status and seconds per part).
# Environment: PYTHON (default python3), ARCH (default 9.0), PACK (archive, default
# OUTDIR.tar.gz; "none" to skip), BENCH_SEQ_LENS (16384,75600), BENCH_TIMEOUT_S (75),
# BENCH_WIDTHS (1152,2048,3072,4096), BENCH_WIDTHS_SEQ_LEN (32768), BENCH_WIDTHS_TIMEOUT_S (60),
# SEGMENT_TESTS_TIMEOUT_S (150), BENCH_SEGMENTS_LENS (75600), BENCH_SEGMENTS_IMPLS
# (fused,eager; add compile for the torch.compile of the gather, ~10 s of compiling per shape),
# BENCH_SEGMENTS_TIMEOUT_S (60), CPU_OP_TESTS (the CPU op test files: test_kernel_ops.py and
# test_kernel_segments.py of tests/ops/ and their slow halves in tests/slow/ops/),
# E2E_SEQ_LENS (16380,32760,75600), E2E_TIMEOUT_S (120), NCU_TIMEOUT_S (45; 0 skips),
# NCU_START_BEFORE_S (200), ALLOW_NO_GPU=1 (dry run on a GPU-less machine: carry on past the
# availability check; the CUDA tests skip, the benches write skip records and the end-to-end
# step runs the tiny model on the CPU).
set -uo pipefail

OUT=${1:?usage: experiments/gpu/kernel_check.sh OUTDIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
ARCH=${ARCH:-9.0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PACK=${PACK:-$OUT.tar.gz}
BUILD=$(mktemp -d "${TMPDIR:-/tmp}/adaptiveload-kernel.XXXXXX")
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$(dirname "$(command -v "$PY")"):$PATH"
export MAX_JOBS=${MAX_JOBS:-8}
export ADAPTIVELOAD_BUILD_DIR="$BUILD"  # where the build writes and every step loads from
export PYTHONUNBUFFERED=1
START=$(date +%s)
printf 'step\tstatus\tseconds\n' > "$OUT/steps.tsv"

pack() {  # archive OUTDIR as it is now (atomic: a cut never leaves half an archive)
  [ "$PACK" = none ] && return 0
  local tmp="$PACK.$BASHPID.tmp"  # parts running in the background pack too
  tar -czf "$tmp" -C "$(dirname "$OUT")" "$(basename "$OUT")" 2>/dev/null && mv -f "$tmp" "$PACK"
}

step() {  # step NAME TIMEOUT_S LOGFILE CMD...: run with a time limit, record status and time
  local name=$1 limit=$2 log=$3
  shift 3
  local t0 rc
  t0=$(date +%s)
  echo "== $name (limit ${limit}s, $(($(date +%s) - START))s elapsed)"
  timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >> "$OUT/steps.tsv"
  tail -n 5 "$log"
  pack
  return $rc
}

{
  echo "date: $(date -u +%FT%TZ)"
  echo "repo commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv 2>&1
  "$PY" -c 'import sys, torch; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)'
  "$PY" -c 'import pytest; print("pytest", pytest.__version__)' 2>&1 | tail -n 1
  "$CUDA_HOME/bin/nvcc" --version 2>&1 | tail -n 2
  echo "ninja $(ninja --version 2>&1)"
  # what the build and the resource check compile: kernels/ of this tree (kernel_sources)
  "$PY" -c 'from adaptiveload.ops.kernel_sources import SOURCE_DIR, sources_digest as d; print(f"kernel sources: {SOURCE_DIR} (sources_digest {d()})")' 2>&1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. build (the record says built/skipped/failed and why)
step build 150 "$OUT/build.log" "$PY" -m adaptiveload.ops.kernel_build --arch "$ARCH"
cp "$BUILD/build.json" "$OUT/build.json" 2>/dev/null
if ! "$PY" -c 'import sys; from adaptiveload.ops import ln_modulate as lm; r = lm.fused_unavailable_reason(); print("fused kernel:", r or "available"); sys.exit(1 if r else 0)' >> "$OUT/build.log" 2>&1 && [ "${ALLOW_NO_GPU:-0}" != 1 ]; then
  tail -n 3 "$OUT/build.log"
  echo "fused kernel not usable: see $OUT/build.log" | tee "$OUT/summary.txt"
  exit 1
fi

# 2. the CPU resource check (ptxas -v of every dispatched instance vs the sm_90 limits) and
#    the CPU op tests, in the background on the host while the GPU runs the CUDA tests
CPU_OP_TESTS=${CPU_OP_TESTS:-tests/ops/test_kernel_ops.py tests/ops/test_kernel_segments.py \
  tests/slow/ops/test_kernel_ops_slow.py tests/slow/ops/test_kernel_segments_slow.py}
SM=${ARCH%%;*}
SM=${SM/./}
step resources 200 "$OUT/resources.txt" "$PY" -m adaptiveload.ops.kernel_resources --arch "$SM" &
RES_PID=$!
if "$PY" -c 'import pytest' 2>/dev/null; then
  # shellcheck disable=SC2086  # CPU_OP_TESTS is a list of test paths
  step cpu_op_tests 150 "$OUT/cpu_op_tests.log" "$PY" -m pytest $CPU_OP_TESTS -q -rs \
    -p no:cacheprovider --noconftest -o addopts="" -o timeout=0 -k "not inductor" &
  CPU_PID=$!
fi

# 3. CUDA tests (pytest if present, else the module as a script)
if "$PY" -c 'import pytest' 2>/dev/null; then
  step cuda_tests 150 "$OUT/cuda_tests.log" "$PY" -m pytest tests/ops/test_kernel_cuda.py -q -rs \
    -p no:cacheprovider --noconftest -o addopts="" -o timeout=0 --junitxml="$OUT/cuda_tests.xml"
else
  step cuda_tests 150 "$OUT/cuda_tests.log" env PYTHONPATH="$REPO/tests/support:$PYTHONPATH" \
    "$PY" tests/ops/test_kernel_cuda.py
fi
# 3b. the segment layout's CUDA tests (packed micro-batches: every width, 1 to 65,535
#     segments, device-side offset checks, bitwise-deterministic per-segment sums)
if "$PY" -c 'import pytest' 2>/dev/null; then
  step cuda_segment_tests "${SEGMENT_TESTS_TIMEOUT_S:-150}" "$OUT/cuda_segment_tests.log" \
    "$PY" -m pytest tests/ops/test_kernel_cuda_segments.py -q -rs -p no:cacheprovider --noconftest \
    -o addopts="" -o timeout=0 --junitxml="$OUT/cuda_segment_tests.xml"
else
  step cuda_segment_tests "${SEGMENT_TESTS_TIMEOUT_S:-150}" "$OUT/cuda_segment_tests.log" \
    env PYTHONPATH="$REPO/tests/support:$PYTHONPATH" "$PY" tests/ops/test_kernel_cuda_segments.py
fi
wait "$RES_PID" ${CPU_PID:+"$CPU_PID"}  # nothing on the host competes with the timings below

# 4. benchmark (CSV rewritten after every shape, so a timeout keeps what was measured): the
#    two Wan 2.1 widths at the target lengths first, then the other DiT widths at one length
SKIP_OK=()
[ "${ALLOW_NO_GPU:-0}" = 1 ] && SKIP_OK=(--skip-ok)
step bench "${BENCH_TIMEOUT_S:-75}" "$OUT/bench.log" \
  "$PY" -m adaptiveload.ops.kernel_bench -o "$OUT/bench.csv" --repeats 15 \
  --dims 1536,5120 --seq-lens "${BENCH_SEQ_LENS:-16384,75600}" --segment-counts "" \
  ${SKIP_OK[@]+"${SKIP_OK[@]}"}
step bench_segments "${BENCH_SEGMENTS_TIMEOUT_S:-60}" "$OUT/bench_segments.log" \
  "$PY" -m adaptiveload.ops.kernel_bench -o "$OUT/bench_segments.csv" --repeats 15 --dims "" \
  --segment-counts 1,8,64 --segment-dims 1536,5120 \
  --segment-lens "${BENCH_SEGMENTS_LENS:-75600}" --impls "${BENCH_SEGMENTS_IMPLS:-fused,eager}" \
  ${SKIP_OK[@]+"${SKIP_OK[@]}"}
step bench_widths "${BENCH_WIDTHS_TIMEOUT_S:-60}" "$OUT/bench_widths.log" \
  "$PY" -m adaptiveload.ops.kernel_bench -o "$OUT/bench_widths.csv" --repeats 15 \
  --dims "${BENCH_WIDTHS:-1152,2048,3072,4096}" --seq-lens "${BENCH_WIDTHS_SEQ_LEN:-32768}" \
  --segment-counts "" ${SKIP_OK[@]+"${SKIP_OK[@]}"}

# 4b. A/B: the backward without its cp.async pipeline (fused only, two shapes)
step bench_nopipe 30 "$OUT/bench_nopipe.log" \
  env ADAPTIVELOAD_LN_BWD_PIPELINE=0 "$PY" -m adaptiveload.ops.kernel_bench -o "$OUT/bench_nopipe.csv" --impls fused \
  --dims 1536,5120 --seq-lens 16384,75600 --segment-counts "" ${SKIP_OK[@]+"${SKIP_OK[@]}"}

# 5. end to end: one Wan 2.1 1.3B training step (activation checkpointing, bf16), eager vs
#    fused, per S (a GPU-less dry run takes the tiny model on the CPU)
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  E2E=(--device cuda --model wan2.1-t2v-1.3b --seq-lens "${E2E_SEQ_LENS:-16380,32760,75600}" --steps 1)
else
  E2E=(--device cpu --model wan2.1-micro --seq-lens 16,48 --steps 1)
fi
step e2e "${E2E_TIMEOUT_S:-120}" "$OUT/e2e.log" \
  "$PY" -m adaptiveload.calibration.kernel_e2e -o "$OUT/e2e.csv" "${E2E[@]}"

# 6. optional: Nsight Compute on backward launches at both Wan widths (what limits it: DRAM
#    throughput vs latency, occupancy); only if the run is still within NCU_START_BEFORE_S,
#    never fails the check
NCU=$(command -v ncu || true)
if [ -n "$NCU" ] && [ "${NCU_TIMEOUT_S:-45}" != 0 ] && [ "${ALLOW_NO_GPU:-0}" != 1 ] &&
  [ $(($(date +%s) - START)) -lt "${NCU_START_BEFORE_S:-200}" ]; then
  step opt_ncu "${NCU_TIMEOUT_S:-45}" "$OUT/ncu_bwd.txt" \
    "$NCU" --kernel-name regex:ln_mod_bwd_kernel --launch-skip 1 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section MemoryWorkloadAnalysis \
    "$PY" -c 'import torch; from adaptiveload.ops import ln_modulate as lm
for d in (1536, 5120):
    x = torch.randn(1, 32760, d, device="cuda").bfloat16().requires_grad_()
    e = 0.1 * torch.randn(1, 6, d, device="cuda")
    s, t = e[:, 1:2].detach().requires_grad_(), e[:, 0:1].detach().requires_grad_()
    y = lm.ln_modulate(x, s, t)
    for _ in range(2):
        torch.autograd.grad(y, (x, s, t), torch.ones_like(y), retain_graph=True)
torch.cuda.synchronize()'
fi

# 7. summary against the targets
"$PY" - "$OUT/e2e.csv" "$OUT/bench_segments.csv" "$OUT/bench.csv" "$OUT/bench_widths.csv" \
  > "$OUT/summary.txt" 2>&1 <<'EOF'
import csv, sys
from collections import defaultdict


def read(path):
    try:
        return list(csv.DictReader(open(path)))
    except FileNotFoundError:
        print(f"no {path}: that part did not get to write it")
        return []


def f(row, key):
    return float(row[key]) if row and row.get(key) else float("nan")


rows = [r for path in sys.argv[3:] for r in read(path)]
t = defaultdict(dict)  # (D, S) -> {(impl, phase): row}
for r in rows:
    if r["source"] == "measured" and r.get("layout", "dense") == "dense":
        t[(int(r["D"]), int(r["S"]))][(r["impl"], r["phase"])] = r
print("kernel bench (measured; fused fwd_bwd vs the device-to-device copy of x)")
print("D S | fused us fwd/bwd/fwd_bwd | TB/s fwd_bwd | frac of copy | x eager fwd/bwd | "
      "x compile fwd/bwd/fwd_bwd | saved vs eager")
for (d, s), m in sorted(t.items()):
    fu = [f(m.get(("fused", p)), "median_us") for p in ("fwd", "bwd", "fwd_bwd")]
    ve = [f(m.get(("fused", p)), "speedup_vs_eager") for p in ("fwd", "bwd")]
    vc = [f(m.get(("fused", p)), "speedup_vs_compile") for p in ("fwd", "bwd", "fwd_bwd")]
    fb = m.get(("fused", "fwd_bwd"))
    print(f"{d} {s} | {fu[0]:.0f}/{fu[1]:.0f}/{fu[2]:.0f} | {f(fb, 'tbps'):.2f} | "
          f"{f(fb, 'frac_of_copy'):.2f} | {ve[0]:.2f}/{ve[1]:.2f} | "
          f"{vc[0]:.2f}/{vc[1]:.2f}/{vc[2]:.2f} | {f(m.get(('fused', 'saved')), 'saved_vs_eager'):.2f}")
print("targets: fwd_bwd frac >= 0.85 (D = 5120) / 0.75 (D = 1536) at S >= 16k; "
      "x compile >= 1.2 everywhere; saved vs eager <= 0.40")
seg_rows = read(sys.argv[2])
seg = defaultdict(dict)  # (D, L, G) -> {(impl, phase): row}
for r in seg_rows:
    if r["source"] == "measured":
        seg[(int(r["D"]), int(r["S"]), int(r["G"]))][(r["impl"], r["phase"])] = r
print("\npacked streams (measured; segment layout, L tokens in G uneven segments)")
print("D L G | fused us fwd/bwd/fwd_bwd | TB/s fwd_bwd | frac of copy | x eager gather "
      "fwd/bwd/fwd_bwd | x dense kernel fwd/bwd | saved vs eager")
for (d, n, g), m in sorted(seg.items()):
    fu = [f(m.get(("fused", p)), "median_us") for p in ("fwd", "bwd", "fwd_bwd")]
    ve = [f(m.get(("fused", p)), "speedup_vs_eager") for p in ("fwd", "bwd", "fwd_bwd")]
    vd = [f(m.get(("fused_dense", p)), "median_us") / f(m.get(("fused", p)), "median_us")
          for p in ("fwd", "bwd")]
    fb = m.get(("fused", "fwd_bwd"))
    print(f"{d} {n} {g} | {fu[0]:.0f}/{fu[1]:.0f}/{fu[2]:.0f} | {f(fb, 'tbps'):.2f} | "
          f"{f(fb, 'frac_of_copy'):.2f} | {ve[0]:.2f}/{ve[1]:.2f}/{ve[2]:.2f} | "
          f"{vd[0]:.2f}/{vd[1]:.2f} | {f(m.get(('fused', 'saved')), 'saved_vs_eager'):.2f}")
print("expected: x dense kernel ~1.0 (segment lookup free), saved vs eager ~0.17")
for r in rows + seg_rows:
    if r["phase"] == "error" or r["source"] == "skipped":
        print("error/skip:", r["impl"], r["D"], r["S"], r["note"][:300])

print("\nend to end (measured): one training step, activation checkpointing")
print("model S kernel | step s | peak GiB | x eager | GiB saved | precision | fused impl")
for r in read(sys.argv[1]):
    print(f"{r['model']} {r['S']} {r['kernel']} | {f(r, 'step_s'):.3f} | "
          f"{f(r, 'peak_mem_gib'):.2f} | {f(r, 'speedup_vs_eager'):.3f} | "
          f"{f(r, 'mem_saved_gib'):.2f} | {r['precision']} | {r['fused_impl']} {r['note']}")
EOF
cat "$OUT/summary.txt"
echo "total $(($(date +%s) - START)) s; outputs in $OUT"
cat "$OUT/steps.tsv"
pack
rm -rf "$BUILD"
# optional parts (opt_*) never fail the check
awk -F'\t' 'NR > 1 && $1 !~ /^opt_/ && $2 != 0 { bad = 1 } END { exit bad }' "$OUT/steps.tsv"
