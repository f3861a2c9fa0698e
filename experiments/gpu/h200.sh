#!/usr/bin/env bash
# The device check, v2: everything this repository needs measured on one H200, in one run of
# at most TOTAL_BUDGET_S seconds (530), each part under its own `timeout`, and each part's
# outputs packed into its own tarball in PACKDIR as soon as it ends (so a run cut short still
# leaves an archive of every part that finished; files over 12 MB, i.e. long logs, stay out):
#
#   dist         `torchrun --nproc-per-node 2 -m adaptiveload train`, two processes sharing
#                the GPU over gloo (DDP; the multi-process CUDA path: LOCAL_RANK, CUDA events)
#   kernel       experiments/gpu/kernel_check.sh (build, CUDA tests, bench of every width,
#                eager vs fused)
#   calibration  `adaptiveload calibrate measure` of Wan 2.1 T2V-1.3B with $CAL_FLAGS (grid
#                rules, mixed packs held out of the fit, per-micro-batch validation)
#   comm         `torchrun --nproc-per-node <visible GPUs> -m adaptiveload calibrate comm`: the
#                all-to-all of sequence parallelism over NCCL, against bytes and degree, into
#                a copy of the calibration; `not-applicable` (reason in comm/skipped.txt, ~0 s)
#                with fewer than 2 GPUs: two processes sharing one GPU would time host copies
#   train        16 emulated ranks of the 1.3B on micro-batches of 12k-18k tokens (not
#                overhead-bound), each policy eager, then fused while time is left; measured
#                vs predicted imbalance per policy in summary.txt
#
#   bash experiments/gpu/h200.sh OUTDIR [PACKDIR]         # on the H200 machine (README.md here)
#   DRY_RUN=1 bash experiments/gpu/h200.sh OUTDIR PACKDIR  # the same plumbing on CPU, tiny
#
# Environment: PYTHON (default python3), WHEELS (default <repo>/.whl; *.whl there are
# installed first, for a machine without PyPI access), PARTS (subset of "dist kernel calibrate
# comm train"), CALIBRATION (train with this file, no calibrate), REPO_COMMIT (recorded; for a
# copied tree without .git), TOTAL_BUDGET_S, DIST_S, KERNEL_S, CALIBRATE_S, COMM_S, TRAIN_RUN_S
# (limits),
# TRAIN_STEPS, TRAIN_POLICIES, TRAIN_KERNELS, TRAIN_FILL (M_mem over the longest training
# bucket). Exit status 0 when every part finished (or was not-applicable here), else 1.
# Outputs (OUTDIR): env.txt, env.json, steps.tsv (part, status, seconds), summary.txt/.json,
# dist/, kernel/, calibration/, comm/, train/; PACKDIR: env.tar.gz, <part>.tar.gz,
# summary.txt, steps.tsv.
set -uo pipefail

# The calibration's flags, in one place: the grid (B = 1 at every size up to the 81-frame
# 75,600 tokens, whatever the cap; B = 2 up to 65,520 tokens), one warm-up step per point, two
# timed passes, four mixed packs held out of the fit (additivity: images and 480p clips under
# the floor, many short segments, medium and long clips with short ones; ~25 s of steps), and
# 24 micro-batches of the policies' 16-rank plans timed against the fit's prediction (only
# those predicted under 2 s: paper-scale micro-batches take ~15 s each, the large ones are
# covered by the grid). After the fit, `calibrate measure` measures peak memory (one pass
# each, no warm-up) at M_mem and at the largest pack of the 16-rank packed plan of the
# mixture, beyond the grid's 65,520 tokens, and fits memory again with them (for the 1.3B:
# ~250k-290k tokens of 1,560-token samples, ~10-15 s each by the first fit; a point out of
# memory is recorded as such): CALIBRATE_S leaves room for them.
CAL_FLAGS_CUDA="--batch-sizes 1,2 --tokens 1560,3120,7200,16380,32760,50400,75600 \
--max-batch-tokens 65520 --warmup 1 --repeats 2 \
--pack floor=3120,1560,1560 --pack short=7200,3120,1560,1560,1560,1560 \
--pack medium=16380,7200,1560,1560 --pack long=32760,7200,1560,1560 \
--validate 24 --validate-world-size 16 --validate-max-seconds 2"
CAL_FLAGS_DRY="--batch-sizes 1,2 --tokens 64,256,1024 --max-batch-tokens 1024 --warmup 1 --repeats 2 \
--pack short=221,64,16 --pack mixed=1024,221 --validate 4 --validate-world-size 4"
# The all-to-all calibration's flags: on CUDA its defaults (64 KiB .. 64 MiB per rank, x4;
# 3 warm-up and 10 timed calls per point: well under a second of NCCL traffic per degree, the
# part's time is the processes' start); in a dry run 2 gloo processes on the CPU, 3 sizes up to
# 16 MiB (transfer-bound even on a loaded CPU, so the fit has a bandwidth), 3 timed calls.
COMM_FLAGS_CUDA=""
COMM_FLAGS_DRY="--sizes 4096,1048576,16777216 --warmup 1 --repeats 3"

