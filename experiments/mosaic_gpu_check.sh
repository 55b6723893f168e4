#!/usr/bin/env bash
# The Mosaic backend on a Hopper GPU after a change to it, in about 8 minutes:
# tests/test_mosaic.py compiled (its x64 and 8-thread tests then run the
# compiled kernels), then the large and decode suites for the two Mosaic
# kernels next to jnp.dot, to compare with the committed results.
#
#   OUT=/some/dir PALLAS_GEMM_GIT_SHA=<sha> experiments/mosaic_gpu_check.sh
#
# Writes to $OUT (default ./out): pytest_mosaic.txt, bench_large.txt,
# bench_decode.txt and results.tar.gz (both suites' CSV/JSON/Markdown).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/suites"

timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_mosaic.py \
  > "$OUT/pytest_mosaic.txt" 2>&1
tail -n 5 "$OUT/pytest_mosaic.txt"

for suite in large decode; do
  timeout 200 "$PY" experiments/benchmark.py --suite="$suite" \
    --kernels=xla,mosaic/ws_persistent,mosaic/small_m --dtypes=bfloat16 \
    --iters=20 --warmup=2 --time_budget_s=140 \
    --max_seconds_per_measurement=2 --noplot \
    --output_dir="$OUT/suites/$suite" > "$OUT/bench_$suite.txt" 2>&1
  tail -n 20 "$OUT/bench_$suite.txt"
done
tar czf "$OUT/results.tar.gz" -C "$OUT/suites" . && rm -rf "$OUT/suites"
