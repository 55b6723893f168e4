#!/usr/bin/env bash
# The one script for a GPU machine: build, test, benchmark; logs under $OUT.
#
#   OUT=/some/dir experiments/run_gpu.sh                  # every stage
#   STAGES="tests wide" OUT=/some/dir experiments/run_gpu.sh
#
# Stages, in this order (STAGES picks a subset; each has a time budget in
# seconds, BUDGET_<stage>, and a stage that runs past its budget is stopped
# and reported, so the next one still runs):
#
#   build      the CUDA FFI kernels (nvcc)                    BUDGET_build=150
#   tests      the whole pytest suite, compiled on the GPU    BUDGET_tests=200
#              (TEST_WORKERS pytest workers share the GPU, default 6;
#              TESTS, space-separated paths, runs only those;
#              TESTS_K, a pytest -k expression, only the tests it selects)
#   properties the hypothesis suite, "gpu" profile            BUDGET_properties=150
#   dispatch   the dispatch-table builder (resumable; DISPATCH_SEED draws
#              other training sets, DISPATCH_REGIMES keeps some of their
#              regimes, DISPATCH_KERNELS the kernels timed, DISPATCH_REFRESH=1
#              measures stale rows again, DISPATCH_REFRESH_PROBLEMS=FILE
#              the problems listed in FILE)                 BUDGET_dispatch=300
#   wide       benchmark: auto vs jnp.dot on the wide suite   BUDGET_wide=240
#   large      benchmark: large suite, production kernels     BUDGET_large=150
#   decode     benchmark: decode suite                        BUDGET_decode=90
#   odd_widths benchmark: `auto` vs jnp.dot on rows that are not 16-byte
#              units, bfloat16 and fp8, NN and NT        BUDGET_odd_widths=120
#   fp8        benchmark: fp8 suite, NT and NN, per-tensor then block-wise
#              scales, mosaic/fp8 vs XLA's fp8 forms        BUDGET_fp8=200
#   fp8_nn     not in the default run: benchmark, ffi/fp8_nn against
#              mosaic/fp8 and XLA, per-tensor, at FP8_NN_SHAPES in
#              FP8_NN_LAYOUTS (default NN)
#                                                      BUDGET_fp8_nn=300
#   glu        experiments/bench_glu.py, when it exists       BUDGET_glu=200
#   moe        experiments/bench_moe.py, when it exists: the targets
#              MOE_KERNELS (default auto,xla,tokamax; `batched` adds XLA's
#              dense products for a routing known in advance), MOE_ARGS
#              passed on (e.g. "--distributions=even,one_hot --shapes=qwen")
#                                                         BUDGET_moe=200
#   smoke      not in the default run: every experiments/lab/gpu_smoke_*.py
#              (a new kernel compiled, checked and timed against XLA),
#              output in $OUT/smoke_<name>.txt            BUDGET_smoke=150 each
#   ragged_options
#              not in the default run: grouped-GEMM config options not
#              in its heuristic (RAGGED_OPTIONS, space-separated, each a
#              comma-separated list of RaggedConfig fields), each checked
#              and timed interleaved with the heuristic's config on the
#              moe cases RAGGED_CASES (';'-separated labels; with
#              RAGGED_BASE, fields over the heuristic's for the config
#              they are compared with), output in
#              $OUT/ragged_options.txt; RAGGED_PAIRS, files (space-
#              separated, run in order) of "case|fields" lines, times each
#              line's option on its case instead of every option on every
#              case (fields
#              "padded_lhs": the kernel as is against its operands padded,
#              ragged_profile_case.py --versus_padded_lhs);
#              RAGGED_PAIR_ARGS, more ragged_profile_case.py flags for
#              every pair (e.g. --out_dtype=float32)
#                                                  BUDGET_ragged_options=200
#   ragged_ncu not in the default run: Nsight Compute on the grouped GEMM's
#              kernel for the moe cases RAGGED_NCU_CASES (';'-separated
#              labels), with the heuristic's config (or RAGGED_BASE's
#              fields over it): speed of light, compute and memory
#              workload, warp stalls, and each SM's active cycles (min,
#              average, max: the balance between SMs), as
#              experiments/lab/ncu_common.sh profiles (details page, SASS
#              digest), packed into $OUT/ragged_ncu.tar.gz; the
#              profiled launch is the one after RAGGED_NCU_SKIP (default
#              1: the compiling call's) Mosaic launches, so a config that
#              also launches the merge kernel of `piece_rows` takes 2;
#              RAGGED_NCU_METRICS, more metric names (comma-separated)
#              listed on each details page
#                                                      BUDGET_ragged_ncu=200
#   fp8_cuda   not in the default run: the raw-CUDA block-wise fp8 steps
#              (experiments/lab/fp8_wgmma/NN_*.cu, or FP8_CUDA_STEPS, each
#              path.cu or path.cu:NAME=VALUE,... for compile-time knobs),
#              each compiled for sm_90a, checked against float64 and timed
#              (CUDA events) at FP8_CUDA_SHAPES ("M N K;...") in
#              FP8_CUDA_MODES (block none), output in $OUT/fp8_cuda.txt;
#              FP8_CUDA_NCU="M N K" adds an Nsight Compute report per step
#                                                      BUDGET_fp8_cuda=120
#   ragged_dtypes
#              not in the default run: float32 and fp8 grouped GEMMs
#              (experiments/lab/float32_ragged.py): float32 forward on
#              RAGGED_DTYPES_LAYERS (comma-separated; default two
#              calibration and two held-out layers) at decode rows
#              (8,16,32,64) and at the split's crossing
#              (256,512,768,1024,2048), xla against split against auto;
#              then fp8 at 16 rows, xla against split; output in
#              $OUT/ragged_dtypes_{decode,crossing,fp8}.txt
#                                                   BUDGET_ragged_dtypes=300
#   lab        not in the default run: the lab sweeps' GPU checks (every
#              Triton rung and both Mosaic kernels compiled, vs float64),
#              raw output under $OUT/lab                      BUDGET_lab=240
#
# RESUME=1: the benchmark stages continue the results.json already in their
# folder (the same sha and GPU: a call that the budget cut short), so that a
# suite longer than one call, e.g. the 104 problems of `wide`, completes
# over several calls.
#
# Results go to experiments/results/<gpu>/<suite>/ and, because the device
# machine returns only a few files, are packed into $OUT/results.tar.gz
# (unpack at the repository root). $OUT also gets log.txt (everything),
# summary.md (the tables) and pytest logs. Each invocation writes about
# four files there, and the device returns at most eight per call: a call
# that runs the script several times gives each run an OUT of its own
# outside the returned folder and copies back only the files it needs
# (e.g. ragged_options.txt, ragged_ncu.tar.gz). Pass the revision as
# PALLAS_GEMM_GIT_SHA: the copied tree may carry no .git.
set -uo pipefail

cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
PY=${PYTHON:-python3}
STAGES=${STAGES:-"build tests properties wide large decode odd_widths fp8 glu moe"}
ITERS=${ITERS:-20}

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Two pytest workers share the GPU: memory on demand, not 75 % up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# The toolkit's standard location; the GPU machine has no nvcc on PATH.
export PATH="$PATH:/usr/local/cuda/bin"

mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1

# The results so far, packed before every stage: a call cut off by the
# device's time limit still returns what the finished stages measured.
pack() {
  [ -n "${RESULTS:-}" ] && [ -d "$RESULTS" ] \
    && tar czf "$OUT/results.tar.gz" "$RESULTS" pallas_gemm/tuned 2>/dev/null
  return 0
}
stage() { pack; echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s in)"; }
wanted() { [[ " $STAGES " == *" $1 "* ]]; }
budget() { local var="BUDGET_$1"; echo "${!var:-$2}"; }
run_budgeted() {  # run_budgeted SECONDS command...
  local seconds=$1; shift
  timeout --kill-after=20 "$seconds" "$@"
  local status=$?
  [ "$status" -eq 124 ] && echo "(stopped at its ${seconds}s budget)"
  return "$status"
}

stage "device"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv || true
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" || true
GPU_KEY=$("$PY" -c "from pallas_gemm.devices import device_info; print(device_info().key)" 2>/dev/null | tail -n 1)
GPU_KEY=${GPU_KEY:-unknown_gpu}
RESULTS="experiments/results/$GPU_KEY"
echo "git ${PALLAS_GEMM_GIT_SHA:-unknown}; results go to $RESULTS; stages: $STAGES"

