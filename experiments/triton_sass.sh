# Dumps XLA's compilation of one 06_tuned kernel and counts the MMA kinds.
# usage (GPU machine, repo root): bash experiments/triton_sass.sh tf32_nn
case=$1; d=/tmp/dump_$case; rm -rf $d
XLA_FLAGS=--xla_dump_to=$d python3 experiments/triton_sweep.py --phase sass --sass-case $case 2>&1 | grep -v Warning
echo "files of the kernel module:"; find $d | grep -i lambda | head -20
for f in $(grep -rl "wgmma\|mma.sync" $d 2>/dev/null | grep "\.ptx$"); do
  echo "== $case $f"; echo "wgmma lines: $(grep -c wgmma $f)  mma.sync lines: $(grep -c mma.sync $f)"
  grep -m2 "wgmma.mma_async\|mma.sync.aligned" $f
  /usr/local/cuda/bin/ptxas -arch=sm_90a $f -o /tmp/$case.cubin && /usr/local/cuda/bin/cuobjdump --dump-sass /tmp/$case.cubin > /tmp/$case.sass && echo "SASS HGMMA: $(grep -c HGMMA /tmp/$case.sass) HMMA: $(grep -c HMMA /tmp/$case.sass) FFMA: $(grep -c FFMA /tmp/$case.sass)" && grep -m2 "HGMMA\|HMMA" /tmp/$case.sass
done
echo "any file mentioning mma:"; grep -rl "wgmma\|mma\.sync\|nvvm.wgmma\|nvvm.mma" $d | head