OUTDIR=${1:?usage: experiments/gpu/h200.sh OUTDIR [PACKDIR]}
PACKDIR=${2:-}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DRY=${DRY_RUN:-0}
PY=${PYTHON:-python3}
PARTS=${PARTS:-dist kernel calibrate comm train}
TOTAL=${TOTAL_BUDGET_S:-530}
START=$(date +%s)
mkdir -p "$OUTDIR" && OUTDIR=$(cd "$OUTDIR" && pwd)
[ -n "$PACKDIR" ] && mkdir -p "$PACKDIR" && PACKDIR=$(cd "$PACKDIR" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/h200-check.XXXXXX")
cd "$REPO" || exit 1
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 MLFLOW_ENABLE_TELEMETRY=false DO_NOT_TRACK=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [ "$DRY" = 1 ]; then  # tiny, CPU, and without the packages no part may need
  DEVICE=cpu MODEL=wan2.1-micro
  # process CPU time with one thread: the stable timer on a shared machine
  CAL_ARGS=($CAL_FLAGS_DRY --capacity-gb 0.08 --mixture tiny-cpu --num-samples 1000 --threads 1
            --timer cpu)
  TRAIN_CONFIG=experiments/gpu/dry_train.yaml
  TRAIN_STEPS=${TRAIN_STEPS:-2}
  # kernel_check's nvcc build takes minutes on a small CPU: the dry run proves the part's limit
  KERNEL_S=${KERNEL_S:-10}
  # a shared CPU is slow at starting Python processes: wide limits, the plumbing is the point
  TOTAL=${TOTAL_BUDGET_S:-1500} DIST_S=${DIST_S:-240} CALIBRATE_S=${CALIBRATE_S:-300}
  TRAIN_RUN_S=${TRAIN_RUN_S:-200} COMM_S=${COMM_S:-240} COMM_ARGS=($COMM_FLAGS_DRY)
  # the plumbing of a one-shape and a packed policy under both kernels
  TRAIN_POLICIES=${TRAIN_POLICIES:-equal-token adaptiveload-packed}
  export OMP_NUM_THREADS=1 ALLOW_NO_GPU=1 BENCH_TIMEOUT_S=30
  # no part may need mlflow/snakemake/diffusers/av/seaborn/flash-attn: make them unimportable
  mkdir -p "$WORK/block" && cat > "$WORK/block/sitecustomize.py" <<'PY'
import sys
for name in ("mlflow", "snakemake", "diffusers", "av", "seaborn", "flash_attn"):
    sys.modules[name] = None  # `import name` now raises ImportError
PY
  export PYTHONPATH="$WORK/block:$PYTHONPATH"
else
  DEVICE=cuda MODEL=wan2.1-t2v-1.3b
  CAL_ARGS=($CAL_FLAGS_CUDA --activation-checkpointing --mixture paper-mixed --num-samples 20000)
  COMM_ARGS=($COMM_FLAGS_CUDA)
  TRAIN_CONFIG=experiments/gpu/h200_train.yaml
  TRAIN_STEPS=${TRAIN_STEPS:-2}
  # kernel_check's steps, cut so that the segment tests and benches run inside KERNEL_S
  # (build ~60 s and the dense CUDA tests ~20 s come first; ncu only if time is left)
  KERNEL_S=${KERNEL_S:-200}
  export BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-40} SEGMENT_TESTS_TIMEOUT_S=${SEGMENT_TESTS_TIMEOUT_S:-40}
  export BENCH_SEGMENTS_TIMEOUT_S=${BENCH_SEGMENTS_TIMEOUT_S:-25}
  export BENCH_WIDTHS_TIMEOUT_S=${BENCH_WIDTHS_TIMEOUT_S:-15} E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-50}
  export NCU_START_BEFORE_S=${NCU_START_BEFORE_S:-140}