if wanted build; then
  stage "build the FFI kernels"
  run_budgeted "$(budget build 150)" "$PY" -m pallas_gemm.ffi build \
    || echo "FFI build failed: ffi/ kernels will be skipped or fail"
fi

if wanted tests; then
  stage "the test suite, compiled on the GPU"
  run_budgeted "$(budget tests 200)" "$PY" -m pytest -q -n "${TEST_WORKERS:-6}" -p no:cacheprovider \
    --timeout=300 ${TESTS_K:+-k "$TESTS_K"} ${TESTS:-tests} > "$OUT/pytest_gpu.txt" 2>&1
  tail -n 30 "$OUT/pytest_gpu.txt"
fi

if wanted properties; then
  stage "property suite (hypothesis profile gpu)"
  HYPOTHESIS_PROFILE=gpu run_budgeted "$(budget properties 150)" "$PY" -m pytest -n 3 \
    -q -p no:cacheprovider tests/test_properties.py > "$OUT/pytest_properties.txt" 2>&1
  tail -n 5 "$OUT/pytest_properties.txt"
fi

if wanted dispatch; then
  stage "dispatch table"
  # Resumes the committed measurements. DISPATCH_SEED (several, space-
  # separated, run in turn within the stage's budget) draws more problems,
  # DISPATCH_REGIMES keeps some regimes of them, DISPATCH_KERNELS names the
  # kernels timed against xla.
  deadline=$(( SECONDS + $(budget dispatch 300) ))
  for seed in ${DISPATCH_SEED:-20261123}; do
    left=$(( deadline - SECONDS ))
    [ "$left" -gt 20 ] || { echo "dispatch budget spent before seed $seed"; break; }
    run_budgeted "$(( left + 30 ))" "$PY" experiments/build_dispatch_table.py \
      --out_dir="$RESULTS/dispatch" --budget_s="$left" --seed="$seed" \
      --regimes="${DISPATCH_REGIMES:-}" ${DISPATCH_REFRESH:+--refresh} \
      ${DISPATCH_REFRESH_PROBLEMS:+--refresh_problems="$DISPATCH_REFRESH_PROBLEMS"} \
      --kernels="${DISPATCH_KERNELS:-mosaic/small_m,mosaic/ws_persistent,mosaic/split_k}"
  done
fi

bench() {  # [SUITE=suite] bench NAME DEFAULT_BUDGET [flags...]; results in NAME/
  local name=$1 suite=${SUITE:-$1} seconds
  seconds=$(budget "$1" "$2")
  shift 2
  stage "benchmark: $name (${seconds}s)"
  run_budgeted "$((seconds + 60))" "$PY" experiments/benchmark.py \
    --suite="$suite" --iters="$ITERS" --warmup=2 --time_budget_s="$seconds" \
    --max_seconds_per_measurement=2 --output_dir="$RESULTS/$name" \
    ${RESUME:+--resume} "$@"
}

EARLY_RUNGS='triton/0[1-5]*,ffi/sgemm*,ffi/mma_sync*'
wanted wide && bench wide 240 --kernels=auto --plot=false
wanted large && bench large 150 --dtypes=bfloat16 \
  --kernels=auto,mosaic/ws_persistent,triton/06_tuned,jax_hopper \
  --max_candidates=2 --skip_kernels="$EARLY_RUNGS"
