#!/usr/bin/env bash
# The ffi/* kernels on a GPU machine, in one call: a cold build (timed), the
# tuning sweep, Nsight Compute counters for the shipped tensor-core and top
# SIMT kernels, then gpu_check (sanitizer driver, compute-sanitizer, SASS,
# CUPTI timings through JAX against jnp.dot) and the ffi GPU tests.
#
#   OUT=/some/dir experiments/lab/ffi/ffi_gpu.sh [steps]  # OUT defaults to ./out
#
# steps: a comma list of build, ceiling, sweep, ncu, check, pytest,
# headline, ladder, triton_ieee (default: build,ceiling,sweep,ncu,check,
# pytest). build compiles the library into an empty build cache and reports
# how long a first call's build takes, and which nvcc it used. check runs
# gpu_check.py with $CHECK_ARGS (e.g. "--quick --skip time,sass
# --sanitizer-tools none"); pytest runs the ffi GPU tests with
# $PYTEST_WORKERS workers (default 4) for at most $PYTEST_TIMEOUT seconds
# (default 300). The sweep takes its program arguments from
# $SWEEP_ARGS (default: --sizes 4096,8192). headline runs ffi_headline.py
# while nvidia-smi records the SM clock, power and temperature every 100 ms
# (clocks.csv). ladder re-runs the benchmark's ladder suite at 4096^3 and
# 8192^3 into experiments/results/<gpu>/ladder and ladder_8192 (packed too).
# Everything is written to $WORK (default /tmp/pallas_gemm_ffi) and packed
# into $OUT/ffi.tar.gz, with the log as $OUT/log.txt. The tables are also
# printed, so the end of the output is the summary.
#
# The device copy of the tree may have no .git: pass the revision as
# PALLAS_GEMM_GIT_SHA so every output names the code it measured.
set -uo pipefail

cd "$(dirname "$0")/../../.."
LAB=experiments/lab/ffi
OUT=${OUT:-./out}
STEPS=${1:-build,ceiling,sweep,ncu,check,pytest}
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Last resort after the NVIDIA pip wheels and PATH (build.py's search order).
export PATH="$PATH:/usr/local/cuda/bin"
export PALLAS_GEMM_KEEP_PTX=1
DIR=${WORK:-/tmp/pallas_gemm_ffi}
rm -rf "$DIR"
mkdir -p "$DIR" "$OUT"
# A cache of this run's own: the build step then measures a cold build.
export PALLAS_GEMM_CACHE_DIR=${PALLAS_GEMM_CACHE_DIR:-$DIR/cache}
exec > >(tee -a "$DIR/log.txt") 2>&1

has() { [[ ",$STEPS," == *",$1,"* ]]; }
stage() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }

stage "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm \
  --format=csv || true
echo "git ${PALLAS_GEMM_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo n/a)}"

if has build; then
  stage "cold build of the library (empty cache)"
  "$PY" -m pallas_gemm.ffi where
  START=$SECONDS
  "$PY" -m pallas_gemm.ffi build > "$DIR/build.txt" 2>&1
  echo "build exit $? in $((SECONDS - START)) s"; tail -n 3 "$DIR/build.txt"
fi

if has sweep || has ncu || has ceiling; then
  stage "build the sweep program"
  SWEEP=$("$PY" "$LAB/programs.py" sweep) \
    || { echo "sweep build failed"; SWEEP=""; }
fi

if has ceiling && [ -n "$SWEEP" ]; then
  stage "mma.sync issue ceiling (registers only)"
  "$SWEEP" --ceiling | tee "$DIR/ceiling.txt"
fi

if has sweep && [ -n "$SWEEP" ]; then
  stage "sweep (CUDA events, median of 20; checked before timing)"
  # shellcheck disable=SC2086  # SWEEP_ARGS is a word list on purpose
  "$SWEEP" ${SWEEP_ARGS:---sizes 4096,8192} --json "$DIR/sweep.json" \
    | tee "$DIR/sweep.txt"
fi

