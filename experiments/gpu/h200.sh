#!/usr/bin/env bash
# Issue 9 in one run on an H200: the fused kernel (build, CUDA tests, bench), the measured
# calibration of Wan 2.1 T2V-1.3B, and a short emulated 16-rank training under the three
# policies, eager and fused. Everything lands under OUTDIR; with PACKDIR, a tarball of OUTDIR
# plus summary.txt are refreshed in PACKDIR after every step, so a run cut short still
# returns what it measured (the device tool brings back at most 8 files from $OUT).
#
#   experiments/gpu/h200.sh OUTDIR [PACKDIR]          # on the GPU machine (README.md here)
#   DRY_RUN=1 experiments/gpu/h200.sh /tmp/h200-dry   # the same plumbing on CPU, tiny
#
# Environment:
#   PYTHON        interpreter (default python3; the device's holds torch 2.11 cu130)
#   WHEELS        folder of carried wheels installed first (default <repo>/.whl, if present;
#                 experiments/gpu/fetch_wheels.sh fills it)
#   PARTS         subset of "kernel calibrate train" (default all; for a partial rerun)
#   TOTAL_BUDGET_S  whole-run limit the step limits are cut to (default 530)
#   KERNEL_CAP_S, CALIBRATE_CAP_S, TRAIN_BUDGET_S, TRAIN_RUN_CAP_S  per-step limits
#   TRAIN_STEPS, TRAIN_POLICIES, TRAIN_KERNELS, TRAIN_CONFIG  the training part
#   CAL_TOKENS, CAL_BATCH_SIZES, CAL_MAX_BATCH_TOKENS, CAL_REPEATS  the calibration grid
#   CALIBRATION   skip measuring: train with this calibration file instead
#   REPO_COMMIT   the commit the tree was sent from (recorded in env.txt)
# Outputs (OUTDIR): env.txt, env.json, steps.tsv (part, status, seconds), summary.txt,
#   summary.json, kernel/ (kernels/gpu_check.sh), calibration/, train/<policy>-<kernel>/.
set -uo pipefail

OUTDIR=${1:?usage: experiments/gpu/h200.sh OUTDIR [PACKDIR]}
PACKDIR=${2:-}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DRY=${DRY_RUN:-0}
PY=${PYTHON:-python3}
PARTS=${PARTS:-kernel calibrate train}
TOTAL=${TOTAL_BUDGET_S:-530}
START=$(date +%s)
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
[ -n "$PACKDIR" ] && mkdir -p "$PACKDIR" && PACKDIR=$(cd "$PACKDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/h200-check.XXXXXX")
cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MLFLOW_ENABLE_TELEMETRY=false DO_NOT_TRACK=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = 1 ]; then  # tiny, CPU, and without the packages the device lacks
  DEVICE=cpu MODEL=wan2.1-micro
  # process CPU time with one thread: the stable timer on a shared machine
  CAL_ARGS=(--capacity-gb 0.08 --mixture tiny-cpu --num-samples 1000 --threads 1 --timer cpu)
  CAL_TOKENS=${CAL_TOKENS:-64,256,1024} CAL_BATCH_SIZES=${CAL_BATCH_SIZES:-1,2}
  CAL_MAX_BATCH_TOKENS=${CAL_MAX_BATCH_TOKENS:-1024} CAL_REPEATS=${CAL_REPEATS:-1}
  TRAIN_CONFIG=${TRAIN_CONFIG:-experiments/gpu/dry_train.yaml} TRAIN_STEPS=${TRAIN_STEPS:-3}
  export OMP_NUM_THREADS=1 ALLOW_NO_GPU=1 BENCH_TIMEOUT_S=30
  # the device has no mlflow/snakemake/diffusers/av/seaborn: prove nothing here needs them
  mkdir -p "$WORK/block" && cat > "$WORK/block/sitecustomize.py" <<'EOF'
import sys
for name in ("mlflow", "snakemake", "diffusers", "av", "seaborn", "flash_attn"):
    sys.modules[name] = None  # `import name` now raises ImportError
EOF
  export PYTHONPATH="$WORK/block:$PYTHONPATH"
