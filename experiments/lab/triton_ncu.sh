#!/usr/bin/env bash
# Nsight Compute on the Pallas-Triton kernels XLA actually launches: one
# profile per case (registers, occupancy, instruction mix, warp stalls, and
# the SASS with per-instruction counts). Clocks are left alone
# (--clock-control none).
#
#   OUT=/some/dir experiments/lab/triton_ncu.sh ["ARGS1" "ARGS2" ...]
#
# Each argument is a set of experiments/lab/triton_ncu.py flags; without any,
# the cases below. Writes $WORK/<n>.{txt,sass.csv.gz} and digest.txt
# (experiments/lab/ncu_sass_digest.py), and packs them into
# $OUT/triton_ncu.tar.gz (the device machine returns at most 8 files).
# Pass the revision as PALLAS_GEMM_GIT_SHA (the device copy may lack .git).
set -uo pipefail

cd "$(dirname "$0")/../.."
OUT=${OUT:-./out}
PY=${PYTHON:-python3}
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export PATH="$PATH:/usr/local/cuda/bin"
DIR=${WORK:-/tmp/pallas_gemm_ncu}
rm -rf "$DIR"
mkdir -p "$DIR" "$OUT"
exec > >(tee -a "$DIR/log.txt") 2>&1

if [ $# -eq 0 ]; then
  set -- \
    "--case tf32:NN --block 128x128x32 --num-warps 4 --num-stages 4 --k-major" \
    "--case tf32:NN --block 128x256x32 --num-warps 8 --num-stages 3 --k-major" \
    "--case bf16:NN --block 128x256x64 --num-warps 8 --num-stages 3 --programs-per-sm 1" \
    "--case ieee:NN --block 64x128x32 --num-warps 4 --num-stages 3"
fi

# shellcheck source=experiments/lab/ncu_common.sh
. experiments/lab/ncu_common.sh
ncu_header

case_number=0
for flags in "$@"; do
  case_number=$((case_number + 1))
  name="case$case_number"
  echo
  echo "=== $name: $flags (${SECONDS}s in)"
  # shellcheck disable=SC2086  # flags is a word list on purpose
  ncu_profile "$name" '^tuned' 1 \
    "Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Compute \(SM\) Throughput|Memory Throughput|Duration|Issue Slots Busy|Executed Ipc Active|One or More Eligible|Warp Cycles Per Issued" \
    "$PY" experiments/lab/triton_ncu.py $flags
done

tar -C "$DIR" -czf "$OUT/triton_ncu.tar.gz" --exclude='*.ncu-rep' .
cp "$DIR/log.txt" "$OUT/log.txt"
