# usage: bash this CASE ; dumps XLA output for one 06_tuned kernel and counts MMA kinds
case=$1; d=/tmp/dump_$case; rm -rf $d
XLA_FLAGS=--xla_dump_to=$d python3 experiments/triton_sweep.py --phase sass --sass-case $case 2>&1 | grep -v Warning
ls $d | head -50 > $OUT/dump_files_$case.txt
for f in $(grep -l "wgmma\|mma.sync" $d/*.ptx 2>/dev/null); do
  echo "== $case $f"; echo "wgmma lines: $(grep -c wgmma $f)  mma.sync lines: $(grep -c mma.sync $f)"
  grep -m3 "wgmma.mma_async\|mma.sync.aligned" $f
  /usr/local/cuda/bin/ptxas -arch=sm_90a $f -o /tmp/$case.cubin && /usr/local/cuda/bin/cuobjdump --dump-sass /tmp/$case.cubin > /tmp/$case.sass && echo "SASS HGMMA: $(grep -c HGMMA /tmp/$case.sass) HMMA: $(grep -c HMMA /tmp/$case.sass) FFMA: $(grep -c FFMA /tmp/$case.sass)" && grep -m2 "HGMMA\|HMMA" /tmp/$case.sass
done
grep -l "wgmma\|mma" $d/* 2>/dev/null | head
