#!/usr/bin/env bash
# The one command for a GPU machine: build the CUDA kernels, run the
# GPU-marked tests, then benchmark the ladder, large and decode suites.
#
#   OUT=/some/dir experiments/run_gpu.sh        # OUT defaults to ./out
#
# Designed to finish in about 9 minutes (TOTAL_S) on an H200: the build and
# the tests get fixed budgets, and what is left is shared among the three
# benchmarks (ladder 30%, large 45%, decode 25%). A benchmark stops starting
# new measurements when its budget is spent and reports the rest SKIPPED,
# so the order of its shapes and kernels is the order of priority. It leaves
# few files in $OUT, because the device machine returns at most 8:
#
#   log.txt                everything printed
#   pytest_gpu.txt         the GPU test run
#   summary.md             every suite's tables, the ladder, and the failures
#   results.tar.gz         experiments/results/<gpu>/<suite>/... (CSV, JSON,
#                          Markdown, PNG); unpack at the repo root:
#                          tar xzf results.tar.gz
#   tflops_large.png       quick looks at two of the plots
#   roofline_decode.png
#
# The device copy of the tree may have no .git: pass the revision as
# PALLAS_GEMM_GIT_SHA so every output names the code it measured.
#
# Environment knobs: TOTAL_S (520), BUILD_BUDGET_S (120), TEST_BUDGET_S (90),
# ITERS (20), MAX_CANDIDATES (3, the jax_hopper sweep), PYTHON (python3).
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
PY=${PYTHON:-python3}
ITERS=${ITERS:-20}
MAX_CANDIDATES=${MAX_CANDIDATES:-3}
TOTAL_S=${TOTAL_S:-520}
BUILD_BUDGET_S=${BUILD_BUDGET_S:-120}
TEST_BUDGET_S=${TEST_BUDGET_S:-90}
# Per benchmark process: start-up (importing JAX) and writing the outputs,
# plus the one measurement that may be in flight when its budget runs out.
OVERHEAD_S=25
# A benchmark gets this long past its budget before it is killed (a hang).
GRACE_S=90

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# The toolkit's standard location; the GPU machine has no nvcc on PATH.
export PATH="$PATH:/usr/local/cuda/bin"

mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1

stage() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }

stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" || true
GPU_KEY=$("$PY" -c "from pallas_gemm.devices import device_info; print(device_info().key)" 2>/dev/null | tail -n 1)
GPU_KEY=${GPU_KEY:-unknown_gpu}
RESULTS="experiments/results/$GPU_KEY"
echo "results go to $RESULTS"

stage "build the FFI kernels"
if [ -f pallas_gemm/ffi/__main__.py ]; then
  timeout "$BUILD_BUDGET_S" "$PY" -m pallas_gemm.ffi build || echo "FFI build failed; ffi/ kernels will be skipped or fail"
else
  echo "no pallas_gemm.ffi build module; nothing to build"
fi

stage "GPU tests (pytest -m gpu, ${TEST_BUDGET_S}s)"
timeout "$TEST_BUDGET_S" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests \
  > "$OUT/pytest_gpu.txt" 2>&1
TEST_STATUS=$?
tail -n 25 "$OUT/pytest_gpu.txt"
[ "$TEST_STATUS" -eq 124 ] && echo "pytest stopped at its ${TEST_BUDGET_S}s budget"

bench() {  # bench SUITE BUDGET_S [extra flags...]
  local suite=$1 budget=$2
  shift 2
  stage "benchmark: $suite (${budget}s budget)"
  timeout $((budget + GRACE_S)) "$PY" experiments/benchmark.py \
    --suite="$suite" --kernels=all --iters="$ITERS" --warmup=2 \
    --max_candidates="$MAX_CANDIDATES" --time_budget_s="$budget" \
    --max_seconds_per_measurement=2 --output_dir="$RESULTS/$suite" "$@"
  echo "benchmark $suite exited with status $?"
}

LEFT=$((TOTAL_S - SECONDS - 3 * OVERHEAD_S))
[ "$LEFT" -lt 90 ] && LEFT=90
echo "benchmarks share ${LEFT}s"
# The ladder at one size keeps the slow early rungs affordable; float32
# brings in the sgemm ladder (ieee) and the TF32 rows last.
bench ladder $((LEFT * 30 / 100)) --shapes=4096x4096x4096 --dtypes=bfloat16,float32
# The early rungs are in the ladder; the large and decode suites compare the
# production kernels with jnp.dot and JAX's Hopper kernel.
EARLY_RUNGS='triton/0[1-4]*,ffi/sgemm*'
LEFT=$((TOTAL_S - SECONDS - 2 * OVERHEAD_S))
[ "$LEFT" -lt 60 ] && LEFT=60
bench large $((LEFT * 64 / 100)) --dtypes=bfloat16 --skip_kernels="$EARLY_RUNGS"
LEFT=$((TOTAL_S - SECONDS - OVERHEAD_S))
[ "$LEFT" -lt 30 ] && LEFT=30
bench decode "$LEFT" --dtypes=bfloat16 --skip_kernels="$EARLY_RUNGS"

stage "collect"
{
  echo "# GPU run: $GPU_KEY, git ${PALLAS_GEMM_GIT_SHA:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo n/a)}, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "pytest -m gpu: $(tail -n 1 "$OUT/pytest_gpu.txt")"
  for suite in ladder large decode; do
    dir="$RESULTS/$suite"
    echo
    echo "## $suite"
    echo
    if [ -f "$dir/ladder.md" ]; then cat "$dir/ladder.md"; echo; fi
    if [ -f "$dir/summary.md" ]; then cat "$dir/summary.md"; else echo "(no results)"; fi
    if [ -f "$dir/results.csv" ]; then
      echo
      echo "FAILED rows:"
      grep -v '^#' "$dir/results.csv" | awk -F, '$11 == "FAILED" {print "- " $1 " " $2 " " $8 " " $10}' || true
    fi
  done
} > "$OUT/summary.md"
tar czf "$OUT/results.tar.gz" "$RESULTS" 2>/dev/null || echo "nothing to archive under $RESULTS"
[ -f "$RESULTS/large/tflops.png" ] && cp "$RESULTS/large/tflops.png" "$OUT/tflops_large.png"
[ -f "$RESULTS/decode/roofline.png" ] && cp "$RESULTS/decode/roofline.png" "$OUT/roofline_decode.png"
stage "done"
ls -la "$OUT"
