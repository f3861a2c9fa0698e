#!/usr/bin/env bash
# Build, test and benchmark the fused LayerNorm-Modulate kernel on a GPU machine, in one go,
# writing everything under OUTDIR (target: <= 5 minutes on an H200).
#
#   kernels/gpu_check.sh OUTDIR
#
# Needs only python with torch (CUDA build), nvcc and ninja: no `pip install -e .` (the repo
# goes on PYTHONPATH), no typer/mlflow/pandas (the build and bench modules run directly).
# Uses pytest when importable, else runs the CUDA test module as a script.
# Outputs: env.txt, build.json, build.log, ptxas.txt, cuda_tests.log (+ .xml with pytest),
# cpu_op_tests.log, bench.csv, bench.log, bench_nopipe.csv (backward without its cp.async
# pipeline), summary.txt, steps.tsv (status and seconds per step).
# Environment: PYTHON (default python3), ARCH (default 9.0), BENCH_TIMEOUT_S (default 150),
# ALLOW_NO_GPU=1 (dry run on a GPU-less machine: carry on past the availability check; the
# CUDA tests then skip and the bench writes a skip record).
set -uo pipefail

OUT=${1:?usage: kernels/gpu_check.sh OUTDIR}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
ARCH=${ARCH:-9.0}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD=$(mktemp -d "${TMPDIR:-/tmp}/adaptiveload-kernel.XXXXXX")
cd "$REPO" || exit 1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PATH="$CUDA_HOME/bin:$(dirname "$(command -v "$PY")"):$PATH"
export MAX_JOBS=${MAX_JOBS:-8}
export ADAPTIVELOAD_KERNEL_LIB="$BUILD/adaptiveload_kernels.so"
export PYTHONUNBUFFERED=1
START=$(date +%s)
printf 'step\tstatus\tseconds\n' > "$OUT/steps.tsv"

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
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. build (the record says built/skipped/failed and why)
step build 150 "$OUT/build.log" "$PY" -m adaptiveload.ops.kernel_build --out "$BUILD" --arch "$ARCH"
cp "$BUILD/build.json" "$OUT/build.json" 2>/dev/null
if ! "$PY" -c 'import sys; from adaptiveload.ops import ln_modulate as lm; r = lm.fused_unavailable_reason(); print("fused kernel:", r or "available"); sys.exit(1 if r else 0)' >> "$OUT/build.log" 2>&1 && [ "${ALLOW_NO_GPU:-0}" != 1 ]; then
  tail -n 3 "$OUT/build.log"
  echo "fused kernel not usable: see $OUT/build.log" | tee "$OUT/summary.txt"
  exit 1
fi

# 2. register/spill report of the kernels as compiled (for tuning), on the CPU in the
#    background while the GPU runs the tests
SM=${ARCH%%;*}
SM=${SM/./}
(
  for cu in ln_modulate_fwd ln_modulate_bwd; do
    "$CUDA_HOME/bin/nvcc" -O3 -std=c++17 "-gencode=arch=compute_$SM,code=sm_$SM" \
      -Xptxas -v -c "kernels/$cu.cu" -o "$BUILD/$cu.ptxas.o" 2>&1 |
      grep -E "Compiling entry|registers|spill" | paste - - - |
      sed -E 's/.*entry function .([^ ]+). for.*stack frame, ([0-9]+) bytes spill stores.*Used ([0-9]+) registers.*/\1 spill_stores=\2 registers=\3/'
  done > "$OUT/ptxas.txt" 2>&1
) &
PTXAS_PID=$!

# 3. CUDA tests (pytest if present, else the module as a script)
if "$PY" -c 'import pytest' 2>/dev/null; then
  step cuda_tests 120 "$OUT/cuda_tests.log" "$PY" -m pytest tests/test_kernel_cuda.py -q -rs \
    -p no:cacheprovider --noconftest -o addopts="" -o timeout=0 --junitxml="$OUT/cuda_tests.xml"
  step cpu_op_tests 60 "$OUT/cpu_op_tests.log" "$PY" -m pytest tests/test_kernel_ops.py -q -rs \
    -p no:cacheprovider --noconftest -o addopts="" -o timeout=0
