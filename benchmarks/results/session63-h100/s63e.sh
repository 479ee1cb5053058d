# Session 63: the shipped model's drafters (n-gram K=3, MTP K=3, DFlash K=7), closed batches 1 / 8 / 64 and steady state, current code (as s58g/h).
. .devsnap/pre.sh
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for a in "ngram 3" "mtp 3" "dflash 7"; do set -- $a
  echo "== $1 K=$2 (default: async)" | tee -a $OUT/drafters.log
  timeout 170 $B --e2e-drafter $1 --num-drafts $2 --out $OUT/bench-$1 2>&1 | grep --line-buffered -v Warn | head -16 | tee -a $OUT/drafters.log
  cp $OUT/bench-$1/drafter_e2e.json $OUT/drafter-$1.json 2>/dev/null
done