else
  DEVICE=cuda MODEL=wan2.1-t2v-1.3b
  CAL_ARGS=(--mixture paper-mixed --num-samples 20000)
  # images (1,560) .. 81 frames 720p (75,600); B=2 only up to 32,760 (B=2 x 75.6k: ~25 s/step)
  CAL_TOKENS=${CAL_TOKENS:-1560,4680,16380,32760,75600} CAL_BATCH_SIZES=${CAL_BATCH_SIZES:-1,2}
  # one timed pass after the probe step: a 75.6k step is ~12 s, where a pass more costs more
  # than it tells; a run that overran its limit would leave no file at all
  CAL_MAX_BATCH_TOKENS=${CAL_MAX_BATCH_TOKENS:-65520} CAL_REPEATS=${CAL_REPEATS:-1}
  TRAIN_CONFIG=${TRAIN_CONFIG:-experiments/gpu/h200_train.yaml} TRAIN_STEPS=${TRAIN_STEPS:-5}
  export BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-100}
fi
TRAIN_POLICIES=${TRAIN_POLICIES:-equal-token adaptiveload adaptiveload-balanced}
TRAIN_KERNELS=${TRAIN_KERNELS:-eager fused}

printf 'part\tstatus\tseconds\n' > "$OUTDIR/steps.tsv"
elapsed() { echo $(($(date +%s) - START)); }
limit() {  # limit WANT [RESERVE]: WANT seconds, cut so RESERVE seconds of the total remain
  local left=$((TOTAL - $(elapsed) - ${2:-0}))
  echo $((left < $1 ? left : $1))
}
pack() {  # refresh PACKDIR's tarball and summary (atomically: a kill mid-pack keeps the old)
  [ -z "$PACKDIR" ] && return 0
  tar czf "$PACKDIR/.h200-results.tar.gz" -C "$(dirname "$OUTDIR")" "$(basename "$OUTDIR")" \
    && mv "$PACKDIR/.h200-results.tar.gz" "$PACKDIR/h200-results.tar.gz"
  [ -f "$OUTDIR/summary.txt" ] && cp "$OUTDIR/summary.txt" "$PACKDIR/summary.txt"
  return 0
}
run_part() {  # run_part NAME LIMIT_S LOG CMD...: time-limited, status + seconds in steps.tsv
  local name=$1 lim=$2 log=$3 t0 rc
  shift 3
  t0=$(date +%s)
  if [ "$lim" -lt 5 ]; then
    echo "== $name: skipped, no time left ($(elapsed)s elapsed)"
    printf '%s\tskipped\t0\n' "$name" >> "$OUTDIR/steps.tsv"
    return 124
  fi
  echo "== $name (limit ${lim}s, $(elapsed)s elapsed)"
  timeout --kill-after=10 "$lim" "$@" > "$log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" >> "$OUTDIR/steps.tsv"
  tail -c 4000 "$log" | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -n 3 | cut -c1-300
  pack
  return $rc
}
wants() { [[ " $PARTS " == *" $1 "* ]]; }

