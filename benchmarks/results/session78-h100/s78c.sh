# Session 78 (c): the shipped model's drafters (n-gram K=3, MTP K=3), closed batches 1 / 8 / 64 and steady state; then the replay drafter at qwen3-8b batch 1 alpha 0.8, D-Cut off.
. .devsnap/pre.sh > $OUT/card.txt
B="python3 -m metrale.cli bench --max-tokens 64 --device cuda --e2e-batch-sizes 1,8,64 --steady-requests-per-slot 4"
for a in "mtp 3" "ngram 3"; do set -- $a
  echo "== $1 K=$2 (default: async)" | tee -a $OUT/drafters.log
  timeout 170 $B --e2e-drafter $1 --num-drafts $2 --out $OUT/bench-$1 2>&1 | grep --line-buffered -v Warn | grep -v _warn_once | head -16 | tee -a $OUT/drafters.log
  cp $OUT/bench-$1/drafter_e2e.json $OUT/drafter-$1.json 2>/dev/null
  rm -rf $OUT/bench-$1
done
timeout 150 python3 -m metrale.cli bench --shape qwen3-8b --alpha 0.8 --num-drafts 3 --max-tokens 128 --batch-sizes 1 --e2e-batch-sizes 1 --out $OUT/replay > $OUT/replay-b1.log 2>&1
grep -E "^e2e" $OUT/replay-b1.log; cp $OUT/replay/bench.json $OUT/replay-b1.json; rm -rf $OUT/replay
