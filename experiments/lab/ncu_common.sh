# Sourced by triton_ncu.sh, mosaic_ncu.sh and run_gpu.sh's ragged_ncu
# stage: one Nsight Compute profile per case, its text pages and SASS
# digest. Needs PY and DIR set; sets NCU.
#
#   ncu_header   prints the git sha, ncu, GPU, driver and jax versions
#
#   ncu_profile NAME KERNEL_REGEX LAUNCHES_TO_SKIP "SUMMARY_REGEX" command...
#
# Profiles the first kernel matching KERNEL_REGEX after skipping that many
# launches (clocks left alone), writes $DIR/NAME.txt (details page),
# $DIR/NAME.sass.csv.gz (SASS with counters) and appends the digest to
# $DIR/digest.txt; prints the details lines matching SUMMARY_REGEX and the
# digest's head. With NCU_METRICS set (comma-separated metric names), those
# metrics are collected too, and listed on the details page.
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)

ncu_header() {
  echo "git ${PALLAS_GEMM_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo n/a)}"
  "$NCU" --version | tail -n 1
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  "$PY" -c "import jax; print('jax', jax.__version__)"
}

ncu_profile() {
  local name=$1 kernels=$2 skip=$3 summary=$4
  shift 4
  "$NCU" --clock-control none -k "regex:$kernels" -s "$skip" -c 1 \
    --section LaunchStats --section Occupancy --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section InstructionStats \
    --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section SourceCounters \
    ${NCU_METRICS:+--metrics "$NCU_METRICS"} \
    --import-source no -o "$DIR/$name" -f "$@"
  echo "exit $?"
  "$NCU" -i "$DIR/$name.ncu-rep" --page details > "$DIR/$name.txt" 2>&1
  "$NCU" -i "$DIR/$name.ncu-rep" --page source --csv --print-source sass \
    > "$DIR/$name.sass.csv" 2>&1
  grep -E "$summary" "$DIR/$name.txt" | head -n 24
  gzip -9 -f "$DIR/$name.sass.csv"
  "$PY" experiments/lab/ncu_sass_digest.py "$DIR/$name.sass.csv.gz" \
    | tee -a "$DIR/digest.txt" | head -n 45
}
