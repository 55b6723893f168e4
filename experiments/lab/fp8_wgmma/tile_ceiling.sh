#!/bin/bash
# Step 04 at both tile widths (block-wise, unscaled, unscaled 128x256) and
# Nsight Compute at 4096^3 with the clocks left alone. Output under $OUT.
set -u; cd "$(dirname "$0")/../../.."
export PATH=$PATH:/usr/local/cuda/bin
S=experiments/lab/fp8_wgmma/04_two_partials.cu
for n in 128 256; do nvcc -DFP8_BLOCK_N=$n -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -Xptxas -v -I experiments/lab/ffi -I pallas_gemm/ffi/csrc -o /tmp/fp8_04_n$n $S 2>&1 | grep -E "error|C75|spill"; done
for shape in "4096 4096 4096" "8192 8192 8192" "8192 14336 4096"; do
  /tmp/fp8_04_n128 $shape block; /tmp/fp8_04_n128 $shape none; /tmp/fp8_04_n256 $shape none
done 2>&1 | grep -v "relative error [12]\." | tee $OUT/runs.txt
for v in "128 block" "128 none" "256 none"; do set -- $v
timeout 90 ncu --clock-control none --launch-skip 1 --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats /tmp/fp8_04_n$1 4096 4096 4096 $2 > $OUT/ncu_$1_$2.txt 2>&1
done