wanted decode && bench decode 90 --dtypes=bfloat16 \
  --kernels=auto,mosaic/small_m,mosaic/ws_persistent --skip_kernels="$EARLY_RUNGS"

wanted odd_widths && bench odd_widths 120 --dtypes=bfloat16,float8_e4m3fn \
  --layouts=NN,NT --kernels=auto,xla

if wanted fp8; then
  half=$(( $(budget fp8 200) / 2 ))
  for scaling in tensor block; do
    SUITE=fp8 bench "fp8_$scaling" "$half" \
      --dtypes=float8_e4m3fn --layouts=NT,NN --fp8_scaling="$scaling" \
      --kernels=auto,mosaic/fp8,xla_scaled,jax_scaled_matmul --plot=false
  done
fi

# ffi/fp8_nn (B stored (k, n), no transpose pass) against mosaic/fp8 (XLA
# transposes B first) and XLA's own NN forms: the fp8 suite plus two short
# M, where the transpose is the larger share.
wanted fp8_nn && SUITE=fp8 bench fp8_nn 300 \
  --dtypes=float8_e4m3fn --layouts="${FP8_NN_LAYOUTS:-NN}" --fp8_scaling=tensor \
  --shapes="${FP8_NN_SHAPES:-4096x4096x4096,8192x8192x8192,8192x14336x4096,8192x4096x14336,5000x6144x4096,3000x14336x4096,16384x4096x4096,4096x8192x4096,1024x8192x8192,256x8192x8192}" \
  --kernels=auto,ffi/fp8_nn,mosaic/fp8,xla_scaled --plot=false

if wanted glu && [ -f experiments/bench_glu.py ]; then
  stage "benchmark: gated linear unit"
  # The benchmark stops starting cases 30 s before the stage's budget.
  run_budgeted "$(budget glu 200)" "$PY" experiments/bench_glu.py \
    --max_seconds="$(( $(budget glu 200) - 30 ))" --output_dir="$RESULTS/glu"
fi
if wanted moe && [ -f experiments/bench_moe.py ]; then
  stage "benchmark: mixture-of-experts grouped GEMM"
  # MOE_ARGS is split into words on purpose: several flags in one variable.
  # shellcheck disable=SC2086
  run_budgeted "$(budget moe 200)" "$PY" experiments/bench_moe.py \
    --max_seconds="$(( $(budget moe 200) - 30 ))" \
    --kernels="${MOE_KERNELS:-auto,xla,tokamax}" ${MOE_ARGS:-} \
    --output_dir="$RESULTS/moe"
fi

if wanted ragged_options; then
  stage "grouped GEMM: config options against the heuristic's"
  # One process per (case, option): each compiles two configs.
  deadline=$(( SECONDS + $(budget ragged_options 200) ))
  ragged_pair() {  # ragged_pair CASE FIELDS (or padded_lhs)
    local versus=(--versus "$2")
    [ "$2" != padded_lhs ] || versus=(--versus_padded_lhs)
    run_budgeted 90 "$PY" experiments/lab/ragged_profile_case.py \
      --case "$1" --kernel mosaic "${versus[@]}" --time 20 \
      ${RAGGED_BASE:+--config "$RAGGED_BASE"} ${RAGGED_PAIR_ARGS:-} \
      2>&1 | grep -E "relative error|us \(CUPTI|time =|Error|ptxas|error:" \
      | tee -a "$OUT/ragged_options.txt"
  }
  if [ -n "${RAGGED_PAIRS:-}" ]; then
    # RAGGED_PAIRS is split into words on purpose: several files in turn
    # (awk ends each file's last line, should it lack a newline).
    # shellcheck disable=SC2086
    while IFS='|' read -r case option; do
      [ -n "$case" ] || continue
      [ "$SECONDS" -lt "$deadline" ] || break
      ragged_pair "$case" "$option"
    done < <(awk 1 $RAGGED_PAIRS)
  else
    IFS=';' read -r -a ragged_cases <<< "${RAGGED_CASES:-qwen1.5_moe_up even drhs;qwen3_30b_a3b_up zipf drhs;g64_t16384_k2048_n1408 even drhs}"
    for case in "${ragged_cases[@]}"; do
      for option in ${RAGGED_OPTIONS:-ping_pong=true}; do
        [ "$SECONDS" -lt "$deadline" ] || break 2
        ragged_pair "$case" "$option"
      done
    done
  fi