# --- 0. carried wheels, then what this interpreter has --------------------------------------
WHEELS=${WHEELS:-$REPO/.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  if [ "$DRY" = 1 ]; then  # another Python here: install for the device's (cp312) to check
    run_part wheels 120 "$OUTDIR/wheels.log" "$PY" -m pip install --no-index --no-deps \
      --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --target "$WORK/site-cp312" "$WHEELS"/*.whl
  else
    run_part wheels 120 "$OUTDIR/wheels.log" "$PY" -m pip install --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$WHEELS"/*.whl \
      && export PYTHONPATH="$WORK/site:$PYTHONPATH"
  fi
fi
{
  echo "date: $(date -u +%FT%TZ)"
  # .git does not travel to the device: the caller passes REPO_COMMIT
  echo "repo commit: ${REPO_COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "dry run: $DRY"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory \
    --format=csv 2>&1 | head -n 3
  "$CUDA_HOME/bin/nvcc" --version 2>&1 | tail -n 1
} > "$OUTDIR/env.txt"
run_part preflight 60 "$OUTDIR/preflight.log" "$PY" - "$OUTDIR/env.json" "$DEVICE" <<'EOF'
"""Versions of everything the check imports, and the imports themselves, before any GPU work."""
import importlib
import importlib.metadata as md
import json
import platform
import sys

out, device = sys.argv[1], sys.argv[2]
dists = {"torch": "torch", "triton": "triton", "numpy": "numpy", "pandas": "pandas",
         "pyarrow": "pyarrow", "scipy": "scipy", "typer": "typer", "click": "click",
         "yaml": "PyYAML", "jsonschema": "jsonschema", "tqdm": "tqdm",
         "safetensors": "safetensors", "pytest": "pytest", "flash_attn": "flash-attn"}
versions = {"python": platform.python_version()}
for module, dist in dists.items():
    try:
        importlib.import_module(module)
        versions[module] = md.version(dist)
    except ImportError:
        versions[module] = None
    except md.PackageNotFoundError:
        versions[module] = "present"
import torch  # noqa: E402

env = {"versions": versions, "torch_cuda": torch.version.cuda, "cuda_available":
       torch.cuda.is_available(), "device": torch.cuda.get_device_name() if
       torch.cuda.is_available() else platform.processor() or platform.machine()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    env.update(total_memory=p.total_memory, sm_count=p.multi_processor_count,
               capability=f"{p.major}.{p.minor}")
json.dump(env, open(out, "w"), indent=1)
print(json.dumps(env))
# the CLI and every module the parts use (a missing package fails here, not after minutes)
for mod in ("adaptiveload.cli", "adaptiveload.config", "adaptiveload.calibration",
            "adaptiveload.tracking.session", "adaptiveload.training.loop",
            "adaptiveload.ops.kernel_build", "adaptiveload.ops.kernel_bench"):
    importlib.import_module(mod)
for stage in importlib.import_module("adaptiveload.cli").STAGES:
    importlib.import_module(f"adaptiveload.cli.{stage}")
# the run outputs are Parquet: the (carried) pandas must work with this pyarrow
import os, tempfile  # noqa: E401, E402
import pandas as pd  # noqa: E402
from adaptiveload.io import write_parquet  # noqa: E402
with tempfile.TemporaryDirectory() as tmp:
    frame = pd.DataFrame({"step": [0, 1], "peak_bytes": pd.array([1.0, None], "Float64")})
    write_parquet(os.path.join(tmp, "t.parquet"), frame)
    assert pd.read_parquet(os.path.join(tmp, "t.parquet")).equals(frame), "parquet round trip"
if device == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible")
print("imports ok")
EOF
[ $? -ne 0 ] && { echo "preflight failed: see $OUTDIR/preflight.log"; cat "$OUTDIR/preflight.log"; }

# --- 1. kernel: build, CUDA tests, bench (kernels/gpu_check.sh), plus a kept build for training
KLIB_DIR="$WORK/kernel-lib"
if [ "$DRY" != 1 ] && { wants kernel || wants train; }; then
  # a second build of the same sources, kept for the fused training runs (gpu_check deletes
  # its own); it runs beside gpu_check's build, before anything is timed there
  ( timeout 240 "$PY" -m adaptiveload.ops.kernel_build --out "$KLIB_DIR" --arch "${ARCH:-9.0}" \
      > "$OUTDIR/train_kernel_build.log" 2>&1 ) &
  KBUILD_PID=$!
fi
if wants kernel; then
  mkdir -p "$OUTDIR/kernel"
  run_part kernel "$(limit "${KERNEL_CAP_S:-240}" 250)" "$OUTDIR/kernel.log" \
    bash kernels/gpu_check.sh "$OUTDIR/kernel"
fi
[ -n "${KBUILD_PID:-}" ] && wait "$KBUILD_PID"
cp "$KLIB_DIR/build.json" "$OUTDIR/train_kernel_build.json" 2>/dev/null

# --- 2. calibration: measured (B, S) grid of the 1.3B, fit, p / M_mem / M_comp -----------------
mkdir -p "$OUTDIR/calibration" "$OUTDIR/train"
CAL=${CALIBRATION:-}
[ -n "$CAL" ] && cp "$CAL" "$OUTDIR/calibration/"  # a rerun's tree names what it used
if [ -z "$CAL" ] && wants calibrate; then
  CAL="$OUTDIR/calibration/h200-$MODEL.json"
  [ "$DRY" = 1 ] && CAL="$OUTDIR/calibration/dry-$MODEL.json"
  run_part calibrate "$(limit "${CALIBRATE_CAP_S:-150}" 100)" "$OUTDIR/calibration/calibrate.log" \
    "$PY" -m adaptiveload calibrate --model "$MODEL" --device "$DEVICE" \
    --activation-checkpointing --batch-sizes "$CAL_BATCH_SIZES" --tokens "$CAL_TOKENS" \
    --max-batch-tokens "$CAL_MAX_BATCH_TOKENS" --repeats "$CAL_REPEATS" --warmup 0 \
    "${CAL_ARGS[@]}" -o "$CAL" || CAL=""
fi

# --- 3. training: 16 emulated ranks, policies x kernels, budgets for the short run ---------------
if wants train; then
  TRAIN_DEADLINE=$(($(elapsed) + ${TRAIN_BUDGET_S:-220}))
  if [ -z "$CAL" ] || [ ! -f "$CAL" ]; then  # no measurement: the shipped prior (source: model)
    CAL="experiments/calibration/h200-$MODEL.json"
    [ "$DRY" = 1 ] && CAL="$OUTDIR/calibration/dry-$MODEL.json"
    echo "training with $CAL (no measured calibration)"
  fi
  TCAL="$OUTDIR/train/calibration-train.json"
  run_part train_budgets 60 "$OUTDIR/train/budgets.log" "$PY" experiments/gpu/train_budgets.py \
    --calibration "$CAL" --config "$TRAIN_CONFIG" -o "$TCAL"
  for kernel in $TRAIN_KERNELS; do
    KENV=()
    if [ "$kernel" = fused ]; then
      KENV=(env "ADAPTIVELOAD_KERNEL_LIB=$KLIB_DIR/adaptiveload_kernels.so")
      if [ "$DRY" != 1 ] && ! "${KENV[@]}" "$PY" -c 'import sys; from adaptiveload.ops import ln_modulate as lm; r = lm.fused_unavailable_reason(); print("fused kernel:", r or "available"); sys.exit(1 if r else 0)' > "$OUTDIR/train/fused_check.log" 2>&1; then
        echo "== fused training skipped: $(tail -n 1 "$OUTDIR/train/fused_check.log")"
        printf 'train-%s\tskipped\t0\n' "$kernel" >> "$OUTDIR/steps.tsv"
        continue
      fi
    fi
    for policy in $TRAIN_POLICIES; do
      left=$((TRAIN_DEADLINE - $(elapsed)))
      run_part "train-$policy-$kernel" "$(limit "$((left < ${TRAIN_RUN_CAP_S:-75} ? left : ${TRAIN_RUN_CAP_S:-75}))" 8)" \
        "$OUTDIR/train/$policy-$kernel.log" ${KENV[@]+"${KENV[@]}"} "$PY" -m adaptiveload train \
        --config "$TRAIN_CONFIG" --policy "$policy" --seed 0 --kernel "$kernel" \
        --steps "$TRAIN_STEPS" --emulate-world-size 16 --device "$DEVICE" --calibration "$TCAL" \
        --no-track --no-checkpoint --out "$OUTDIR/train/$policy-$kernel"
    done
  done
fi

# --- 4. summary -----------------------------------------------------------------------------
"$PY" experiments/gpu/summarize.py "$OUTDIR" > "$OUTDIR/summary.log" 2>&1
cat "$OUTDIR/summary.txt" 2>/dev/null || cat "$OUTDIR/summary.log"
pack
rm -rf "$WORK"
echo "total $(elapsed) s; outputs in $OUTDIR${PACKDIR:+ (packed in $PACKDIR)}"
cat "$OUTDIR/steps.tsv"
awk -F'\t' 'NR > 1 && $2 != 0 { bad = 1 } END { exit bad }' "$OUTDIR/steps.tsv"
