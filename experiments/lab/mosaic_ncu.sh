#!/usr/bin/env bash
# Nsight Compute on Mosaic kernels: one profile per case of
# experiments/lab/mosaic_ptxas.py (speed of light, warp stalls, instruction
# mix, and the SASS with per-instruction counts and stall samples, digested
# by experiments/lab/ncu_sass_digest.py). Clocks are left alone
# (--clock-control none).
#
#   OUT=/some/dir experiments/lab/mosaic_ncu.sh CASE [CASE ...]
#
# Packs the text pages, SASS CSVs and digest into $OUT/mosaic_ncu.tar.gz
# (the device machine returns at most 8 files) and copies the digest and log.
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT=${OUT:-./out}
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PATH="$PATH:/usr/local/cuda/bin"
DIR=${WORK:-/tmp/pallas_gemm_mosaic_ncu}
rm -rf "$DIR"
mkdir -p "$DIR" "$OUT"
exec > >(tee -a "$DIR/log.txt") 2>&1

# shellcheck source=experiments/lab/ncu_common.sh
. experiments/lab/ncu_common.sh
ncu_header

for name in "$@"; do
  echo
  echo "=== $name (${SECONDS}s in)"
  ncu_profile "$name" mosaic_gpu 0 \
    "Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Executed Ipc Active|One or More Eligible|Warp Cycles Per Issued|Shared Memory|L1/TEX Hit|L2 Hit|DRAM Throughput" \
    "$PY" experiments/lab/mosaic_ptxas.py --case "$name"
done

tar -C "$DIR" -czf "$OUT/mosaic_ncu.tar.gz" --exclude='*.ncu-rep' .
cp "$DIR/digest.txt" "$DIR/log.txt" "$OUT/" 2>/dev/null || true
