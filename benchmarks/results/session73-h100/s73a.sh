# Session 73 (a): why held verifies are slower at alpha 0.8 batch 64 on the GPU (traces held / off, where the device idles), and where batch 1 alpha 0.8 loses to the ideal (trace + kernels).
. .devsnap/pre.sh > $OUT/card.txt
P="python3 -m metrale.bench.profile_e2e --shape qwen3-8b --forced --dcut --max-tokens 32 --alpha 0.8"
tr() { # $1 label $2 batch $3 METRALE_NO_HELD_VERIFY
  METRALE_NO_HELD_VERIFY=$3 timeout 110 $P --batch $2 --trace /tmp/tr-$1 2>&1 | grep "^==" >> $OUT/runs.log
  for k in plain spec; do
    echo "=== $1 $k" >> $OUT/gaps-$1.txt
    timeout 60 python3 benchmarks/trace_gaps.py /tmp/tr-$1/$k.json.gz --top 30 --gaps 6 >> $OUT/gaps-$1.txt 2>&1
  done
}
tr b64-held 64 0
tr b64-off 64 1
tr b1-held 1 0
timeout 100 $P --batch 1 --kernels 2>&1 | grep -v Warn | grep -v _warn | tail -36 > $OUT/b1-kernels.log
ls -la /tmp/tr-b64-held >> $OUT/runs.log