fi

if wanted ragged_ncu; then
  stage "grouped GEMM: Nsight Compute per moe case"
  deadline=$(( SECONDS + $(budget ragged_ncu 200) ))
  # ncu_common.sh's profile per case, plus each SM's active cycles; its
  # reports are packed into one file (the device returns only a few).
  export PY DIR="${WORK:-/tmp/pallas_gemm_ragged_ncu}"
  export NCU_METRICS=sm__cycles_active.avg,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_elapsed.max${RAGGED_NCU_METRICS:+,$RAGGED_NCU_METRICS}
  rm -rf "$DIR" && mkdir -p "$DIR"
  IFS=';' read -r -a ncu_cases <<< "${RAGGED_NCU_CASES:-qwen3_30b_a3b_up even drhs;qwen3_30b_a3b_up zipf drhs}"
  for case in "${ncu_cases[@]}"; do
    left=$(( deadline - SECONDS ))
    [ "$left" -gt 10 ] || break
    echo "== $case"
    # The second launch of the Mosaic kernel: the first one compiles.
    run_budgeted "$left" bash -c '. experiments/lab/ncu_common.sh && ncu_profile "$@"' _ \
      "ncu_${case// /_}" mosaic_gpu "${RAGGED_NCU_SKIP:-1}" \
      "Duration|sm__cycles|L2 Cache Throughput|DRAM Throughput|highest-utilized|Stall|Error|error:" \
      "$PY" experiments/lab/ragged_profile_case.py --case "$case" --kernel mosaic \
      ${RAGGED_BASE:+--config "$RAGGED_BASE"}
  done
  tar -C "$DIR" -czf "$OUT/ragged_ncu.tar.gz" --exclude='*.ncu-rep' .
  cp "$DIR/digest.txt" "$OUT/ragged_ncu_digest.txt" 2>/dev/null || true
fi

if wanted smoke; then
  for script in experiments/lab/gpu_smoke_*.py; do
    [ -f "$script" ] || continue
    name=$(basename "$script" .py)
    stage "smoke: $name"
    run_budgeted "$(budget smoke 150)" "$PY" "$script" > "$OUT/smoke_${name#gpu_smoke_}.txt" 2>&1
    tail -n 40 "$OUT/smoke_${name#gpu_smoke_}.txt"
  done
fi