if has ncu && [ -n "$SWEEP" ]; then
  # One launch of each, 4096^3: shared-memory bank conflicts per access
  # kind (the swizzle's evidence) and where the warps stall.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for pattern in "shipped mma_pipe_128x256x64_tma" "(default)"; do
    stage "ncu: $pattern"
    "$NCU" --clock-control none -k 'regex:[Gg]emm' -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \
      --section WarpStateStats --section SchedulerStats --section Occupancy \
      --metrics l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,smsp__inst_executed_op_ldsm.sum,smsp__inst_executed_op_ldgsts.sum \
      "$SWEEP" --sizes 4096 --iters 1 --filter "$pattern" \
      >> "$DIR/ncu.txt" 2>&1
    echo "exit $?"
    grep -E "bank_conflicts|wavefronts_mem_shared|op_ldsm|Shared (Load|Store)|ldsm|Stall|Issue Slot|Compute \(SM\)|Memory Throughput" \
      "$DIR/ncu.txt" | tail -n 30
  done
fi

if has check; then
  stage "gpu_check"
  # shellcheck disable=SC2086  # CHECK_ARGS is a word list on purpose
  "$PY" "$LAB/gpu_check.py" --out "$DIR/check" --sanitizer-timeout 40 \
    ${CHECK_ARGS:-}
fi

if has pytest; then
  stage "ffi GPU tests"
  # The float64 host references dominate: several workers share the GPU
  # (conftest makes each take memory on demand).
  timeout "${PYTEST_TIMEOUT:-300}" "$PY" -m pytest -q -m gpu -n "${PYTEST_WORKERS:-4}" \
    -p no:cacheprovider tests/test_ffi.py > "$DIR/pytest.txt" 2>&1
  tail -n 5 "$DIR/pytest.txt"
fi

if has headline; then
  stage "headline ratios, with a clock trace"
  nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 100 > "$DIR/clocks.csv" 2>&1 &
  SMI=$!
  "$PY" "$LAB/ffi_headline.py" --out "$DIR" --rounds "${HEADLINE_ROUNDS:-5}" \
    2>&1 | grep -v "^WARNING" | tail -n 30
  kill "$SMI" 2>/dev/null
fi

if has ladder; then
  stage "benchmark ladder, 4096^3 and 8192^3"
  GPU_KEY=$("$PY" -c "from pallas_gemm.devices import device_info; print(device_info().key)" 2>/dev/null | tail -n 1)
  RESULTS="experiments/results/${GPU_KEY:-unknown_gpu}"
  "$PY" experiments/benchmark.py --suite=ladder --shapes=4096x4096x4096 \
    --kernels=all --dtypes=bfloat16,float32 --iters=20 --warmup=2 \
    --max_candidates=3 --time_budget_s=110 --max_seconds_per_measurement=2 \
    --output_dir="$RESULTS/ladder" 2>&1 | grep -v "^WARNING" | tail -n 60
  "$PY" experiments/benchmark.py --suite=ladder --shapes=8192x8192x8192 \
    --kernels=all '--skip_kernels=ffi/sgemm_0[1-4]*' \
    --dtypes=bfloat16,float32 --iters=10 --warmup=1 --max_candidates=2 \
    --time_budget_s=110 --max_seconds_per_measurement=3 \
    --output_dir="$RESULTS/ladder_8192" 2>&1 | grep -v "^WARNING" | tail -n 60
  mkdir -p "$DIR/results"
  cp -r "$RESULTS/ladder" "$RESULTS/ladder_8192" "$DIR/results/"
fi

if has triton_ieee; then
  stage "Pallas-Triton exact f32 sweep"
  "$PY" experiments/lab/triton_sweep.py --phase ieee --out "$DIR/triton" \
    --budget-s 150 2>&1 | grep -v "^WARNING" | tail -n 45
fi

stage "pack"
ls -la "$DIR" "$DIR/check" 2>/dev/null
tar czf "$OUT/ffi.tar.gz" -C "$(dirname "$DIR")" "$(basename "$DIR")"
cp "$DIR/log.txt" "$OUT/log.txt"