else
  step cuda_tests 120 "$OUT/cuda_tests.log" "$PY" tests/test_kernel_cuda.py
fi

# 4. benchmark (CSV rewritten after every shape, so a timeout keeps what was measured)
SKIP_OK=()
[ "${ALLOW_NO_GPU:-0}" = 1 ] && SKIP_OK=(--skip-ok)
step bench "${BENCH_TIMEOUT_S:-150}" "$OUT/bench.log" \
  "$PY" -m adaptiveload.ops.kernel_bench -o "$OUT/bench.csv" ${SKIP_OK[@]+"${SKIP_OK[@]}"}

# 4b. A/B: the backward without its cp.async pipeline (fused only, two shapes)
step bench_nopipe 45 "$OUT/bench_nopipe.log" \
  env ADAPTIVELOAD_LN_BWD_PIPELINE=0 "$PY" -m adaptiveload.ops.kernel_bench -o "$OUT/bench_nopipe.csv" --impls fused \
  --seq-lens 16384,75600 ${SKIP_OK[@]+"${SKIP_OK[@]}"}

wait "$PTXAS_PID"

# 5. summary against the issue's targets
"$PY" - "$OUT/bench.csv" > "$OUT/summary.txt" 2>&1 <<'EOF'
import csv, sys
from collections import defaultdict

try:
    rows = list(csv.DictReader(open(sys.argv[1])))
except FileNotFoundError:
    sys.exit(f"no {sys.argv[1]}: the bench did not get to write it")
t = defaultdict(dict)  # (D, S) -> {(impl, phase): row}
for r in rows:
    if r["source"] == "measured":
        t[(int(r["D"]), int(r["S"]))][(r["impl"], r["phase"])] = r

def f(row, key):
    return float(row[key]) if row and row.get(key) else float("nan")

print("D S | fused us fwd/bwd/fwd_bwd | x eager fwd/bwd | x compile fwd/bwd/fwd_bwd | "
      "fwd_bwd frac of copy | saved fused/eager")
for (d, s), m in sorted(t.items()):
    fu = [f(m.get(("fused", p)), "median_us") for p in ("fwd", "bwd", "fwd_bwd")]
    ve = [f(m.get(("fused", p)), "speedup_vs_eager") for p in ("fwd", "bwd")]
    vc = [f(m.get(("fused", p)), "speedup_vs_compile") for p in ("fwd", "bwd", "fwd_bwd")]
    frac = f(m.get(("fused", "fwd_bwd")), "frac_of_copy")
    saved = f(m.get(("fused", "saved")), "saved_bytes") / f(m.get(("eager", "saved")), "saved_bytes")
    print(f"{d} {s} | {fu[0]:.0f}/{fu[1]:.0f}/{fu[2]:.0f} | {ve[0]:.2f}/{ve[1]:.2f} | "
          f"{vc[0]:.2f}/{vc[1]:.2f}/{vc[2]:.2f} | {frac:.2f} | {saved:.2f}")
print("targets: fwd_bwd frac >= 0.85 at S >= 16k; x eager fwd >= 3, bwd >= 1.5; "
      "x compile >= 1; saved ratio <= 0.40")
errors = [r for r in rows if r["phase"] == "error"]
for r in errors:
    print("error:", r["impl"], r["D"], r["S"], r["note"][:300])
EOF
cat "$OUT/summary.txt"
echo "total $(($(date +%s) - START)) s; outputs in $OUT"
cat "$OUT/steps.tsv"
rm -rf "$BUILD"
awk -F'\t' 'NR > 1 && $2 != 0 { bad = 1 } END { exit bad }' "$OUT/steps.tsv"