if wanted fp8_cuda; then
  stage "raw-CUDA block-wise fp8 steps"
  deadline=$(( SECONDS + $(budget fp8_cuda 120) ))
  IFS=';' read -r -a fp8_shapes <<< "${FP8_CUDA_SHAPES:-200 392 1008;4096 4096 4096;8192 8192 8192;8192 14336 4096}"
  # A step may carry compile-time knobs: path.cu:NAME=VALUE,NAME=VALUE
  for step in ${FP8_CUDA_STEPS:-experiments/lab/fp8_wgmma/[0-9]*.cu}; do
    source=${step%%:*}
    defines=()
    if [ "$step" != "$source" ]; then
      IFS=',' read -r -a knobs <<< "${step#*:}"
      for knob in "${knobs[@]}"; do defines+=("-D$knob"); done
    fi
    label=$(basename "$source" .cu)${defines[*]:+_$(IFS=_; echo "${knobs[*]}")}
    program=/tmp/pallas_gemm_fp8_$label
    echo "== $label" | tee -a "$OUT/fp8_cuda.txt"
    rm -f "$program"  # a failed build must not leave an older one to run
    nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Xptxas -v \
      "${defines[@]}" \
      -I experiments/lab/ffi -I pallas_gemm/ffi/csrc -o "$program" "$source" \
      2>&1 | grep -E "error|registers|spill|[Ww]arning|C75[0-9][0-9]" | tee -a "$OUT/fp8_cuda.txt"
    for shape in "${fp8_shapes[@]}"; do
      for mode in ${FP8_CUDA_MODES:-block none}; do
        left=$(( deadline - SECONDS ))
        [ "$left" -gt 5 ] && [ -x "$program" ] || break
        # shellcheck disable=SC2086
        run_budgeted "$left" "$program" $shape $mode 2>&1 | tee -a "$OUT/fp8_cuda.txt"
      done
    done
    # FP8_CUDA_NCU="M N K": one Nsight Compute report per step at that shape.
    if [ -n "${FP8_CUDA_NCU:-}" ] && [ -x "$program" ]; then
      # shellcheck disable=SC2086
      run_budgeted 60 ncu --clock-control none --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis "$program" $FP8_CUDA_NCU block \
        > "$OUT/ncu_$label.txt" 2>&1
    fi
  done
fi

if wanted ragged_dtypes; then
  stage "float32 and fp8 grouped GEMMs: xla, split, auto"
  deadline=$(( SECONDS + $(budget ragged_dtypes 300) ))
  layers=${RAGGED_DTYPES_LAYERS:-qwen3_30b_a3b_up,deepseek_v3_up,olmoe_up,gpt_oss_20b}
  parts=("decode 8,16,32,64 xla,split,auto float32"
         "crossing 256,512,768,1024,2048 xla,split,auto float32"
         "fp8 16 xla,split float8_e4m3fn")
  for i in "${!parts[@]}"; do
    read -r name rows ways dtype <<< "${parts[$i]}"
    left=$(( deadline - SECONDS ))
    [ "$left" -gt 10 ] || { echo "(budget spent before $name)"; break; }
    # Each part starts no new case past its share of what is left, so
    # that the later parts still run.
    share=$(( left / (${#parts[@]} - i) ))
    run_budgeted "$left" "$PY" experiments/lab/float32_ragged.py \
      --layers "$layers" --rows "$rows" --distributions even --ways "$ways" \
      --dtype "$dtype" --budget_s "$share" > "$OUT/ragged_dtypes_$name.txt" 2>&1
    grep '^|' "$OUT/ragged_dtypes_$name.txt"
  done
fi

if wanted lab; then
  stage "lab: the sweeps' GPU checks"
  mkdir -p "$OUT/lab"
  half=$(( $(budget lab 240) / 2 ))
  run_budgeted "$((half + 30))" "$PY" experiments/lab/triton_sweep.py \
    --phase check --budget-s "$half" --out "$OUT/lab"
  run_budgeted "$((half + 30))" "$PY" experiments/lab/mosaic_sweep.py \
    --stages check --budget-s "$half" --out "$OUT/lab/mosaic_check.jsonl"
fi

stage "collect"
{
  echo "# GPU run: $GPU_KEY, git ${PALLAS_GEMM_GIT_SHA:-unknown}, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for log in pytest_gpu pytest_properties; do
    [ -f "$OUT/$log.txt" ] && echo && echo "$log: $(tail -n 1 "$OUT/$log.txt")"
  done
  for suite in wide large decode odd_widths fp8_tensor fp8_block glu moe; do
    dir="$RESULTS/$suite"
    [ -d "$dir" ] || continue
    echo; echo "## $suite"; echo
    for f in regimes.md summary.md; do [ -f "$dir/$f" ] && cat "$dir/$f"; done
  done
} > "$OUT/summary.md"
cat "$OUT/summary.md"
tar czf "$OUT/results.tar.gz" "$RESULTS" pallas_gemm/tuned 2>/dev/null \
  || echo "nothing under $RESULTS"
stage "done"
