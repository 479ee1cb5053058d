# Session 65: the shipped model's drafters (n-gram K=3, MTP K=3), closed batches 1 / 8 / 64 and steady state, current code (as s63e).
. .devsnap/pre.sh
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for a in "mtp 3" "ngram 3"; do set -- $a
  echo "== $1 K=$2 (default: async)" | tee -a $OUT/drafters.log
  timeout 170 $B --e2e-drafter $1 --num-drafts $2 --out $OUT/bench-$1 2>&1 | grep --line-buffered -v Warn | grep -v _warn_once | head -16 | tee -a $OUT/drafters.log
  cp $OUT/bench-$1/drafter_e2e.json $OUT/drafter-$1.json 2>/dev/null
  rm -rf $OUT/bench-$1
done