fi
# the packed policy early: when the budget runs out, the paper's own policy is the one cut
TRAIN_POLICIES=${TRAIN_POLICIES:-equal-token adaptiveload-packed adaptiveload-balanced adaptiveload}
TRAIN_KERNELS=${TRAIN_KERNELS:-eager fused}

printf 'part\tstatus\tseconds\n' > "$OUTDIR/steps.tsv"
elapsed() { echo $(($(date +%s) - START)); }
limit() {  # limit WANT [RESERVE]: WANT seconds, cut so RESERVE seconds of the total remain
  local left=$((TOTAL - $(elapsed) - ${2:-0}))
  echo $((left < $1 ? left : $1))
}
pack() {  # pack [PART]: PART's folder (and the top-level files) into PACKDIR, atomically
  [ -z "$PACKDIR" ] && return 0
  local base name
  base=$(basename "$OUTDIR")
  if [ -n "${1:-}" ] && [ -d "$OUTDIR/$1" ]; then  # files over 12 MB stay behind (logs)
    (cd "$(dirname "$OUTDIR")" && find "$base/$1" -type f -size -12M -print0 \
      | tar czf "$PACKDIR/.$1.tar.gz" --null -T -) && mv "$PACKDIR/.$1.tar.gz" "$PACKDIR/$1.tar.gz"
  fi
  (cd "$(dirname "$OUTDIR")" && find "$base" -maxdepth 1 -type f -size -12M -print0 \
    | tar czf "$PACKDIR/.env.tar.gz" --null -T -) && mv "$PACKDIR/.env.tar.gz" "$PACKDIR/env.tar.gz"
  for name in summary.txt steps.tsv; do
    [ -f "$OUTDIR/$name" ] && cp "$OUTDIR/$name" "$PACKDIR/$name"
  done
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
  return $rc
}
wants() { [[ " $PARTS " == *" $1 "* ]]; }
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# --- 0. wheels from WHEELS (for a machine without PyPI access), versions, imports ----------
WHEELS=${WHEELS:-$REPO/.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  if [ "$DRY" = 1 ]; then  # another Python here: install for an H200 machine's (cp312) to check
    run_part wheels 60 "$OUTDIR/wheels.log" "$PY" -m pip install --no-index --no-deps \
      --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --target "$WORK/site-cp312" "$WHEELS"/*.whl
  else
    run_part wheels 60 "$OUTDIR/wheels.log" "$PY" -m pip install --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$WHEELS"/*.whl \
      && export PYTHONPATH="$WORK/site:$PYTHONPATH"
  fi
fi
{
  echo "date: $(date -u +%FT%TZ)"
  echo "repo commit: ${REPO_COMMIT:-$(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "dry run: $DRY"
  echo "calibration flags: ${CAL_ARGS[*]}"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory \
    --format=csv 2>&1 | head -n 3
  "$CUDA_HOME/bin/nvcc" --version 2>&1 | tail -n 1
  # what the kernel builds compile: kernels/ of this tree (kernel_sources)
  "$PY" -c 'from adaptiveload.ops.kernel_sources import SOURCE_DIR, sources_digest as d; print(f"kernel sources: {SOURCE_DIR} (sources_digest {d()})")' 2>&1
} > "$OUTDIR/env.txt"
run_part preflight 60 "$OUTDIR/preflight.log" "$PY" experiments/gpu/preflight.py \
  "$OUTDIR/env.json" "$DEVICE" || cat "$OUTDIR/preflight.log"
pack

# --- 1. the kept kernel build for fused training (beside the parts below, before any timing)
KLIB_DIR="$WORK/kernel-lib"
if [ "$DRY" != 1 ] && wants train; then
  ( timeout 240 "$PY" -m adaptiveload.ops.kernel_build --build-dir "$KLIB_DIR" --arch "${ARCH:-9.0}" \
      > "$WORK/train_kernel_build.log" 2>&1; cp "$WORK/train_kernel_build.log" "$OUTDIR/" ) &
  KBUILD_PID=$!
fi

# --- 2. dist: two processes, one GPU, gloo, DDP through the README's entry point --------------
if wants dist; then
  mkdir -p "$OUTDIR/dist"
  run_part dist "$(limit "${DIST_S:-45}" 420)" "$OUTDIR/dist/torchrun.log" \
    env ADAPTIVELOAD_DIST_BACKEND=gloo "$PY" -m torch.distributed.run --nproc-per-node 2 \
    --master-addr 127.0.0.1 --master-port "$(free_port)" -m adaptiveload train \
    --config experiments/gpu/dist_check.yaml --policy adaptiveload --seed 0 --kernel eager \
    --device "$DEVICE" --no-track --no-checkpoint --out "$OUTDIR/dist/ddp"
  pack dist
fi

# --- 3. kernel: experiments/gpu/kernel_check.sh under its limit -------------------------------------------
if wants kernel; then
  mkdir -p "$OUTDIR/kernel"
  run_part kernel "$(limit "${KERNEL_S:-200}" 280)" "$OUTDIR/kernel.log" \
    bash experiments/gpu/kernel_check.sh "$OUTDIR/kernel"
  pack kernel
fi

# --- 4. calibration: the measured (B, S) grid of the model, the fit, its validation -----------
mkdir -p "$OUTDIR/calibration"
CAL=${CALIBRATION:-}
[ -n "$CAL" ] && cp "$CAL" "$OUTDIR/calibration/"  # a rerun's tree names what it used
if [ -z "$CAL" ] && wants calibrate; then
  CAL="$OUTDIR/calibration/h200-$MODEL.json"
  [ "$DRY" = 1 ] && CAL="$OUTDIR/calibration/dry-$MODEL.json"
  run_part calibrate "$(limit "${CALIBRATE_S:-190}" 110)" "$OUTDIR/calibration/calibrate.log" \
    "$PY" -m adaptiveload calibrate measure --model "$MODEL" --device "$DEVICE" "${CAL_ARGS[@]}" \
    -o "$CAL" || CAL=""
  pack calibration
fi

# --- 4b. comm: the all-to-all of sequence parallelism, on every visible GPU -------------------
if wants comm; then
  mkdir -p "$OUTDIR/comm"
  # the GPUs torch sees (preflight's env.json; none on a CPU), read without starting Python
  GPUS=$(sed -n 's/^ *"gpus": \([0-9]*\).*/\1/p' "$OUTDIR/env.json" 2>/dev/null)
  NPROC=${GPUS:-0}
  [ "$DRY" = 1 ] && NPROC=2  # the plumbing: 2 gloo processes on the CPU
  if [ "$NPROC" -lt 2 ]; then  # recorded, not faked: gloo on one shared GPU is not NVLink
    echo "${NPROC} GPU(s) visible: an all-to-all needs >= 2 processes with a GPU each (NCCL);" \
      "two sharing one GPU over gloo would time host copies, not the GPU link" \
      > "$OUTDIR/comm/skipped.txt"
    echo "== comm: not-applicable: $(cat "$OUTDIR/comm/skipped.txt")"
    printf 'comm\tnot-applicable\t0\n' >> "$OUTDIR/steps.tsv"
  else  # into a copy of the measured calibration, else of the shipped prior
    run_part comm "$(limit "${COMM_S:-40}" 110)" "$OUTDIR/comm/comm.log" \
      "$PY" -m torch.distributed.run --nproc-per-node "$NPROC" --master-addr 127.0.0.1 \
      --master-port "$(free_port)" -m adaptiveload calibrate comm --device "$DEVICE" \
      --calibration "${CAL:-h200-$MODEL}" -o "$OUTDIR/comm/comm-$MODEL.json" \
      ${COMM_ARGS[@]+"${COMM_ARGS[@]}"}
  fi
  pack comm
fi

# --- 5. training: 16 emulated ranks, each policy eager, then fused while time is left ----------
if wants train; then
  mkdir -p "$OUTDIR/train"
  if [ -z "$CAL" ] || [ ! -f "$CAL" ]; then  # no measurement: the shipped prior (source: model)
    CAL="experiments/calibration/h200-$MODEL.json"
    echo "training with $CAL (no measured calibration)"
  fi
  TCAL="$OUTDIR/train/calibration-train.json"
  run_part train_budgets 60 "$OUTDIR/train/budgets.log" "$PY" experiments/gpu/train_budgets.py \
    --calibration "$CAL" --config "$TRAIN_CONFIG" --fill "${TRAIN_FILL:-2.5}" -o "$TCAL"
  for kernel in $TRAIN_KERNELS; do
    KENV=()
    if [ "$kernel" = fused ] && [ "$DRY" != 1 ]; then
      [ -n "${KBUILD_PID:-}" ] && wait "$KBUILD_PID"  # long done: it started before dist
      cp "$KLIB_DIR/build.json" "$OUTDIR/train/kernel_build.json" 2>/dev/null
      KENV=(env "ADAPTIVELOAD_BUILD_DIR=$KLIB_DIR")
      if ! "${KENV[@]}" "$PY" -c 'import sys; from adaptiveload.ops import ln_modulate as lm; r = lm.fused_unavailable_reason(); print("fused kernel:", r or "available"); sys.exit(1 if r else 0)' > "$OUTDIR/train/fused_check.log" 2>&1; then
        echo "== fused training skipped: $(tail -n 1 "$OUTDIR/train/fused_check.log")"
        printf 'train-fused\tskipped\t0\n' >> "$OUTDIR/steps.tsv"
        continue
      fi
    fi
    for policy in $TRAIN_POLICIES; do
      run_part "train-$policy-$kernel" "$(limit "${TRAIN_RUN_S:-70}" 8)" \
        "$OUTDIR/train/$policy-$kernel.log" ${KENV[@]+"${KENV[@]}"} "$PY" -m adaptiveload train \
        --config "$TRAIN_CONFIG" --policy "$policy" --seed 0 --kernel "$kernel" \
        --steps "$TRAIN_STEPS" --emulate-world-size 16 --device "$DEVICE" --calibration "$TCAL" \
        --no-track --no-checkpoint --out "$OUTDIR/train/$policy-$kernel"
      pack train
    done
  done
  pack train
fi

# --- 6. summary ---------------------------------------------------------------------------------
"$PY" experiments/gpu/summarize.py "$OUTDIR" > "$OUTDIR/summary.log" 2>&1
cat "$OUTDIR/summary.txt" 2>/dev/null || cat "$OUTDIR/summary.log"
pack
rm -rf "$WORK"
echo "total $(elapsed) s; outputs in $OUTDIR${PACKDIR:+ (packed in $PACKDIR)}"
cat "$OUTDIR/steps.tsv"
awk -F'\t' 'NR > 1 && $2 != 0 && $2 != "not-applicable" { bad = 1 } END { exit bad }' \
  "$OUTDIR/steps.tsv"
